"""Loading weights into a model, from any file a user is likely to hold, without running its code.

:func:`load_checkpoint` reads

- the authors' training checkpoints: PolaFormer's ``{'model', 'optimizer', 'lr_scheduler',
  'max_accuracy', 'epoch', 'config'}``, and PolaFormer++'s, which add ``'max_accuracy_e'`` and the
  EMA weights ``'state_dict_ema'``;
- our own training checkpoints (:mod:`polaformer.engine.checkpoint`) and timm's;
- plain state dicts, pickled or in ``.safetensors`` files.

Every file is opened through :func:`polaformer.files.open_regular` (a FIFO or a device is refused, not
waited on; a file larger than the memory available is refused before it is read). Our own checkpoints
carry a SHA-256 of their tensors (:data:`CHECKSUM_KEY`, written by :func:`with_checksum`), checked on every
load: a file changed or damaged after it was written is refused instead of evaluated.
Every ``.pth`` file goes through ``torch.load(weights_only=True)``: tensors and plain containers
only. The one foreign object the official files hold, their yacs ``CfgNode`` configuration, is read
as plain data through a stand-in allow-listed for the duration of the call (yacs itself is never
imported). A file that names any other code is refused before that code runs.

:func:`official_checkpoint_globals` is that allow-list as a context; the model families' builder
(:func:`polaformer.models._helpers.build_model_with_cfg`) holds it while timm loads, so
``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path))`` reads the
authors' files too.

Errors are single lines, and the training engine raises the same classes.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from .files import UnreadableFileError, WriteError, atomic_write, open_regular  # noqa: F401  (re-exported)
from .limits import available_memory

__all__ = [
    "ArchitectureMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FileWeights",
    "LoadResult",
    "MissingWeightsError",
    "StateDictMismatch",
    "UnsafeCheckpointError",
    "WriteError",
    "atomic_write",
    "CHECKSUM_KEY",
    "check_weight_values",
    "compare_state_dicts",
    "load_checkpoint",
    "official_checkpoint_globals",
    "read_checkpoint",
    "read_weights",
    "select_weights",
    "strip_wrapper_prefixes",
    "tensor_digest",
    "with_checksum",
]

_logger = logging.getLogger(__name__)

# Where checkpoints keep their weights, in timm's order of preference (EMA first under 'auto').
EMA_ENTRIES = ("state_dict_ema", "model_ema")
RAW_ENTRIES = ("state_dict", "model")
# Wrappers that prefix every key: DistributedDataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# --- errors ----------------------------------------------------------------------------------

class CheckpointError(Exception):
    """Base class of the errors below; its message is always a single line."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    def __init__(self, path):
        super().__init__(f"checkpoint not found: {path}")


class CorruptCheckpointError(CheckpointError, ValueError):
    def __init__(self, path, reason: str):
        super().__init__(f"corrupt or unreadable checkpoint: {path} ({reason})")


class UnsafeCheckpointError(CorruptCheckpointError):
    """The file names code (a function or class) that unpickling would run; nothing was run."""

    def __init__(self, path, code: str):
        super().__init__(path, f"refused to run code it names: {code}; only tensors and plain data are loaded")


class ArchitectureMismatchError(CheckpointError, ValueError):
    pass


class MissingWeightsError(CheckpointError, LookupError):
    """The requested weights (EMA or raw) are not in the file."""


# --- reading files ---------------------------------------------------------------------------

class _YacsConfigNode:
    """Unpickles yacs' ``CfgNode`` (the official scripts' ``config``) as a plain ``OrderedDict``.

    torch's weights-only unpickler fills only exact dicts and OrderedDicts and restores attributes
    only on OrderedDicts and allow-listed classes, so the node is created as an OrderedDict: its
    items are the settings, its ``__dict__`` gets yacs' bookkeeping (frozen flag, renamed keys),
    which :func:`_plain_data` drops. Nothing here runs code from the file.
    """

    def __new__(cls, *args):
        return OrderedDict()  # arguments a crafted file might pass are ignored


# argparse.Namespace: timm's training script stores its arguments as one (timm allows it too).
_SAFE_GLOBALS = [(_YacsConfigNode, "yacs.config.CfgNode"), argparse.Namespace]


