"""Checkpoints: atomic writes and loading that fails with one clear line.

A checkpoint is a plain dict (so it loads with ``weights_only=True``)::

    {'model': state_dict, 'arch': timm model name, 'model_kwargs': {...}, 'num_classes': int,
     'epoch': int, 'metrics': {...}, ...extra keys such as 'config'}

``arch`` + ``num_classes`` + ``model_kwargs`` are enough to rebuild the model with
``timm.create_model``; see :func:`polaformer.engine.factory.create_model_from_checkpoint`.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable, BinaryIO

import torch
from torch import nn

REQUIRED_KEYS = ("model", "arch", "model_kwargs", "num_classes")


class CheckpointError(Exception):
    """Base class of the errors below; its message is always a single line."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    def __init__(self, path):
        super().__init__(f"checkpoint not found: {path}")


class CorruptCheckpointError(CheckpointError, ValueError):
    def __init__(self, path, reason: str):
        super().__init__(f"corrupt or unreadable checkpoint: {path} ({reason})")


class ArchitectureMismatchError(CheckpointError, ValueError):
    pass


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it over ``path``.

    Readers (and a crash at any moment) see either the old complete file or the new complete
    one, never a half-written one. The temporary file lives in the same folder because
    ``os.replace`` is only atomic within one file system; it is removed if ``write`` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    f = open(tmp, "xb")
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a folder be opened for this.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(path)
    if path.is_file() and path.stat().st_size == 0:
        raise CorruptCheckpointError(path, "empty file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types here (RuntimeError, UnpicklingError, EOFError, ...)
        raise CorruptCheckpointError(path, _reason(e)) from e
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(path, f"expected a dict, found {type(checkpoint).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise CorruptCheckpointError(path, f"not a polaformer checkpoint: no {', '.join(map(repr, missing))}")
    return checkpoint


def check_arch(checkpoint: dict, arch: str, path: str | os.PathLike) -> None:
    if checkpoint["arch"] != arch:
        raise ArchitectureMismatchError(
            f"checkpoint {path} holds architecture {checkpoint['arch']!r}, not the requested {arch!r}"
        )


def load_model_state(model: nn.Module, checkpoint: dict, *, arch: str, path: str | os.PathLike) -> None:
    """Load the checkpoint's weights into ``model`` (built as ``arch``), insisting on an exact fit.

    Key and shape differences are reported up front, in one line naming both architectures,
    instead of ``load_state_dict``'s multi-line error.
    """
    check_arch(checkpoint, arch, path)
    problem = _state_dict_mismatch(model.state_dict(), checkpoint["model"])
    if problem:
        raise ArchitectureMismatchError(
            f"checkpoint {path} (architecture {checkpoint['arch']!r}, kwargs {checkpoint['model_kwargs']}) "
            f"does not fit the model built as {arch!r}: {problem}"
        )
    model.load_state_dict(checkpoint["model"])


def _state_dict_mismatch(expected: dict, found: dict) -> str:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    reshaped = [k for k in expected if k in found and tuple(expected[k].shape) != tuple(found[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]!r})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]!r})")
    if reshaped:
        k = reshaped[0]
        parts.append(
            f"{len(reshaped)} shape mismatches (e.g. {k!r}: checkpoint {tuple(found[k].shape)}, "
            f"model {tuple(expected[k].shape)})"
        )
    return "; ".join(parts)


def _reason(error: Exception) -> str:
    """The gist of a ``torch.load`` failure, on one line: its messages run to several paragraphs."""
    message = str(error)
    marker = "WeightsUnpickler error:"  # what the weights-only loader objected to follows this
    if marker in message:
        message = message.split(marker, 1)[1]
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    gist = lines[0].split(". ")[0] if lines else ""
    text = f"{type(error).__name__}: {gist}" if gist else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
