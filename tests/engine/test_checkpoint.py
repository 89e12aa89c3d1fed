"""polaformer.load_checkpoint and timm's pretrained=True on the authors' checkpoint files, ours,
plain state dicts and safetensors; files that would run code are refused."""
import argparse
import logging
import os
import pickle
import sys
import types
from contextlib import contextmanager

import pytest
import safetensors.torch
import timm
import torch

import polaformer.models  # noqa: F401  (registers the models with timm)
from polaformer import LoadResult, load_checkpoint
from polaformer.checkpoint import (
    ArchitectureMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingWeightsError,
    UnsafeCheckpointError,
)
from polaformer.engine import read_run_checkpoint, save_checkpoint

# A yacs configuration as the official scripts build it (nested nodes, None, lists, tuples).
CONFIG = {
    "MODEL": {"TYPE": "pola_deit", "NAME": "digits", "DROP_PATH_RATE": 0.1, "NUM_CLASSES": 10},
    "TRAIN": {"EPOCHS": 300, "BASE_LR": 5e-4, "LR_SCHEDULER": {"NAME": "cosine", "MULTISTEPS": []}},
    "AUG": {"MIXUP_MINMAX": None, "COLOR_JITTER": 0.4},
    "DATA": {"IMG_SIZE": 224, "MEAN": (0.485, 0.456, 0.406)},
    "TAG": "default",
    "EVAL_MODE": False,
}


def digits(**kwargs):
    return timm.create_model("pola_deit_digits", **kwargs)


@contextmanager
def fake_yacs():
    """Modules ``yacs`` / ``yacs.config`` with a ``CfgNode`` that pickles as yacs' does, only inside the block.

    Like yacs' class: a dict of settings (nested nodes for nested dicts), bookkeeping in ``__dict__``.
    """

    class CfgNode(dict):
        def __init__(self, init_dict=None):
            super().__init__({k: CfgNode(v) if isinstance(v, dict) else v for k, v in (init_dict or {}).items()})
            self.__dict__.update({
                "__immutable__": False, "__deprecated_keys__": set(),
                "__renamed_keys__": {"OLD.KEY": ("NEW.KEY", "renamed")}, "__new_allowed__": False,
            })

        def freeze(self):
            self.__dict__["__immutable__"] = True
            for value in self.values():
                if isinstance(value, CfgNode):
                    value.freeze()
            return self

    CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"
    package, module = types.ModuleType("yacs"), types.ModuleType("yacs.config")
    package.config, module.CfgNode = module, CfgNode
    assert "yacs" not in sys.modules  # the real one must not be installed, nor imported by the loader
    sys.modules.update({"yacs": package, "yacs.config": module})
    try:
        yield CfgNode
    finally:
        del sys.modules["yacs"], sys.modules["yacs.config"]


def save_official(path, model, *, ema=None, prefix="", extra_weights=None):
    """Write what the official training scripts write (PolaFormer; PolaFormer++ when ``ema`` is given)."""
    with fake_yacs() as CfgNode:
        checkpoint = {
            "model": {**{prefix + k: v for k, v in model.state_dict().items()}, **(extra_weights or {})},
            "optimizer": torch.optim.AdamW(model.parameters(), lr=5e-4).state_dict(),
            "lr_scheduler": {"t_initial": 300, "warmup_t": 20, "base_values": [5e-4], "noise_range_t": None},
            "max_accuracy": torch.tensor(74.5),
            "epoch": 300,
            "config": CfgNode(CONFIG).freeze(),
        }
        if ema is not None:
            checkpoint["state_dict_ema"] = ema.state_dict()
            checkpoint["max_accuracy_e"] = 75.25
        torch.save(checkpoint, path)
    return path


def assert_weights(model, state_dict):
    loaded = model.state_dict()
    assert loaded.keys() == state_dict.keys()
    for key, value in state_dict.items():
        assert torch.equal(loaded[key], value), key


# --- formats ---------------------------------------------------------------------------------

def test_polaformer_training_checkpoint(tmp_path):
    source = digits()
    path = save_official(tmp_path / "max_acc.pth", source)
    # The premise: the file names yacs' class, which plain weights-only loading refuses.
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == ["yacs.config.CfgNode"]
    allowed_before = torch.serialization.get_safe_globals()

    model = digits()
    result = load_checkpoint(model, path)

    assert_weights(model, source.state_dict())
    assert isinstance(result, LoadResult)
    assert (result.entry, result.epoch, result.max_accuracy, result.max_accuracy_ema) == ("model", 300, 74.5, None)
    assert result.missing_keys == result.unexpected_keys == result.mismatched_keys == []
    assert result.config == CONFIG
    assert type(result.config) is dict and type(result.config["TRAIN"]["LR_SCHEDULER"]) is dict
    assert "yacs" not in sys.modules
    assert torch.serialization.get_safe_globals() == allowed_before  # the allow-list was only lent