@contextmanager
def official_checkpoint_globals() -> Iterator[None]:
    """Allow, within the block, what the official checkpoints hold besides tensors.

    Only entries not already allowed are added (and removed on exit): torch's ``safe_globals``
    removes its entries on exit even when they had been allowed before.
    """
    allowed = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([entry for entry in _SAFE_GLOBALS if entry not in allowed]):
        yield


# --- checksums ---------------------------------------------------------------------------------

CHECKSUM_KEY = "tensor_sha256"  # our checkpoints' entry: the SHA-256 of every tensor (name, dtype, shape, bytes)


def tensor_digest(checkpoint: Mapping) -> str:
    """SHA-256 over every tensor of ``checkpoint`` (its :data:`CHECKSUM_KEY` entry left out), each with its path
    of keys, dtype and shape, in the order the file holds them (pickling keeps a dict's order)."""
    digest = hashlib.sha256()

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{prefix}|{tensor.dtype}|{tuple(value.shape)}\0".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if not (prefix == "" and key == CHECKSUM_KEY):
                    visit(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(f"{prefix}/{index}", item)

    visit("", checkpoint)
    return digest.hexdigest()


def with_checksum(checkpoint: dict) -> dict:
    """``checkpoint`` with the digest of its tensors under :data:`CHECKSUM_KEY` (checked by :func:`read_checkpoint`)."""
    return {**checkpoint, CHECKSUM_KEY: tensor_digest(checkpoint)}


def _verify_checksum(checkpoint: Any, path: Path) -> None:
    if isinstance(checkpoint, Mapping) and CHECKSUM_KEY in checkpoint:
        if checkpoint[CHECKSUM_KEY] != tensor_digest(checkpoint):
            raise CorruptCheckpointError(path, "its tensors do not match the checksum saved with them: the file was "
                                               "changed or damaged after it was written")


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """Return the object stored in ``path`` (a ``.safetensors`` file or a ``torch.save`` file).

    Raises :class:`CheckpointNotFoundError`, :class:`CorruptCheckpointError` (also for what is not a regular
    file, a file larger than the memory available, and a checkpoint of ours whose tensors no longer match their
    checksum), or its subclass :class:`UnsafeCheckpointError` when the file names code that loading would run.
    """
    path = Path(path)
    try:
        f = open_regular(path, available_memory("cpu"))
    except FileNotFoundError:
        raise CheckpointNotFoundError(path) from None
    except UnreadableFileError as e:
        raise CorruptCheckpointError(path, e.reason) from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CorruptCheckpointError(path, "empty file")
        try:
            if path.suffix == ".safetensors":
                checkpoint = safetensors.torch.load(f.read())
                checkpoint = {key: value.to(map_location) for key, value in checkpoint.items()}
            else:
                with official_checkpoint_globals():
                    checkpoint = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:  # torch raises many types here (RuntimeError, UnpicklingError, EOFError, ...)
            # The weights-only unpickler's refusal names the code: "... GLOBAL posix.system ...".
            code = re.search(r"\bGLOBAL (\S+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
            if code:
                raise UnsafeCheckpointError(path, code.group(1)) from e
            raise CorruptCheckpointError(path, _reason(e)) from e
    _verify_checksum(checkpoint, path)
    return checkpoint


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


def _plain_data(obj: Any) -> Any:
    """Nested plain dicts/lists/tuples in place of config nodes and OrderedDicts."""
    if isinstance(obj, Mapping):
        return {key: _plain_data(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain_data(value) for value in obj)
    return obj


# --- choosing and comparing weights ----------------------------------------------------------

def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in obj.items()
    )


def select_weights(checkpoint: Any, weights: str, path) -> tuple[str | None, Mapping[str, torch.Tensor]]:
    """Return ``(entry, state_dict)``; ``entry`` is None when the file is itself a state dict.

    ``weights``: ``'auto'`` (EMA if the file has it, else raw), ``'ema'`` or ``'raw'``.
    """
    if not isinstance(checkpoint, Mapping):
        raise CorruptCheckpointError(path, f"expected a dict, found {type(checkpoint).__name__}")
    present = [key for key in EMA_ENTRIES + RAW_ENTRIES if checkpoint.get(key) is not None]
    if not present:
        if not checkpoint or not _is_state_dict(checkpoint):
            raise CorruptCheckpointError(
                path, f"no weights: neither a state dict nor a dict with any of {', '.join(EMA_ENTRIES + RAW_ENTRIES)}"
            )
        if weights == "ema":
            raise MissingWeightsError(f"{path} is a plain state dict, with no EMA weights; use weights='raw'")
        return None, checkpoint
    wanted = {"auto": EMA_ENTRIES + RAW_ENTRIES, "ema": EMA_ENTRIES, "raw": RAW_ENTRIES}[weights]
    entry = next((key for key in wanted if key in present), None)
    if entry is None:
        other = "raw" if weights == "ema" else "ema"
        raise MissingWeightsError(
            f"{path} has no {'EMA' if weights == 'ema' else 'raw'} weights "
            f"(it holds {', '.join(map(repr, present))}); use weights={other!r} or 'auto'"
        )
    if not _is_state_dict(checkpoint[entry]):
        raise CorruptCheckpointError(path, f"{entry!r} is not a state dict (name -> tensor)")
    return entry, checkpoint[entry]


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``module.`` / ``_orig_mod.`` prefixes that DDP and torch.compile add to every key."""
    cleaned = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


@dataclass
class StateDictMismatch:
    """How a state dict differs from the one a model expects."""

    missing: list[str] = field(default_factory=list)  # the model has them, the file does not
    unexpected: list[str] = field(default_factory=list)  # the file has them, the model does not
    reshaped: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)  # key -> (file shape, model shape)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.reshaped)

    def describe(self, examples: int = 3) -> str:
        """One line: counts, then up to ``examples`` keys of each kind."""
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing keys (e.g. {_names(self.missing, examples)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected keys (e.g. {_names(self.unexpected, examples)})")
        if self.reshaped:
            shapes = "; ".join(
                f"{key!r}: checkpoint {found}, model {expected}"
                for key, (found, expected) in list(self.reshaped.items())[:examples]
            )
            parts.append(f"{len(self.reshaped)} shape mismatches (e.g. {shapes})")
        return "; ".join(parts)


def _names(keys: list[str], examples: int) -> str:
    return ", ".join(map(repr, keys[:examples]))


def compare_state_dicts(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> StateDictMismatch:
    """Compare ``found`` (from a file) with ``expected`` (a model's ``state_dict()``)."""
    return StateDictMismatch(
        missing=[key for key in expected if key not in found],
        unexpected=[key for key in found if key not in expected],
        reshaped={
            key: (tuple(found[key].shape), tuple(expected[key].shape))
            for key in expected
            if key in found and found[key].shape != expected[key].shape
        },
    )


def check_weight_values(
    expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor], path, *,
    allow_nonfinite: bool | None = None,
) -> None:
    """Refuse weights that would load silently wrong, naming the first such key.

    ``load_state_dict`` casts integer or complex tensors into floating-point parameters without a
    word, and NaN/inf weights evaluate to a NaN loss with a plausible-looking accuracy. Only keys
    the model holds as floating point are checked (index buffers are integers by design).
    ``allow_nonfinite``: True lets NaN/inf through (to inspect a diverged run, say), never a cast;
    False refuses them and names that switch; None, for a loader without the switch, refuses them.
    """
    for key, value in found.items():
        target = expected.get(key)
        if target is None or not target.is_floating_point():
            continue
        if not value.is_floating_point():
            raise CorruptCheckpointError(
                path, f"weight {key!r} is {str(value.dtype).removeprefix('torch.')}, the model's is "
                      f"{str(target.dtype).removeprefix('torch.')}; refusing to cast it"
            )
        if not allow_nonfinite and not bool(torch.isfinite(value).all()):
            switch = "" if allow_nonfinite is None else (
                "; allow_nonfinite=True (--allow-nonfinite of `polaformer eval`) loads it anyway")
            raise CorruptCheckpointError(path, f"weight {key!r} holds NaN or infinite values{switch}")


# --- the loader ------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """What :func:`load_checkpoint` loaded, and what it could not."""

    path: Path
    entry: str | None  # 'model', 'state_dict_ema', ...; None when the file is itself a state dict
    missing_keys: list[str]  # left as initialised
    unexpected_keys: list[str]  # in the file, ignored
    mismatched_keys: list[str]  # shapes differ; left as initialised
    epoch: int | None = None
    max_accuracy: float | None = None
    max_accuracy_ema: float | None = None  # PolaFormer++'s 'max_accuracy_e'
    config: dict | None = None  # the training configuration, as plain nested dicts


@dataclass
class FileWeights:
    """The weights of one file, read to be loaded into a model (:func:`read_weights`)."""

    path: Path
    entry: str | None  # as LoadResult's
    state_dict: dict[str, torch.Tensor]  # wrapper prefixes stripped
    checkpoint: Any  # the whole file

    @property
    def source(self) -> str:
        return f"{self.entry!r} weights" if self.entry else "state dict"

    def result_fields(self) -> dict[str, Any]:
        """The fields of a :class:`LoadResult` that the file gives: where the weights came from and, unless the
        file is a plain state dict, its epoch, accuracies and configuration."""
        extras = self.checkpoint if self.entry else {}
        return dict(
            path=self.path,
            entry=self.entry,
            epoch=_number(extras.get("epoch"), int),
            max_accuracy=_number(extras.get("max_accuracy"), float),
            max_accuracy_ema=_number(extras.get("max_accuracy_e"), float),
            config=_plain_data(extras["config"]) if extras.get("config") is not None else None,
        )


def read_weights(path: str | os.PathLike, weights: str = "auto",
                 map_location: str | torch.device = "cpu") -> FileWeights:
    """The ``weights`` of the file at ``path`` (``'auto'``, ``'ema'`` or ``'raw'``: :func:`select_weights`), read
    without running code stored in it (:func:`read_checkpoint`)."""
    if weights not in ("auto", "ema", "raw"):
        raise ValueError(f"weights must be 'auto', 'ema' or 'raw', got {weights!r}")
    path = Path(path)
    checkpoint = read_checkpoint(path, map_location)
    entry, state_dict = select_weights(checkpoint, weights, path)
    return FileWeights(path, entry, strip_wrapper_prefixes(state_dict), checkpoint)


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    weights: str = "auto",
    strict: bool = True,
    map_location: str | torch.device = "cpu",
    allow_nonfinite: bool = False,
) -> LoadResult:
    """Load the weights in ``path`` into ``model``; never runs code stored in the file.

    Args:
        weights: ``'auto'`` (the EMA weights if the file has them, else the raw ones),
            ``'ema'`` or ``'raw'``; asking for weights the file lacks raises
            :class:`MissingWeightsError`.
        strict: when the keys or shapes differ from the model's, raise
            :class:`ArchitectureMismatchError` (nothing is loaded); when False, load what fits,
            log a warning, and report the rest in the result.
        map_location: as for ``torch.load``.
        allow_nonfinite: load NaN/inf weights instead of refusing them (see
            :func:`check_weight_values`; integer or complex weights are always refused).

    ``module.`` / ``_orig_mod.`` key prefixes are removed. Missing files, unreadable files and
    files naming code raise :class:`CheckpointNotFoundError`, :class:`CorruptCheckpointError`
    and :class:`UnsafeCheckpointError`.
    """
    found = read_weights(path, weights, map_location)
    path, state_dict, source = found.path, found.state_dict, found.source
    mismatch = compare_state_dicts(model.state_dict(), state_dict)
    if mismatch and strict:
        raise ArchitectureMismatchError(
            f"checkpoint {path} ({source}) does not fit {type(model).__name__}: {mismatch.describe()}; "
            "strict=False loads the keys that fit"
        )
    if mismatch:
        _logger.warning("loaded %s (%s) into %s partially: %s", path, source, type(model).__name__, mismatch.describe())
    fitting = {key: value for key, value in state_dict.items() if key not in mismatch.reshaped}
    check_weight_values(model.state_dict(), fitting, path, allow_nonfinite=allow_nonfinite)
    model.load_state_dict(fitting, strict=False)
    _logger.info("loaded %s from %s", source, path)
    return LoadResult(missing_keys=mismatch.missing, unexpected_keys=mismatch.unexpected,
                      mismatched_keys=list(mismatch.reshaped), **found.result_fields())


def _number(value: Any, kind: type) -> Any:
    # The official scripts store accuracies as 0-d (CUDA) tensors or Python floats.
    if value is None:
        return None
    return kind(value.item() if isinstance(value, torch.Tensor) else value)
