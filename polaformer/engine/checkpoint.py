"""Our checkpoints, of every task: written here only (atomically), read back safely, one-line errors.

A checkpoint is a plain dict (so it loads with ``weights_only=True``). The engine's
(:mod:`.loop`) hold the training state::

    {'task': 'classification' | 'lra' | 'detect' | 'segment' | 'lm' | 'sr' | 'diffusion', 'model': state_dict,
     'model_ema'?, 'optimizer', 'lr_scheduler', 'scaler', 'epoch', 'step' (batches into the epoch),
     'num_updates', 'window', 'history', 'best', 'best_at', 'metrics', 'world_size',
     'batch_size', 'rng', 'config' (the run's settings, compared on resume),
     'sharded' (in place of 'model', 'model_ema' and 'optimizer': the folder holding them, :mod:`.parallel`),
     'tensor_sha256' (the checksum of every tensor, checked on load), ...the task's entries that rebuild its model}

Classification adds ``'arch'`` + ``'num_classes'`` + ``'model_kwargs'`` (enough to rebuild the
model with ``timm.create_model``, see :func:`polaformer.engine.factory.create_model_from_checkpoint`),
``'config'``, ``'max_accuracy'`` (and ``'max_accuracy_ema'``), and for a data folder ``'class_names'``
(the sorted class folder names, which ``eval`` compares with its folder's); LRA ``'config'`` and
``'model_config'``; detection and segmentation ``'config'`` (the recipe, with the class names).

Files written by earlier versions (LRA's and the dense tasks' own formats, classification's
``'epoch_progress'``) are read through :func:`upgrade_legacy`. Foreign files (the authors',
timm's) are read by :mod:`polaformer.checkpoint`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The errors and the safe reader are shared with the public loader.
from ..checkpoint import (  # noqa: F401  (re-exported)
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    check_weight_values,
    compare_state_dicts,
    read_checkpoint,
    with_checksum,
)
from ..files import atomic_write
from .parallel import SHARDED

REQUIRED_KEYS = ("model", "arch", "model_kwargs", "num_classes")
TRAINING_STATE_KEYS = ("optimizer", "lr_scheduler", "epoch")
# The record key each dense task keeps its best checkpoint by (for files of earlier versions).
DENSE_KEY_METRICS = {"detect": "bbox_AP", "segment": "mIoU"}


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    arch: str,
    model_kwargs: dict,
    num_classes: int,
    epoch: int,
    metrics: dict,
    **extra: Any,
) -> Path:
    checkpoint = {
        "model": model.state_dict(),
        "arch": arch,
        "model_kwargs": dict(model_kwargs),
        "num_classes": num_classes,
        "epoch": epoch,
        "metrics": dict(metrics),
        **extra,
    }
    return atomic_write(path, lambda f: torch.save(with_checksum(checkpoint), f))


def read_run_checkpoint(path: str | os.PathLike) -> dict:
    """One of our runs' checkpoint dicts, read on the CPU, refusing anything but tensors and plain containers
    (weights of any origin, into a model: :func:`polaformer.checkpoint.load_checkpoint`)."""
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(path, f"expected a dict, found {type(checkpoint).__name__}")
    if SHARDED in checkpoint and "model" not in checkpoint:
        raise CorruptCheckpointError(path, f"a sharded checkpoint (its weights are in {checkpoint[SHARDED]}): "
                                           "'polaformer checkpoint consolidate' makes it one file")
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise CorruptCheckpointError(path, f"not a polaformer checkpoint: no {', '.join(map(repr, missing))}")
    check_metadata(checkpoint, path)
    return checkpoint


def check_metadata(checkpoint: dict, path: str | os.PathLike) -> None:
    """The entries that rebuild the model must have the types ``timm.create_model`` needs."""
    kwargs, classes = checkpoint["model_kwargs"], checkpoint["num_classes"]
    if not isinstance(checkpoint["arch"], str):
        raise CorruptCheckpointError(path, f"'arch' must be a model name, found {checkpoint['arch']!r}")
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise CorruptCheckpointError(path, f"'model_kwargs' must be a dict of keyword arguments, found {kwargs!r}")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
        raise CorruptCheckpointError(path, f"'num_classes' must be an integer >= 0, found {classes!r}")
    if SHARDED in checkpoint and "model" not in checkpoint:  # the weights are in its shard folder
        return
    if not isinstance(checkpoint["model"], dict) or not all(
            isinstance(value, torch.Tensor) for value in checkpoint["model"].values()):
        raise CorruptCheckpointError(path, "'model' is not a state dict (name -> tensor)")


def check_arch(checkpoint: dict, arch: str, path: str | os.PathLike) -> None:
    if checkpoint["arch"] != arch:
        raise ArchitectureMismatchError(
            f"checkpoint {path} holds architecture {checkpoint['arch']!r}, not the requested {arch!r}"
        )


def load_model_state(
    model: nn.Module, checkpoint: dict, *, arch: str, path: str | os.PathLike, allow_nonfinite: bool | None = None
) -> None:
    """Load the checkpoint's weights into ``model`` (built as ``arch``), insisting on an exact fit; NaN/inf weights
    as :func:`~polaformer.checkpoint.check_weight_values` says.

    Key and shape differences are reported up front, in one line naming both architectures,
    instead of ``load_state_dict``'s multi-line error.
    """
    check_arch(checkpoint, arch, path)
    problem = compare_state_dicts(model.state_dict(), checkpoint["model"]).describe(examples=1)
    if problem:
        raise ArchitectureMismatchError(
            f"checkpoint {path} does not fit the model built as {arch!r}: {problem} (checkpoint architecture "
            f"{checkpoint['arch']!r}, kwargs {checkpoint['model_kwargs']})"
        )
    check_weight_values(model.state_dict(), checkpoint["model"], path, allow_nonfinite=allow_nonfinite)
    model.load_state_dict(checkpoint["model"])


def load_task_weights(model: nn.Module, state_dict: dict, path: str | os.PathLike) -> None:
    """Load a task checkpoint's weights into the model it describes: a key or shape difference, a cast
    (an integer weight into a float parameter) and NaN/inf values are refused in one line."""
    problem = compare_state_dicts(model.state_dict(), state_dict).describe(examples=1)
    if problem:
        raise CorruptCheckpointError(path, f"weights do not fit the model it describes: {problem}")
    check_weight_values(model.state_dict(), state_dict, path)
    model.load_state_dict(state_dict)


# --- the engine's training state ---------------------------------------------------------------

def save_training_state(folder: Path, names: list[str], state: dict) -> Path:
    """Write ``state`` (with the checksum of its tensors) to ``folder/names[0]`` atomically, then copy it to the
    other names; returns the first."""
    state = with_checksum(state)
    first = atomic_write(folder / names[0], lambda f: torch.save(state, f))
    for name in names[1:]:
        atomic_write(folder / name, lambda f: f.write(first.read_bytes()))
    return first


def read_task_checkpoint(path: str | os.PathLike, task: str, *, sharded: bool = False) -> dict:
    """A checkpoint of ``task`` (any version), refusing other files in one line; ``sharded``: also one whose
    weights are in a shard folder (:mod:`.parallel`), which only resuming reads."""
    checkpoint = read_checkpoint(path)
    if isinstance(checkpoint, dict) and SHARDED in checkpoint and "model" not in checkpoint and not sharded:
        raise CorruptCheckpointError(path, f"a sharded checkpoint (its weights are in {checkpoint[SHARDED]}): "
                                           "'polaformer checkpoint consolidate' makes it one file")
    if not isinstance(checkpoint, dict) or ("model" not in checkpoint and not (sharded and SHARDED in checkpoint)):
        raise CorruptCheckpointError(path, f"not a checkpoint of a {task!r} run (no 'model')")
    checkpoint = upgrade_legacy(checkpoint)
    found = checkpoint.get("task")
    if found != task:
        what = f"a {found!r} checkpoint" if found else "not a polaformer training checkpoint"
        raise CorruptCheckpointError(path, f"{what}, not a {task!r} one")
    return checkpoint


def read_training_state(path: str | os.PathLike, task: str, hint: str) -> dict:
    """A checkpoint of ``task`` that holds a training state to resume; ``hint`` says what to do otherwise."""
    checkpoint = read_task_checkpoint(path, task, sharded=True)
    missing = [key for key in TRAINING_STATE_KEYS
               if key not in checkpoint and not (key == "optimizer" and SHARDED in checkpoint)]
    if missing:
        raise CorruptCheckpointError(path, f"holds weights but no training state ({', '.join(missing)}): {hint}")
    return checkpoint


def upgrade_legacy(checkpoint: dict) -> dict:
    """A checkpoint of an earlier version in today's layout (a new dict; today's files unchanged)."""
    if "task" not in checkpoint and "arch" in checkpoint:
        return _upgrade_classification(checkpoint)
    if "task" not in checkpoint and "model_config" in checkpoint:
        return _upgrade_lra(checkpoint)
    if checkpoint.get("task") in DENSE_KEY_METRICS and "num_updates" not in checkpoint:
        return _upgrade_dense(checkpoint)
    return checkpoint


def _upgrade_classification(old: dict) -> dict:
    new = {**old, "task": "classification"}
    progresses = old.get("epoch_progress")
    if progresses is not None:
        new["window"] = [{"loss_sum": p.get("loss_sum", 0.0), "samples": p.get("seen", 0),
                          "time": p.get("train_time", 0.0), "stats": {"skipped": p.get("skipped", 0)}}
                         for p in progresses]
    new["best"] = {"test_top1": old.get("max_accuracy", 0.0)}
    if "max_accuracy_ema" in old and "model_ema" in old:
        new["best"]["ema_top1"] = old["max_accuracy_ema"]
    return new


def _upgrade_lra(old: dict) -> dict:
    # The step counted updates; the position in the epoch was not kept (the data order restarts).
    steps = int(old.get("step", 0))
    new = {**old, "task": "lra", "num_updates": steps, "step": 0, "epoch": 0}
    if old.get("history"):
        new["elapsed_s"] = old["history"][-1].get("elapsed_s", 0.0)
    if "scheduler" in old:
        new["lr_scheduler"] = old["scheduler"]
    best = old.get("best") or {}
    if best.get("accuracy", -1) >= 0:
        new["best"] = {"dev_accuracy": best["accuracy"]}
        new["best_at"] = {"dev_accuracy": best.get("step", steps)}
    window = old.get("window")
    if window:
        new["window"] = [{"loss_sum": window.get("loss", 0.0), "samples": window.get("seen", 0),
                          "time": window.get("time", 0.0), "stats": {"correct": window.get("correct", 0)}}]
    if isinstance(old.get("rng"), dict):
        new["rng"] = [old["rng"]]
    return new


def _upgrade_dense(old: dict) -> dict:
    # No schedule state was kept: the engine recomputes the rate of update 'step'.
    steps = int(old.get("step", 0))
    new = {**old, "num_updates": steps, "step": 0, "epoch": 0, "rng": []}
    if "optimizer" in old:
        new["lr_scheduler"] = None
    if old.get("best") is not None:
        new["best"] = {DENSE_KEY_METRICS[old["task"]]: old["best"]}
    return new
