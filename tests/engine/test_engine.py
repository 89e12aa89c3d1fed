"""The training engine: checkpoints, model creation, the loop, configuration.

Tolerances (tests/README.md, tests/tolerances.py): learning rates and losses compared with pytest.approx are the same
float64 arithmetic in another order (1e-6 relative); the gradient accumulation states its bound inline."""
import json
import math
import re

import pytest
import timm
import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polaformer.checkpoint import atomic_write
from polaformer.engine import (
    ArchitectureMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ModelBuildError,
    build_optimizer,
    build_scheduler,
    create_model,
    create_model_from_checkpoint,
    load_model_state,
    read_run_checkpoint,
    save_checkpoint,
)
from polaformer.engine.config import ConfigError
from polaformer.engine.loop import Engine, LoopSettings, StepOutput, Task
from polaformer.engine.optim import global_batch_size, lr_scale, no_weight_decay_names
from polaformer.tasks.classification import (
    DEFAULT_MODEL,
    TrainConfig,
    TrainData,
    build_trainer,
    evaluate,
    evaluate_checkpoint,
    load_config,
    make_config,
    run_training,
)
from polaformer.tasks.classification.train import build_criterion, model_kwargs_for

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
    restored = create_model_from_checkpoint(read_run_checkpoint(path), path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)


def test_interrupted_write_of_a_new_file_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "metrics.json", lambda f: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_inside_a_writer_whose_cleanup_fails_is_still_an_interrupt(tmp_path):
    """torch's zip writer, interrupted mid-record, fails again in its own cleanup ("unexpected pos"): the command
    must still see Ctrl-C (status 130), not that RuntimeError, and the previous file must stay."""
    target = tmp_path / "checkpoint.pth"
    atomic_write(target, lambda f: f.write(b"previous"))

    def interrupted_writer(f):
        try:
            f.write(b"half")
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 31104 vs 30992")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, interrupted_writer)
    assert target.read_bytes() == b"previous"
    assert leftovers(tmp_path) == []


# --- loading errors --------------------------------------------------------------------------

def test_missing_checkpoint(tmp_path):
    path = tmp_path / "nope.pth"
    with pytest.raises(CheckpointNotFoundError) as info:
        read_run_checkpoint(path)
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
        read_run_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"corrupt or unreadable checkpoint: {path} (")
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_corrupt_checkpoint_reasons_are_short(tmp_path):
    path = tmp_path / "empty.pth"
    path.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"\(empty file\)$"):
        read_run_checkpoint(path)
    path.write_text("x\n")
    with pytest.raises(CorruptCheckpointError, match=r"\(UnpicklingError: Unsupported operand 120\)$"):
        read_run_checkpoint(path)


