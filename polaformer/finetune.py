"""Loading a checkpoint into a model built for another input size or number of classes.

:func:`load_for_finetune` is the fine-tuning counterpart of
:func:`polaformer.checkpoint.load_checkpoint`: it reads the same files (the authors' PolaFormer and
PolaFormer++ checkpoints, ours, timm's, plain state dicts; EMA or raw weights), then adapts what
depends on the resolution or on the classes instead of refusing it:

- **Absolute position tables** (DeiT ``pos_embed`` with its class-token row kept as it is, PVT
  ``pos_embed{i}``, Swin ``absolute_pos_embed``) and the Pola attention's **key positional
  encodings** (``positional_encoding``, one per linear-attention block, sized for its window or
  key grid) are resampled as 2-D grids to the model's grids, with the interpolation the model
  itself applies when it runs at a size other than its build size (bilinear for ``pos_embed{i}``
  and ``positional_encoding``, bicubic for ``pos_embed``/``absolute_pos_embed``). A model loaded
  for a new size therefore starts from exactly the function that the checkpoint's model computes
  at that size, as far as these tables go.
- **Swin relative position bias tables** (``relative_position_bias_table``, ``(2W-1)²`` rows by
  heads) are resampled bicubically as one ``(2W-1)×(2W-1)`` grid per head to the model's window
  (Pola-Swin-B-384: the softmax windows grow from 7 to 12, 13² → 23² rows), as the Swin
  fine-tuning recipe does.
- **Buffers derived from the layout** (``relative_position_index``, ``attn_mask``) are never read
  from the file: the model's own are kept (they depend on the window and grid it was built for).
- **Classifier weights** whose shape differs (another number of classes) are dropped and the
  model's freshly initialised head is kept; a headless file leaves the head as initialised.

What was adapted is logged and returned (:class:`FinetuneLoadResult`). Anything else that does not
fit (a tensor of another shape that is no position table, keys of another architecture) is an
:class:`~polaformer.checkpoint.ArchitectureMismatchError` before anything is loaded, unless
``strict=False``, which loads what fits and reports the rest.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import ArchitectureMismatchError, LoadResult, check_weight_values, read_weights, strip_wrapper_prefixes
from .ops import resample_grid_table

__all__ = [
    "FinetuneLoadResult",
    "adapt_state_dict",
    "load_for_finetune",
    "resample_position_table",
    "resample_relative_position_bias",
]

_logger = logging.getLogger(__name__)

# Buffers computed from the window/grid layout; the model's own always win over the file's.
LAYOUT_BUFFERS = ("relative_position_index", "attn_mask")


@dataclass
class FinetuneLoadResult(LoadResult):
    """A :class:`~polaformer.checkpoint.LoadResult` plus what :func:`load_for_finetune` adapted.

    ``mismatched_keys`` lists every key whose shape differed between file and model; of those,
    ``resampled`` were resampled and loaded, ``reinitialised`` (the classifier) were left as the
    model initialised them, and any others (only with ``strict=False``) were left as initialised too.
    """

    resampled: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)  # key -> (file shape, model shape)
    reinitialised: list[str] = field(default_factory=list)  # classifier keys kept from the model
    from_model: list[str] = field(default_factory=list)  # layout buffers kept from the model

    def describe(self) -> str:
        """One line summarising the adaptation."""
        parts = []
        if self.resampled:
            shapes = ", ".join(f"{key} {tuple(a)}->{tuple(b)}" for key, (a, b) in list(self.resampled.items())[:3])
            more = f" and {len(self.resampled) - 3} more" if len(self.resampled) > 3 else ""
            parts.append(f"resampled {len(self.resampled)} position/bias tables ({shapes}{more})")
        if self.reinitialised:
            parts.append(f"new classifier, freshly initialised: {', '.join(self.reinitialised)}")
        if self.from_model:
            parts.append(f"{len(self.from_model)} layout buffers (relative_position_index/attn_mask) from the model")
        others = [k for k in self.mismatched_keys if k not in self.resampled and k not in self.reinitialised]
        if others:
            parts.append(f"{len(others)} other shape mismatches left as initialised (e.g. {', '.join(others[:3])})")
        missing = [k for k in self.missing_keys if k not in self.reinitialised]
        if missing:
            parts.append(f"{len(missing)} missing keys left as initialised (e.g. {', '.join(missing[:3])})")
        if self.unexpected_keys:
            examples = ", ".join(self.unexpected_keys[:3])
            parts.append(f"{len(self.unexpected_keys)} unexpected keys ignored (e.g. {examples})")
        return "; ".join(parts) if parts else "every tensor fitted as it is"


# --- resampling ------------------------------------------------------------------------------

def _square_side(count: int, what: str) -> int:
    side = math.isqrt(count)
    if side * side != count:
        raise ValueError(f"{what} holds {count} positions, not a square grid")
    return side


def resample_position_table(
    table: torch.Tensor,
    new_grid: tuple[int, int],
    *,
    old_grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resample a ``(1, prefix + h·w, C)`` table of raster-ordered grid positions to ``new_grid``.

    The ``num_prefix_tokens`` leading rows (class token) are kept as they are. ``old_grid``
    defaults to the square grid the row count implies. The grid is interpolated as the models do
    at other sizes (:func:`~polaformer.ops.resample_grid_table`: ``align_corners=False``, in the
    table's dtype, float32 for half precision).
    """
    if table.dim() != 3 or table.shape[0] != 1:
        raise ValueError(f"expected a position table of shape (1, N, C), got {tuple(table.shape)}")
    grid = table[:, num_prefix_tokens:]
    if old_grid is None:
        side = _square_side(grid.shape[1], "the position table")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != grid.shape[1]:
        raise ValueError(f"position table of {grid.shape[1]} positions is not a {old_grid[0]}x{old_grid[1]} grid")
    return resample_grid_table(table, tuple(new_grid), tuple(old_grid), num_prefix_tokens, mode=mode,
                               antialias=antialias)