def test_allow_list_entries_made_by_the_user_survive(tmp_path):
    path = save_official(tmp_path / "max_acc.pth", digits())
    with torch.serialization.safe_globals([argparse.Namespace]):  # which the loader allows as well
        load_checkpoint(digits(), path)
        assert argparse.Namespace in torch.serialization.get_safe_globals()


@pytest.fixture
def polaformer_pp_file(tmp_path):
    """A PolaFormer++ checkpoint whose raw weights carry DDP's 'module.' prefix; (path, raw, ema)."""
    raw, ema = digits(), digits()
    return save_official(tmp_path / "max_ema_acc.pth", raw, ema=ema, prefix="module."), raw, ema


@pytest.mark.parametrize("weights, entry", [("auto", "state_dict_ema"), ("ema", "state_dict_ema"), ("raw", "model")])
def test_polaformer_pp_ema_or_raw_weights(polaformer_pp_file, weights, entry):
    path, raw, ema = polaformer_pp_file
    model = digits()
    result = load_checkpoint(model, path, weights=weights)
    assert result.entry == entry
    assert_weights(model, (ema if entry == "state_dict_ema" else raw).state_dict())
    assert (result.max_accuracy, result.max_accuracy_ema) == (74.5, 75.25)


def test_ema_requested_from_a_file_without_ema(tmp_path):
    path = save_official(tmp_path / "ckpt_epoch_10.pth", digits())
    with pytest.raises(MissingWeightsError) as info:
        load_checkpoint(digits(), path, weights="ema")
    assert str(info.value) == f"{path} has no EMA weights (it holds 'model'); use weights='raw' or 'auto'"
    plain = tmp_path / "plain.pth"
    torch.save(digits().state_dict(), plain)
    with pytest.raises(MissingWeightsError, match="plain state dict, with no EMA weights"):
        load_checkpoint(digits(), plain, weights="ema")


def test_unknown_weights_choice():
    with pytest.raises(ValueError, match="weights must be 'auto', 'ema' or 'raw'"):
        load_checkpoint(digits(), "unused.pth", weights="best")


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_plain_state_dict(tmp_path, suffix):
    source = digits()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        safetensors.torch.save_file(source.state_dict(), path)
    else:
        torch.save({"module." + k: v for k, v in source.state_dict().items()}, path)
    model = digits()
    result = load_checkpoint(model, path)
    assert_weights(model, source.state_dict())
    assert (result.entry, result.epoch, result.config) == (None, None, None)


def test_our_training_checkpoint(tmp_path):
    source = digits()
    path = save_checkpoint(
        tmp_path / "checkpoint.pth", source, arch="pola_deit_digits", model_kwargs={}, num_classes=10,
        epoch=7, metrics={"test_top1": 90.0}, config={"data": "digits", "lr": 1e-3},
    )
    model = digits()
    result = load_checkpoint(model, path)
    assert_weights(model, source.state_dict())
    assert (result.entry, result.epoch, result.max_accuracy) == ("model", 7, None)
    assert result.config == {"data": "digits", "lr": 1e-3}


def test_engine_reads_official_files_safely_but_wants_its_own(tmp_path):
    path = save_official(tmp_path / "max_acc.pth", digits())
    with pytest.raises(CorruptCheckpointError, match="not a polaformer checkpoint: no 'arch'"):
        read_run_checkpoint(path)


# --- timm: pretrained=True with a local file -------------------------------------------------

@pytest.mark.parametrize("flavour", ["polaformer", "polaformer++"])
def test_timm_create_model_reads_official_files(tmp_path, flavour):
    name, size = "pola_deit_tiny_patch16_224", dict(depth=2)  # two blocks keep it fast
    raw, ema = timm.create_model(name, **size), timm.create_model(name, **size)
    if flavour == "polaformer":
        path, expected = save_official(tmp_path / "max_acc.pth", raw), raw
    else:
        path, expected = save_official(tmp_path / "max_ema_acc.pth", raw, ema=ema, prefix="module."), ema
    allowed_before = torch.serialization.get_safe_globals()
    with pytest.raises(RuntimeError, match="weights_only=True blocked"):  # timm alone refuses these files
        timm.models.load_checkpoint(timm.create_model(name, **size), str(path))

    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **size)

    assert_weights(model, expected.state_dict())  # timm, like load_checkpoint, prefers the EMA weights
    assert torch.serialization.get_safe_globals() == allowed_before
    assert "yacs" not in sys.modules


# --- refusals and errors ---------------------------------------------------------------------

