"""The training engine: checkpoints, model creation, the loop, configuration."""
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polaformer.engine import (
    DEFAULT_MODEL,
    ArchitectureMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ModelBuildError,
    TrainConfig,
    atomic_write,
    create_model,
    create_model_from_checkpoint,
    evaluate,
    evaluate_checkpoint,
    load_checkpoint,
    load_model_state,
    make_config,
    run_training,
    save_checkpoint,
    train_one_epoch,
)
from polaformer.engine.train import model_kwargs_for

# A ViT small enough to train for an epoch on digits in about a second.
TINY_ARCH = "vit_tiny_patch16_224"
TINY_KWARGS = {"in_chans": 1, "img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 1}


def tiny_model(**overrides):
    return create_model(TINY_ARCH, 10, **{**TINY_KWARGS, **overrides})


def save_tiny(path, model=None, arch=TINY_ARCH, **kwargs):
    return save_checkpoint(
        path, model or tiny_model(), arch=arch, model_kwargs=kwargs or TINY_KWARGS,
        num_classes=10, epoch=1, metrics={"test_top1": 50.0},
    )


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# --- atomic writes ---------------------------------------------------------------------------

def test_atomic_write_leaves_only_the_target(tmp_path):
    target = tmp_path / "sub" / "file.bin"
    atomic_write(target, lambda f: f.write(b"one"))
    atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    assert leftovers(target.parent) == []


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pth"
    model = tiny_model()
    save_tiny(path, model)
    before = path.read_bytes()

    def broken_save(obj, f):
        f.write(b"half a checkpoint")  # something reached the temporary file before the failure
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_tiny(path, tiny_model())
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []
    restored = create_model_from_checkpoint(load_checkpoint(path), path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)


def test_interrupted_write_of_a_new_file_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "metrics.json", lambda f: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert list(tmp_path.iterdir()) == []


# --- loading errors --------------------------------------------------------------------------

def test_missing_checkpoint(tmp_path):
    path = tmp_path / "nope.pth"
    with pytest.raises(CheckpointNotFoundError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"checkpoint not found: {path}"
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a checkpoint at all", b"\x80\x02garbage"],
    ids=["empty", "text", "bad-pickle"],
)
def test_corrupt_checkpoint(tmp_path, content):
    path = tmp_path / "bad.pth"
    path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"corrupt or unreadable checkpoint: {path} (")
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_corrupt_checkpoint_reasons_are_short(tmp_path):
    path = tmp_path / "empty.pth"
    path.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"\(empty file\)$"):
        load_checkpoint(path)
    path.write_text("x\n")
    with pytest.raises(CorruptCheckpointError, match=r"\(UnpicklingError: Unsupported operand 120\)$"):
        load_checkpoint(path)


def test_truncated_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pth"
    save_tiny(path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        load_checkpoint(path)


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        load_checkpoint(tmp_path)


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": {}, "arch": "x", "model_kwargs": {}, "num_classes": 10, "hook": nn.ReLU()}, path)
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "obj, reason",
    [(torch.zeros(3), "expected a dict, found Tensor"), ({"model": {}}, "not a polaformer checkpoint: no 'arch'")],
)
def test_valid_torch_file_that_is_not_a_checkpoint(tmp_path, obj, reason):
    path = tmp_path / "other.pth"
    torch.save(obj, path)
    with pytest.raises(CorruptCheckpointError, match=reason):
        load_checkpoint(path)


def test_checkpoint_of_another_architecture_names_both(tmp_path):
    path = save_tiny(tmp_path / "checkpoint.pth", arch="some_other_vit")
    with pytest.raises(ArchitectureMismatchError) as info:
        create_model_from_checkpoint(load_checkpoint(path), path, arch=TINY_ARCH)
    message = str(info.value)
    assert "'some_other_vit'" in message and f"'{TINY_ARCH}'" in message and str(path) in message


def test_weights_that_do_not_fit_the_model(tmp_path):
    path = save_tiny(tmp_path / "checkpoint.pth", tiny_model(depth=2, embed_dim=32))
    with pytest.raises(ArchitectureMismatchError) as info:
        load_model_state(tiny_model(), load_checkpoint(path), arch=TINY_ARCH, path=path)
    message = str(info.value)
    assert "does not fit" in message and "unexpected keys" in message and "shape mismatches" in message
    assert "\n" not in message


