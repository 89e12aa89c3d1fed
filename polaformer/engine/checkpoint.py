"""Our training checkpoints: written atomically, loaded safely, failing with one clear line.

A checkpoint is a plain dict (so it loads with ``weights_only=True``)::

    {'model': state_dict, 'arch': timm model name, 'model_kwargs': {...}, 'num_classes': int,
     'epoch': int, 'metrics': {...}, ...extra keys such as 'config'}

``arch`` + ``num_classes`` + ``model_kwargs`` are enough to rebuild the model with
``timm.create_model``; see :func:`polaformer.engine.factory.create_model_from_checkpoint`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The errors, the atomic writer and the safe reader are shared with the public loader.
from ..checkpoint import (  # noqa: F401  (re-exported)
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    atomic_write,
    check_weight_values,
    compare_state_dicts,
    read_checkpoint,
)

REQUIRED_KEYS = ("model", "arch", "model_kwargs", "num_classes")


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
    return atomic_write(path, lambda f: torch.save(checkpoint, f))


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint dict on the CPU, refusing anything but tensors and plain containers."""
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(path, f"expected a dict, found {type(checkpoint).__name__}")
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
    if not isinstance(checkpoint["model"], dict) or not all(
            isinstance(value, torch.Tensor) for value in checkpoint["model"].values()):
        raise CorruptCheckpointError(path, "'model' is not a state dict (name -> tensor)")


def check_arch(checkpoint: dict, arch: str, path: str | os.PathLike) -> None:
    if checkpoint["arch"] != arch:
        raise ArchitectureMismatchError(
            f"checkpoint {path} holds architecture {checkpoint['arch']!r}, not the requested {arch!r}"
        )


def load_model_state(
    model: nn.Module, checkpoint: dict, *, arch: str, path: str | os.PathLike, allow_nonfinite: bool = False
) -> None:
    """Load the checkpoint's weights into ``model`` (built as ``arch``), insisting on an exact fit.

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