class RunsShellCommand:
    """Unpickling this runs ``command``: the classic malicious checkpoint."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_pickled_code_is_refused_and_never_run(tmp_path, writer):
    marker = tmp_path / "pwned"
    # The command comes first: a plain pickle of tensors would be refused for naming torch's own helpers.
    payload = {"config": RunsShellCommand(f"touch {marker}"), "model": digits().state_dict(), "epoch": 1}
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        torch.save(payload, f) if writer == "torch.save" else pickle.dump(payload, f, protocol=2)

    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(digits(), path)
    message = str(info.value)
    assert message == (
        f"corrupt or unreadable checkpoint: {path} (refused to run code it names: {os.system.__module__}.system; "
        "only tensors and plain data are loaded)"
    )
    with pytest.raises(RuntimeError, match="weights_only=True blocked"):  # timm refuses it too
        timm.create_model("pola_deit_digits", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert not marker.exists()


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.pth"
    with pytest.raises(CheckpointNotFoundError, match=f"^checkpoint not found: {path}$"):
        load_checkpoint(digits(), path)


@pytest.mark.parametrize(
    "name, content",
    [("empty.pth", b""), ("text.pth", b"not a checkpoint"), ("bad.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{]")],
)
def test_corrupt_files(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CorruptCheckpointError) as info:
        load_checkpoint(digits(), path)
    assert str(info.value).startswith(f"corrupt or unreadable checkpoint: {path} (")
    assert "\n" not in str(info.value)


def test_truncated_official_file(tmp_path):
    path = save_official(tmp_path / "max_acc.pth", digits())
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CorruptCheckpointError, match="corrupt or unreadable checkpoint"):
        load_checkpoint(digits(), path)


@pytest.mark.parametrize(
    "content, reason",
    [(torch.zeros(3), "expected a dict, found Tensor"), ({"epoch": 3}, "no weights: neither a state dict")],
)
def test_files_without_weights(tmp_path, content, reason):
    path = tmp_path / "other.pth"
    torch.save(content, path)
    with pytest.raises(CorruptCheckpointError, match=reason):
        load_checkpoint(digits(), path)


# --- keys that do not fit --------------------------------------------------------------------

@pytest.fixture
def smaller_model_file(tmp_path):
    """An official file from a 2-block, 5-class model, plus one key no model has; (path, source)."""
    source = digits(depth=2, num_classes=5)
    return save_official(tmp_path / "small.pth", source, extra_weights={"extra.weight": torch.ones(1)}), source


def test_strict_mismatch_is_one_readable_error(smaller_model_file):
    path, _ = smaller_model_file
    model = digits()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArchitectureMismatchError) as info:
        load_checkpoint(model, path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} ('model' weights) does not fit PolaDeiT: 32 missing keys (e.g. ")
    assert "1 unexpected keys (e.g. 'extra.weight')" in message
    assert "2 shape mismatches (e.g. 'head.weight': checkpoint (5, 64), model (10, 64); 'head.bias'" in message
    assert message.endswith("strict=False loads the keys that fit") and "\n" not in message
    assert_weights(model, before)  # nothing was loaded


def test_non_strict_loads_what_fits_and_reports_the_rest(smaller_model_file, caplog):
    path, source = smaller_model_file
    model = digits()
    head = model.head.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="polaformer.checkpoint"):
        result = load_checkpoint(model, path, strict=False)
    assert len(result.missing_keys) == 32 and all(k.startswith(("blocks.2.", "blocks.3.")) for k in result.missing_keys)
    assert result.unexpected_keys == ["extra.weight"]
    assert result.mismatched_keys == ["head.weight", "head.bias"]
    assert "partially: 32 missing keys" in caplog.text
    assert torch.equal(model.head.weight, head)
    for key, value in source.state_dict().items():
        if key.startswith(("blocks.0.", "blocks.1.", "patch_embed", "norm.")):
            assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize(
    "name, size",
    [
        ("pola_pvt_tiny", dict(depths=(1, 1, 1, 1))),
        ("pola_pvt_v2_b0", dict(depths=(1, 1, 1, 1))),
        ("pola_swin_t", dict(depths=(1, 1, 1, 1))),
        ("POLA_b0", dict(depths=(1, 1, 1, 1))),
    ],
)
def test_every_family_reads_official_files_through_timm(tmp_path, name, size):
    raw, ema = timm.create_model(name, **size), timm.create_model(name, **size)
    path = save_official(tmp_path / "ckpt_epoch_10.pth", raw, ema=ema, prefix="module.")
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **size)
    assert_weights(model, ema.state_dict())
    result = load_checkpoint(timm.create_model(name, **size), path, weights="raw")
    assert result.entry == "model" and not result.missing_keys and not result.unexpected_keys