def test_checkpoint_round_trip(tmp_path):
    model = tiny_model()
    path = save_tiny(tmp_path / "checkpoint.pth", model)
    checkpoint = load_checkpoint(path)
    assert checkpoint["arch"] == TINY_ARCH
    assert checkpoint["model_kwargs"] == TINY_KWARGS
    assert (checkpoint["num_classes"], checkpoint["epoch"], checkpoint["metrics"]) == (10, 1, {"test_top1": 50.0})
    x = torch.randn(2, 1, 8, 8)
    model.eval()
    torch.testing.assert_close(create_model_from_checkpoint(checkpoint, path).eval()(x), model(x))


# --- model creation --------------------------------------------------------------------------

def test_unknown_model():
    with pytest.raises(ModelBuildError, match="unknown model 'no_such_model'"):
        create_model("no_such_model", 10)


def test_bad_model_kwargs():
    with pytest.raises(ModelBuildError, match="cannot build model"):
        create_model(TINY_ARCH, 10, **TINY_KWARGS, no_such_option=3)


def test_default_digits_model_builds():
    config = make_config()
    model = create_model(config.model, 10, **model_kwargs_for(config))
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


# --- configuration ---------------------------------------------------------------------------

def test_make_config_layers_defaults_preset_and_overrides(monkeypatch):
    from polaformer.engine import config as config_module

    monkeypatch.setitem(config_module.DIGITS_PRESETS, "m", {"model_kwargs": {"depth": 4, "embed_dim": 64}, "lr": 0.5})
    config = make_config("m", model_kwargs={"depth": 2}, epochs=3, batch_size=None)
    assert config.model_kwargs == {"depth": 2, "embed_dim": 64}
    assert (config.lr, config.epochs, config.batch_size) == (0.5, 3, TrainConfig.batch_size)
    assert make_config("m", lr=0.1).lr == 0.1
    assert make_config().model == DEFAULT_MODEL


# --- the loop --------------------------------------------------------------------------------

class Identity(nn.Module):
    """Returns its input as logits: lets a test choose exactly what the 'model' predicts."""

    def forward(self, x):
        return x


def test_evaluate_counts_top1_and_top5():
    # Row i predicts class 0 best, then 1, 2, ...; targets 0, 1, 5, 9 are at ranks 1, 2, 6, 10.
    logits = torch.linspace(1, 0, 10).repeat(4, 1)
    targets = torch.tensor([0, 1, 5, 9])
    loader = DataLoader(TensorDataset(logits, targets), batch_size=3)
    metrics = evaluate(Identity(), loader)
    assert metrics["top1"] == 25.0
    assert metrics["top5"] == 50.0
    expected_loss = nn.functional.cross_entropy(logits, targets).item()
    assert metrics["loss"] == pytest.approx(expected_loss)


def test_train_one_epoch_steps_the_schedule_per_update():
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model = nn.Linear(4, 2)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=0.1)
    scheduler = CosineLRScheduler(optimizer, t_initial=3 * len(loader), warmup_t=4, warmup_lr_init=0.01, t_in_epochs=False)
    lrs = []
    first = None
    for epoch in range(3):
        result = train_one_epoch(model, loader, optimizer, scheduler, nn.CrossEntropyLoss(),
                                 num_updates=epoch * len(loader), clip_grad=1.0)
        first = first or result["loss"]
        lrs.append(result["lr"])
    assert result["num_updates"] == 3 * len(loader)
    assert result["loss"] < first
    assert lrs[0] > lrs[1] > lrs[2]  # cosine decay across epochs after the 4-update warm-up


def test_run_training_writes_checkpoint_and_metrics(tmp_path):
    config = make_config(
        TINY_ARCH, model_kwargs={k: v for k, v in TINY_KWARGS.items() if k not in ("in_chans", "img_size")},
        epochs=1, batch_size=128, output=str(tmp_path),
    )
    result = run_training(config)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert len(saved["epochs"]) == 1
    assert saved["final_test_top1"] == saved["epochs"][-1]["test_top1"]
    assert saved["config"]["model"] == TINY_ARCH
    assert leftovers(tmp_path) == []

    metrics, checkpoint = evaluate_checkpoint(tmp_path / "checkpoint.pth")
    assert metrics["top1"] == saved["final_test_top1"]  # exactly: same weights, same batches
    assert TINY_KWARGS.items() <= checkpoint["model_kwargs"].items()  # merged into the model's preset