def test_truncated_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pth"
    save_tiny(path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        read_run_checkpoint(path)


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        read_run_checkpoint(tmp_path)


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": {}, "arch": "x", "model_kwargs": {}, "num_classes": 10, "hook": nn.ReLU()}, path)
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        read_run_checkpoint(path)


@pytest.mark.parametrize(
    "obj, reason",
    [(torch.zeros(3), "expected a dict, found Tensor"), ({"model": {}}, "not a polaformer checkpoint: no 'arch'")],
)
def test_valid_torch_file_that_is_not_a_checkpoint(tmp_path, obj, reason):
    path = tmp_path / "other.pth"
    torch.save(obj, path)
    with pytest.raises(CorruptCheckpointError, match=reason):
        read_run_checkpoint(path)


def test_checkpoint_of_another_architecture_names_both(tmp_path):
    path = save_tiny(tmp_path / "checkpoint.pth", arch="some_other_vit")
    with pytest.raises(ArchitectureMismatchError) as info:
        create_model_from_checkpoint(read_run_checkpoint(path), path, arch=TINY_ARCH)
    message = str(info.value)
    assert "'some_other_vit'" in message and f"'{TINY_ARCH}'" in message and str(path) in message


def test_weights_that_do_not_fit_the_model(tmp_path):
    path = save_tiny(tmp_path / "checkpoint.pth", tiny_model(depth=2, embed_dim=32))
    with pytest.raises(ArchitectureMismatchError) as info:
        load_model_state(tiny_model(), read_run_checkpoint(path), arch=TINY_ARCH, path=path)
    message = str(info.value)
    assert "does not fit" in message and "unexpected keys" in message and "shape mismatches" in message
    assert "\n" not in message


def test_checkpoint_round_trip(tmp_path):
    model = tiny_model()
    path = save_tiny(tmp_path / "checkpoint.pth", model)
    checkpoint = read_run_checkpoint(path)
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
    from polaformer.tasks.classification import config as config_module

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


class LinearTask(Task):
    """A linear classifier on a fixed tensor data set: the loop with nothing else around it."""

    name = "linear"
    best_files = {}

    def __init__(self, x, y, make_optimizer, make_scheduler):
        self.train_set = TensorDataset(x, y)
        self.make_optimizer, self.make_scheduler = make_optimizer, make_scheduler
        self.lrs, self.losses = [], []

    def build(self, engine, resuming):
        torch.manual_seed(1)
        return nn.Linear(self.train_set.tensors[0].shape[1], 3)

    def build_optimizer(self, model):
        return self.make_optimizer(model)

    def build_scheduler(self, optimizer, updates_per_epoch, total_updates):
        return self.make_scheduler(optimizer, updates_per_epoch)

    def step(self, model, batch, device):
        x, y = batch
        return StepOutput(nn.functional.cross_entropy(model(x), y), len(y))

    def evaluate(self, model, engine):
        return {}

    def record(self, engine, train, results):
        self.lrs.append(train["lr"])
        self.losses.append(train["loss"])
        return {"epoch": engine.epoch, "train_loss": train["loss"], "lr": train["lr"]}


def train_linear(tmp_path, x, y, make_optimizer, make_scheduler, **settings):
    task = LinearTask(x, y, make_optimizer, make_scheduler)
    engine = Engine(task, LoopSettings(output=tmp_path, device="cpu", show_progress=False, **settings))
    try:
        engine.fit()
    finally:
        engine.close()
    return engine, task


def test_the_loop_steps_the_schedule_per_update(tmp_path):
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    engine, task = train_linear(
        tmp_path, x, y, lambda model: create_optimizer_v2(model, opt="adamw", lr=0.1),
        lambda optimizer, per_epoch: CosineLRScheduler(optimizer, t_initial=3 * per_epoch, warmup_t=4,
                                                       warmup_lr_init=0.01, t_in_epochs=False),
        batch_size=8, epochs=3, clip_grad_norm=1.0,
    )
    assert engine.num_updates == 3 * (64 // 8)
    assert task.losses[-1] < task.losses[0]
    assert task.lrs[0] > task.lrs[1] > task.lrs[2]  # cosine decay across epochs after the 4-update warm-up


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


# --- optimisation ----------------------------------------------------------------------------

ATTENTION_TEMPERATURES = ("scale", "power", "positional_encoding", "s1", "s2")


@pytest.mark.parametrize("name",
                         ["pola_deit_tiny_patch16_224", "pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0"])
def test_no_weight_decay_on_norms_biases_positions_and_temperatures(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    no_decay = no_weight_decay_names(model)
    for param_name, param in model.named_parameters():
        leaf = param_name.rsplit(".", 1)[-1]
        exempt = (param.ndim <= 1 or leaf in ATTENTION_TEMPERATURES or "pos_embed" in leaf
                  or leaf in ("cls_token", "relative_position_bias_table"))
        assert (param_name in no_decay) == exempt, param_name
    groups = build_optimizer(load_config(None, ["TRAIN.WEIGHT_DECAY", "0.05"]), model).param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_learning_rates_scale_with_the_global_batch():
    cfg = load_config(None, ["DATA.BATCH_SIZE", "128", "TRAIN.ACCUMULATION_STEPS", "2"])
    assert global_batch_size(cfg, 8) == 2048
    assert lr_scale(cfg, 8) == 4.0  # the official BASE_LR x global batch / 512
    optimizer = build_optimizer(cfg, nn.Linear(4, 2))  # one process here: 256 / 512
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * 0.5)
    assert lr_scale(load_config(None, ["TRAIN.BASE_BATCH_SIZE", "0"]), 8) == 1.0


def test_cosine_schedule_with_warmup_and_cooldown():
    cfg = load_config(None, [
        "TRAIN.EPOCHS", "10", "TRAIN.WARMUP_EPOCHS", "2", "TRAIN.COOLDOWN_EPOCHS", "3", "TRAIN.BASE_BATCH_SIZE", "0",
        "TRAIN.BASE_LR", "1e-3", "TRAIN.WARMUP_LR", "1e-6", "TRAIN.MIN_LR", "1e-5",
    ])
    optimizer = build_optimizer(cfg, nn.Linear(4, 2))
    steps = 5  # updates per epoch
    scheduler = build_scheduler(cfg, optimizer, steps)

    def lr_at(update):
        scheduler.step_update(num_updates=update)
        return optimizer.param_groups[0]["lr"]

    assert lr_at(0) == pytest.approx(1e-6)
    assert lr_at(5) == pytest.approx(1e-6 + (1e-3 - 1e-6) / 2)  # linear warm-up over 10 updates
    assert lr_at(10) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 10 / 50)))
    assert lr_at(49) > 1e-5
    assert lr_at(50) == pytest.approx(1e-5) and lr_at(64) == pytest.approx(1e-5)  # cool-down at MIN_LR
    assert all(g["lr"] == optimizer.param_groups[0]["lr"] for g in optimizer.param_groups)