def resample_relative_position_bias(table: torch.Tensor, new_window: tuple[int, int]) -> torch.Tensor:
    """Resample a Swin ``((2W-1)², heads)`` bias table to a ``new_window`` (height, width) window.

    Each head's column is one ``(2W-1)×(2W-1)`` grid of offsets (row-major, as
    ``relative_position_index`` reads it); it is interpolated bicubically to
    ``(2H'-1)×(2W'-1)``. A constant table stays constant.
    """
    if table.dim() != 2:
        raise ValueError(f"expected a bias table of shape (offsets, heads), got {tuple(table.shape)}")
    rows, heads = table.shape
    side = _square_side(rows, "the relative position bias table")
    size = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    grid = table.to(torch.promote_types(table.dtype, torch.float32)).t().reshape(1, heads, side, side)
    grid = F.interpolate(grid, size=size, mode="bicubic", align_corners=False)
    return grid.reshape(heads, size[0] * size[1]).t().contiguous().to(table.dtype)


# --- which tables, and their grids in the model ----------------------------------------------

def _submodule(model: nn.Module, key: str) -> nn.Module | None:
    path = key.rpartition(".")[0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _grid_of(module: nn.Module | None, attr: str = "grid_size") -> tuple[int, int] | None:
    grid = getattr(module, attr, None) if module is not None else None
    return (int(grid[0]), int(grid[1])) if grid is not None else None


def _position_table_layout(model: nn.Module, key: str, shape: torch.Size):
    """(new grid, prefix tokens, mode, antialias) for a resamplable table key, else None."""
    name = key.rpartition(".")[2]
    owner = _submodule(model, key)
    if name == "positional_encoding":  # Pola key positions: what PolaLinearAttention does at other sizes
        prefix = getattr(owner, "num_prefix_tokens", 0)
        grid = _grid_of(owner, "key_pos_grid")
        return grid, prefix, "bilinear", False
    match = re.fullmatch(r"pos_embed(\d+)", name)
    if match:  # PVT stage tables: bilinear, as PolaPVT resamples them at other sizes
        return _grid_of(getattr(owner, f"patch_embed{match.group(1)}", None)), 0, "bilinear", False
    if name in ("pos_embed", "absolute_pos_embed"):  # DeiT (class-token row first) / Swin ape: bicubic
        prefix = getattr(owner, "num_prefix_tokens", 0) if name == "pos_embed" else 0
        return _grid_of(getattr(owner, "patch_embed", None)), prefix, "bicubic", True
    return None


def _adapt(model: nn.Module, key: str, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """``value`` resampled to ``target``'s shape when ``key`` is a position table, else None."""
    name = key.rpartition(".")[2]
    try:
        if name == "relative_position_bias_table":
            if value.dim() != 2 or target.dim() != 2 or value.shape[1] != target.shape[1]:
                return None  # another number of heads is another architecture
            window = getattr(_submodule(model, key), "window_size", None)
            if window is None:
                side = (_square_side(target.shape[0], "the model's bias table") + 1) // 2
                window = (side, side)
            out = resample_relative_position_bias(value, tuple(window))
        else:
            layout = _position_table_layout(model, key, target.shape)
            if layout is None or value.dim() != 3 or target.dim() != 3 or value.shape[-1] != target.shape[-1]:
                return None
            grid, prefix, mode, antialias = layout
            if grid is None:
                side = _square_side(target.shape[1] - prefix, "the model's position table")
                grid = (side, side)
            out = resample_position_table(value, grid, num_prefix_tokens=prefix, mode=mode, antialias=antialias)
    except ValueError as e:
        _logger.warning("cannot resample %s %s to %s: %s", key, tuple(value.shape), tuple(target.shape), e)
        return None
    return out if out.shape == target.shape else None


def _classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of the classifier: timm's ``pretrained_cfg['classifier']`` and ``get_classifier()``."""
    names = set()
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    classifier = cfg.get("classifier") if isinstance(cfg, dict) else None
    if classifier:
        names.update([classifier] if isinstance(classifier, str) else classifier)
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if isinstance(head, nn.Module):
        names.update(name for name, module in model.named_modules() if module is head and name)
    return tuple(f"{name}." for name in sorted(names))


def _is_layout_buffer(key: str) -> bool:
    return key.rpartition(".")[2] in LAYOUT_BUFFERS


def adapt_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` with its position tables resampled to ``model``'s grids and the model's own layout buffers.

    The part of :func:`load_for_finetune` that timm's loader can use: every family's
    ``pretrained_filter_fn``, so that ``timm.create_model(name, pretrained=True, img_size=288,
    pretrained_cfg_overlay=dict(file=...))`` loads a 224 checkpoint. Wrapper prefixes are stripped;
    other keys pass unchanged (timm drops a classifier of another size itself, and a strict load
    still reports anything else that does not fit).
    """
    target = model.state_dict()
    out = {key: value for key, value in target.items() if _is_layout_buffer(key)}
    for key, value in strip_wrapper_prefixes(state_dict).items():
        want = target.get(key)
        if _is_layout_buffer(key):
            continue  # the model's own (a shifted block at one size may have none at another)
        if want is not None and value.shape != want.shape:
            adapted = _adapt(model, key, value, want)
            if adapted is not None:
                _logger.info("resampled %s %s -> %s", key, tuple(value.shape), tuple(want.shape))
                value = adapted
        out[key] = value
    return out


# --- the loader ------------------------------------------------------------------------------

def load_for_finetune(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    weights: str = "auto",
    strict: bool = True,
    map_location: str | torch.device = "cpu",
) -> FinetuneLoadResult:
    """Load ``path`` into ``model``, adapting position tables and the classifier (module docstring).

    Args:
        weights: ``'auto'`` (EMA if the file has it, else raw), ``'ema'`` or ``'raw'``.
        strict: raise :class:`~polaformer.checkpoint.ArchitectureMismatchError` (loading nothing)
            when, apart from what is adapted, keys are missing or unexpected or shapes differ;
            when False, load what fits and report the rest.
        map_location: as for ``torch.load``.

    Files that are missing, unreadable or name code raise the errors of
    :func:`polaformer.checkpoint.load_checkpoint`.
    """
    found = read_weights(path, weights, map_location)
    path, state_dict, source = found.path, found.state_dict, found.source

    target = model.state_dict()
    classifier = _classifier_prefixes(model)
    is_head = lambda key: key.startswith(classifier)  # noqa: E731

    loadable: dict[str, torch.Tensor] = {}
    resampled: dict[str, tuple[tuple, tuple]] = {}
    reinitialised: list[str] = []
    mismatched: list[str] = []
    unfit: dict[str, tuple[tuple, tuple]] = {}
    unexpected: list[str] = []
    for key, value in state_dict.items():
        if _is_layout_buffer(key):
            continue
        if key not in target:
            if not is_head(key):  # a file's head where the model has none (num_classes=0) is just dropped
                unexpected.append(key)
            continue
        want = target[key]
        if value.shape == want.shape:
            loadable[key] = value
            continue
        mismatched.append(key)
        shapes = (tuple(value.shape), tuple(want.shape))
        if is_head(key):
            reinitialised.append(key)
            continue
        adapted = _adapt(model, key, value, want)
        if adapted is None:
            unfit[key] = shapes
        else:
            loadable[key] = adapted
            resampled[key] = shapes
    missing = [key for key in target if key not in state_dict and not _is_layout_buffer(key)]
    reinitialised += [key for key in missing if is_head(key)]
    from_model = [key for key in target if _is_layout_buffer(key)]

    problems = []
    if unfit:
        examples = "; ".join(f"{key!r}: checkpoint {a}, model {b}" for key, (a, b) in list(unfit.items())[:3])
        problems.append(
            f"{len(unfit)} shape mismatches outside the position tables and the classifier (e.g. {examples})"
        )
    if [key for key in missing if not is_head(key)]:
        names = [key for key in missing if not is_head(key)]
        problems.append(f"{len(names)} missing keys (e.g. {', '.join(map(repr, names[:3]))})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(map(repr, unexpected[:3]))})")
    if problems and strict:
        raise ArchitectureMismatchError(
            f"checkpoint {path} ({source}) does not fit {type(model).__name__} even after resampling position "
            f"tables and dropping the classifier: {'; '.join(problems)}; strict=False loads the keys that fit"
        )

    check_weight_values(target, loadable, path)
    model.load_state_dict(loadable, strict=False)
    result = FinetuneLoadResult(missing_keys=missing, unexpected_keys=unexpected, mismatched_keys=mismatched,
                                resampled=resampled, reinitialised=reinitialised, from_model=from_model,
                                **found.result_fields())
    log = _logger.warning if problems else _logger.info
    log("loaded %s from %s into %s for fine-tuning: %s", source, path, type(model).__name__, result.describe())
    return result