def test_loss_follows_the_official_choice():
    mixup = Mixup(mixup_alpha=0.8, num_classes=10)
    assert isinstance(build_criterion(load_config(), mixup), SoftTargetCrossEntropy)
    assert isinstance(build_criterion(load_config(), None), LabelSmoothingCrossEntropy)
    assert type(build_criterion(load_config(None, ["MODEL.LABEL_SMOOTHING", "0"]), None)) is nn.CrossEntropyLoss


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    weights = []
    cfg = load_config(None, ["TRAIN.BASE_BATCH_SIZE", "0", "TRAIN.EPOCHS", "1", "TRAIN.WARMUP_EPOCHS", "0"])
    for batch_size, steps in ((16, 1), (8, 2)):
        engine, _ = train_linear(tmp_path / f"{batch_size}", x, y, lambda model: build_optimizer(cfg, model),
                                 lambda optimizer, per_epoch: build_scheduler(cfg, optimizer, per_epoch),
                                 batch_size=batch_size, epochs=1, accumulation_steps=steps, clip_grad_norm=1.0)
        assert engine.num_updates == 4
        weights.append(engine.model.weight.detach().clone())
    # The gradients (sums over 16 examples, in 2 parts or 1) agree to reorder_rtol(16)·κ ≈ 4e-6·κ; each AdamW update
    # (lr 5e-4) moves by at most about 2·lr times that, 4 of them: 1e-6 holds for gradient conditions κ up to 60.
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


# --- the trainer on small random data --------------------------------------------------------

NUM_CLASSES = 4
TINY_OPTS = [
    "MODEL.NAME", "pola_deit_digits", "MODEL.DROP_PATH_RATE", "0.1", "DATA.IMG_SIZE", "16", "DATA.BATCH_SIZE", "8",
    "DATA.NUM_WORKERS", "0", "TRAIN.EPOCHS", "2", "TRAIN.WARMUP_EPOCHS", "1", "TRAIN.BASE_LR", "1e-3",
    "TEST.BATCH_SIZE", "16", "DEVICE", "cpu", "MODEL.KWARGS", "{in_chans: 3, embed_dim: 16, depth: 1, num_heads: 1}",
    "AUG.MIXUP", "0", "AUG.CUTMIX", "0",
]


def random_data(mixup=None, n_train=48, n_val=20):
    generator = torch.Generator().manual_seed(0)

    def dataset(n):
        return TensorDataset(torch.randn(n, 3, 16, 16, generator=generator),
                             torch.randint(0, NUM_CLASSES, (n,), generator=generator))

    return TrainData(dataset(n_train), dataset(n_val), NUM_CLASSES, mixup=mixup)


def tiny_config(tmp_path, *opts):
    return load_config(None, [*TINY_OPTS, "OUTPUT", str(tmp_path), *opts])


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trainer_writes_last_best_and_metrics(tmp_path):
    summary = run_training(tiny_config(tmp_path), data=random_data())
    records = jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [1, 2] and records == summary["epochs"]
    for record in records:
        assert {"train_loss", "lr", "test_top1", "test_top5", "test_loss", "images_per_s", "skipped_images",
                "epoch_time_s", "max_test_top1"} <= set(record)
        assert math.isfinite(record["train_loss"]) and record["images_per_s"] > 0
    assert summary["best_test_top1"] == max(r["test_top1"] for r in records)
    assert json.loads((tmp_path / "metrics.json").read_text()) == json.loads(json.dumps(summary))
    last = torch.load(tmp_path / "last.pth", weights_only=True)
    assert (last["epoch"], last["step"], last["num_updates"]) == (2, 0, 12)
    assert {"model", "optimizer", "lr_scheduler", "scaler", "max_accuracy", "config", "arch", "model_kwargs",
            "num_classes", "rng"} <= set(last)
    assert last["config"]["MODEL"]["NUM_CLASSES"] == NUM_CLASSES and len(last["rng"]) == 1
    best = torch.load(tmp_path / "best.pth", weights_only=True)
    assert best["max_accuracy"] == summary["best_test_top1"]
    assert leftovers(tmp_path) == []
    # The public loader reads our checkpoints.
    from polaformer.checkpoint import load_checkpoint as load_weights

    model = create_model("pola_deit_digits", NUM_CLASSES, **last["model_kwargs"])
    assert load_weights(model, tmp_path / "last.pth").epoch == 2


def test_ema_amp_and_activation_checkpointing(tmp_path):
    cfg = tiny_config(tmp_path, "TRAIN.EMA.ENABLE", "true", "TRAIN.EMA.DECAY", "0.9", "AMP", "true",
                      "TRAIN.USE_CHECKPOINT", "true", "TRAIN.EPOCHS", "1")
    trainer = build_trainer(cfg, data=random_data())
    assert trainer.amp_dtype == torch.bfloat16 and not trainer.scaler.is_enabled()  # bf16 on the CPU
    assert trainer.model.grad_checkpointing
    summary = trainer.fit()
    trainer.close()
    record = summary["epochs"][0]
    assert {"ema_top1", "ema_top5", "ema_loss"} <= set(record) and "best_ema_top1" in summary
    checkpoint = torch.load(tmp_path / "last.pth", weights_only=True)
    ema, raw = checkpoint["model_ema"], checkpoint["model"]
    assert ema.keys() == raw.keys() and any(not torch.equal(ema[k], raw[k]) for k in raw)
    assert (tmp_path / "best_ema.pth").is_file()


def test_mixup_trains_with_soft_targets(tmp_path):
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=NUM_CLASSES)
    trainer = build_trainer(tiny_config(tmp_path, "TRAIN.EPOCHS", "1"), data=random_data(mixup))
    assert isinstance(trainer.task.criterion, SoftTargetCrossEntropy)
    summary = trainer.fit()
    trainer.close()
    assert math.isfinite(summary["epochs"][0]["train_loss"])


def test_resume_auto_extends_a_finished_run(tmp_path):
    first = run_training(tiny_config(tmp_path, "TRAIN.EPOCHS", "1", "TRAIN.AUTO_RESUME", "true"), data=random_data())
    assert len(first["epochs"]) == 1
    second = run_training(tiny_config(tmp_path, "TRAIN.AUTO_RESUME", "true"), data=random_data())
    assert [r["epoch"] for r in second["epochs"]] == [1, 2] and second["epochs"][0] == first["epochs"][0]
    assert [r["epoch"] for r in jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_resume_refuses_another_architecture(tmp_path):
    run_training(tiny_config(tmp_path, "TRAIN.EPOCHS", "1"), data=random_data())
    other = tiny_config(tmp_path, "MODEL.RESUME", str(tmp_path / "last.pth"), "MODEL.KWARGS.embed_dim", "32")
    with pytest.raises(ConfigError, match="was trained with MODEL.KWARGS.embed_dim = "):
        build_trainer(other, data=random_data())
    with pytest.raises(ArchitectureMismatchError, match="does not fit"):  # allowed, the weights still cannot fit
        build_trainer(tiny_config(tmp_path, "MODEL.RESUME", str(tmp_path / "last.pth"), "MODEL.KWARGS.embed_dim", "32",
                                  "ALLOW_CHANGED", "[MODEL.KWARGS.embed_dim]"), data=random_data())


def test_a_batch_of_unreadable_images_is_skipped_and_counted(tmp_path):
    """Batches as ``polaformer.data.folder.collate_skip_corrupt`` makes them: (images, targets, skipped)."""
    data = random_data()

    def collate(samples):
        images, targets = torch.utils.data.default_collate(samples)
        return images[1:], targets[1:], 1  # one unreadable image per batch

    data.train_collate = data.val_collate = collate
    summary = run_training(tiny_config(tmp_path, "TRAIN.EPOCHS", "1"), data=data)
    record = summary["epochs"][0]
    assert record["skipped_images"] == 48 // 8 + math.ceil(20 / 16)


def test_digits_run_is_the_config_run(tmp_path):
    """`polaformer train` (TrainConfig) and the same settings as a Config give the same weights."""
    kwargs = {k: v for k, v in TINY_KWARGS.items() if k not in ("in_chans", "img_size")}
    train_config = make_config(TINY_ARCH, model_kwargs=kwargs, epochs=1, batch_size=256, output=str(tmp_path / "a"))
    run_training(train_config)
    from polaformer.tasks.classification import config_from_train_config

    cfg = config_from_train_config(train_config)
    cfg.OUTPUT = str(tmp_path / "b")
    run_training(cfg)
    a = torch.load(tmp_path / "a" / "checkpoint.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "checkpoint.pth", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def make_image_folder(root, classes=3, train_per_class=4, val_per_class=2, size=40):
    """DIR/{train,val}/<class>/ with JPEG and PNG images, and one corrupt file in train/."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()
                pixels[..., c % 3] = 255 if c < 3 else 0  # a class cue
                Image.fromarray(pixels).save(folder / f"img_{i}.{'png' if i % 2 else 'jpg'}")
    (root / "train" / "class_0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    return root


def test_train_on_an_image_folder_from_the_command_line(tmp_path, capsys):
    from polaformer.cli import main

    data = make_image_folder(tmp_path / "data", train_per_class=5)  # 16 files: every one is in a batch
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "MODEL:\n  NAME: pola_deit_digits\n  DROP_PATH_RATE: 0.0\n"
        "  KWARGS: {in_chans: 3, embed_dim: 16, depth: 1, num_heads: 1, patch_size: 8}\n"
        "DATA:\n  IMG_SIZE: 32\n  BATCH_SIZE: 4\n  NUM_WORKERS: 0\n"
        "TRAIN:\n  EPOCHS: 2\n  WARMUP_EPOCHS: 1\n"
        "AUG:\n  AUTO_AUGMENT: none\n"  # Mixup/CutMix stay on (official defaults): soft targets
    )
    output = tmp_path / "out"
    code = main(["train", "--config", str(config), "--data-path", str(data), "--output", str(output),
                 "--device", "cpu", "--opts", "TRAIN.SAVE_FREQ_STEPS", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = jsonl(output / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [1, 2]
    # The corrupt file: skipped with a warning, counted in every epoch's summary.
    assert all(r["skipped_images"] == 1 for r in records) and "broken.jpg" in err
    assert out.strip().startswith("best top-1: ") and out.strip().endswith(f"-> {output}")
    last = torch.load(output / "last.pth", weights_only=True)
    assert last["num_classes"] == 3 and last["config"]["DATA"]["DATA_PATH"] == str(data)
    assert last["class_names"] == ["class_0", "class_1", "class_2"]  # what `eval` checks another folder against
    assert last["model_kwargs"]["img_size"] == 32 and last["num_updates"] == 2 * (16 // 4)


class SettingsTask(LinearTask):
    """The linear task with a configuration: a learning rate, a batch size, and a length that may change."""

    resume_may_change = ("train.steps",)

    def __init__(self, settings, *args):
        super().__init__(*args)
        self.config = settings

    def settings(self):
        return self.config


def test_resume_compares_every_setting_and_allows_what_is_named(tmp_path):
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    constant = lambda optimizer, per_epoch: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # noqa: E731

    def run(folder, settings, steps, **loop):
        engine = Engine(SettingsTask(settings, x, y, sgd, constant), LoopSettings(
            output=folder, device="cpu", show_progress=False, batch_size=8, steps=steps, **loop))
        try:
            engine.fit()
        finally:
            engine.close()

    first = {"train": {"lr": 0.1, "batch_size": 8, "steps": 2}, "model": {"dims": [4, 3]}}
    run(tmp_path / "a", first, 2)
    last = tmp_path / "a" / "last.pth"
    longer = {**first, "train": {**first["train"], "steps": 4}}
    run(tmp_path / "b", longer, 4, resume=str(last))  # the length may change
    changed = {**first, "train": {**first["train"], "lr": 0.5, "steps": 4}}
    message = (rf"^{re.escape(str(last))} was trained with train.lr = 0.1, this run asks for "
               r"0.5: --allow-changed train.lr continues the run with the new value$")
    with pytest.raises(ConfigError, match=message):
        run(tmp_path / "c", changed, 4, resume=str(last))
    run(tmp_path / "d", changed, 4, resume=str(last), allow_changed=("train.lr",))
    model = {**first, "model": {"dims": [4, 5]}}
    with pytest.raises(ConfigError, match=r"model.dims = \[4, 3\], this run asks for \[4, 5\]"):
        run(tmp_path / "e", model, 4, resume=str(last))
    run(tmp_path / "f", model, 4, resume=str(last), allow_changed=("model",))  # a section allows its keys
    with pytest.raises(ConfigError, match="--allow-changed train.lrr: no setting of a linear run has this name"):
        run(tmp_path / "g", changed, 4, resume=str(last), allow_changed=("train.lrr",))
