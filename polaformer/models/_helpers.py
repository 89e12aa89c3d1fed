"""What every family needs to behave as a timm model, in one place.

- :func:`build_model_with_cfg`: timm's model builder, able to read the authors' checkpoint files;
  :func:`build_image_model`: the same with the image families' checkpoint filter and feature getter.
- :func:`factory_kwargs`: timm's ``device=``/``dtype=`` constructor arguments
  (``timm.create_model(name, device='meta')``).
- :func:`check_image` and :func:`pos_table_for_grid`: the input check and the position-table
  lookup, registered with timm as FX leaf functions (``register_notrace_function``). Both take
  Python decisions on the input's size, which symbolic tracing cannot record; as leaf calls they
  run, unchanged, every time the traced graph runs. FX wraps a leaf function where it is a
  module-level name of the calling module, so family files import them by name. The attention
  layers (shape checks, key-table resampling) are FX leaf modules for the same reason.
- :func:`without_timm_extras` and :func:`refuse_unknown_kwargs`: the arguments timm's factory passes to
  every model constructor, dropped by the families that do not build through ``build_model_with_cfg``.
- :func:`empty_batch`: an empty batch (B = 0) gives empty outputs of the right shapes.
- :func:`checkpoint_filter_fn`: the families' ``pretrained_filter_fn``: a checkpoint made for
  another input size loads through ``timm.create_model(..., pretrained=True)`` with its position
  tables resampled (the same resampling as :func:`polaformer.finetune.load_for_finetune`).
- :func:`image_cfg` and :func:`register_variants`: a family's default cfgs and its ``@register_model``
  entry points, one per variant of its table of sizes.
- :class:`ClassifierMixin`, :func:`check_global_pool` and :func:`trunc_normal_init`: timm's classifier API
  (``get_classifier``, ``reset_classifier``, ``set_grad_checkpointing``) and weight initialisation, as the
  image families share them.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterable, Mapping

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import get_device_dtype, trunc_normal_
from timm.models import register_model, register_notrace_function, register_notrace_module
from torch import nn

from ..capture import capturing, legacy_onnx_export
from ..checkpoint import official_checkpoint_globals
from ..layers import PacsLinearAttention, PolaLinearAttention, RopeSoftmaxAttention, SpatialReductionAttention
from ..limits import check_model_memory
from ..ops import resample_grid_table

__all__ = ["ClassifierMixin", "build_image_model", "build_model_with_cfg", "check_global_pool", "check_image",
           "checkpoint_filter_fn", "empty_batch", "factory_kwargs", "image_cfg", "pos_table_for_grid",
           "refuse_unknown_kwargs", "register_variants", "trunc_normal_init", "without_timm_extras"]

# what timm.create_model passes to a registered factory besides the model's own arguments
_TIMM_EXTRAS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")

# reason: input checks and key-table resampling decide in Python on the token grid
for _layer in (PolaLinearAttention, SpatialReductionAttention, PacsLinearAttention, RopeSoftmaxAttention):
    register_notrace_module(_layer)


def build_model_with_cfg(model_cls, variant: str, pretrained: bool, **kwargs):
    """timm's ``build_model_with_cfg``, able to read the authors' checkpoint files.

    timm reads ``pretrained_cfg_overlay=dict(file=...)`` with ``torch.load(weights_only=True)``,
    which refuses the official files' yacs config; here the same allow-list as
    :func:`polaformer.checkpoint.load_checkpoint` is active while timm builds the model and loads its
    weights.
    Family files call this instead of timm's (same arguments).
    """
    from timm.models import build_model_with_cfg as timm_build_model_with_cfg  # timm is heavy to import

    with official_checkpoint_globals():
        return timm_build_model_with_cfg(model_cls, variant, pretrained, **kwargs)


def build_image_model(model_cls, variant: str, pretrained: bool, default_out_indices=(0, 1, 2, 3), **kwargs):
    """:func:`build_model_with_cfg` as the image families call it: :func:`checkpoint_filter_fn` filters the
    pretrained weights, and ``features_only`` models read ``forward_intermediates`` (timm's 'getter') at
    ``out_indices``, ``default_out_indices`` unless given."""
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                feature_cfg=dict(out_indices=default_out_indices, feature_cls="getter"), **kwargs)


def factory_kwargs(init):
    """Decorate a model ``__init__`` so that it takes timm's ``device`` and ``dtype`` arguments.

    The model is built under ``torch.device(device)`` (parameters and buffers are created there,
    nothing is allocated elsewhere first) and cast to ``dtype`` afterwards (floating-point tensors
    only, as ``Module.to``).
    """

    @functools.wraps(init)
    def __init__(self, *args, device=None, dtype=None, **kwargs):
        with torch.device(device) if device is not None else contextlib.nullcontext():
            init(self, *args, **kwargs)
        if dtype is not None:
            self.to(dtype=dtype)

    return __init__


def without_timm_extras(kwargs: dict) -> dict:
    """``kwargs`` less the arguments timm's factory adds."""
    return {key: value for key, value in kwargs.items() if key not in _TIMM_EXTRAS}


def refuse_unknown_kwargs(kwargs: dict, owner: str) -> None:
    """A ``TypeError`` naming what is left in a constructor's ``**kwargs`` once timm's extras are dropped."""
    unknown = without_timm_extras(kwargs)
    if unknown:
        raise TypeError(f"{owner} got unknown arguments: {', '.join(sorted(unknown))}")


def empty_batch(method):
    """Decorate ``forward_features``/``forward_intermediates`` so that a batch of 0 images returns
    empty outputs of the right shapes (token reshapes with ``-1`` cannot infer a size from 0 elements).

    The shapes come from one blank image run in eval mode without gradients (no dropout drawn, no
    norm statistics updated), sliced to 0 rows. Graph capture (compile, export, tracing, FX) is left
    alone: it never sees an empty batch.
    """

    @functools.wraps(method)
    def wrapper(self, x, *args, **kwargs):
        if capturing() or not isinstance(x, torch.Tensor) or x.shape[0] != 0:
            return method(self, x, *args, **kwargs)
        training = self.training
        try:
            self.eval()
            with torch.no_grad():
                out = method(self, x.new_zeros((1, *x.shape[1:])), *args, **kwargs)
        finally:
            self.train(training)
        return _first_rows(out, 0)

    return wrapper


def _first_rows(out, rows: int):
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, (list, tuple)):
        return type(out)(_first_rows(item, rows) for item in out)
    return out


def check_architecture(drop_path_rate: float = 0.0, *, rate_name: str = "drop_path_rate",
                       num_classes: int | None = None, ratios: Mapping[str, object] | None = None, **sizes) -> None:
    """Refuse what a constructor would otherwise build into a broken model (a 0-block model, a division by zero
    heads, 0 input channels, an MLP of no width, NaN stochastic depth, -1 classes), one ValueError naming the
    argument. ``sizes``: counts (depth, num_heads, in_chans, sr_ratios, window_size...), each a positive integer
    or a sequence of them; ``ratios`` (mlp_ratio...): each a finite number > 0 or a sequence of them;
    ``num_classes`` an integer >= 0 (0: no head); the rate (``rate_name``) a number in [0, 1)."""
    for name, value in sizes.items():
        for item in _items(value):
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise ValueError(f"{name} must be a positive integer (or a sequence of them), got {value!r}")
    for name, value in (ratios or {}).items():
        for item in _items(value):
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 < item < math.inf:
                raise ValueError(f"{name} must be a finite number > 0 (or a sequence of them), got {value!r}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes < 0):
        raise ValueError(f"num_classes must be an integer >= 0 (0: no classifier), got {num_classes!r}")
    if isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float)) or not 0 <= drop_path_rate < 1:
        raise ValueError(f"{rate_name} must be a number in [0, 1), got {drop_path_rate!r}")


def _items(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) and value else [value]


def check_grid(img_size, patch_size) -> None:
    """An image side of at least one patch: a 7-pixel image of 16-pixel patches has no token at all (sizes that
    are no multiple of the patch are refused by the forward pass, which names the input)."""
    for image, patch in zip(_pair(img_size), _pair(patch_size)):
        if isinstance(image, bool) or not isinstance(image, int) or image < patch:
            raise ValueError(f"img_size must be an integer of at least patch_size {patch_size}, got {img_size!r}")


def _pair(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


@register_notrace_function  # reason: Python control flow on the input's shape
def check_image(x: torch.Tensor, in_chans: int, stride: tuple[int, int], stride_text: str,
                floor: bool = False) -> torch.Tensor:
    """``x`` itself if it is a (B, in_chans, H, W) batch with H, W multiples of ``stride`` (with ``floor``:
    at least ``stride``, for models whose strided convs floor), else a ValueError."""
    if x.dim() != 4 or x.shape[1] != in_chans:
        raise ValueError(f"expected images of shape (B, {in_chans}, H, W), got {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if floor and (h < stride[0] or w < stride[1]):
        raise ValueError(f"image size {h}x{w} is smaller than {stride_text}")
    if not floor and (h % stride[0] or w % stride[1]):
        raise ValueError(f"image size {h}x{w} is not divisible by {stride_text}")
    return x


@register_notrace_function  # reason: compares the input's grid with the table's
def pos_table_for_grid(table: torch.Tensor, grid: tuple[int, int], table_grid: tuple[int, int],
                       num_prefix_tokens: int = 0, interpolation: str = "bicubic",
                       antialias: bool = True, flat_tokens: int | None = None) -> torch.Tensor:
    """A (1, prefix + h·w, C) position table for a ``grid`` token grid: the table itself on its own
    grid, else resampled from ``table_grid`` (:func:`~polaformer.ops.resample_grid_table`, in the
    table's dtype).

    ``flat_tokens``: a token count at which the table is used as it is, whatever the grid, when it
    has that many rows or a single one (which broadcasts): the official PVT rule.
    """
    tokens = num_prefix_tokens + grid[0] * grid[1]
    if tuple(grid) == tuple(table_grid) or (tokens == flat_tokens and table.shape[1] in (1, tokens)):
        return table
    if antialias and legacy_onnx_export():  # it has no antialiased resize: refuse here, not with an IR dump
        raise RuntimeError(
            f"the TorchScript-based ONNX exporter (torch.onnx.export(..., dynamo=False)) cannot resample this "
            f"model's position table to a {grid[0]}x{grid[1]} token grid (antialiased bicubic); use "
            f"torch.onnx.export(..., dynamo=True) or 'polaformer export', or the model's own input size "
            f"(a {table_grid[0]}x{table_grid[1]} grid)"
        )
    return resample_grid_table(table, grid, table_grid, num_prefix_tokens, mode=interpolation, antialias=antialias)


def checkpoint_filter_fn(state_dict: dict, model: torch.nn.Module) -> dict:
    """timm's ``pretrained_filter_fn`` for every family: the official layouts need no renaming;
    position tables made for another input size are resampled to ``model``'s, and the layout
    buffers (``relative_position_index``, ``attn_mask``) are the model's own."""
    from ..finetune import adapt_state_dict  # finetune imports the checkpoint machinery; only needed here

    return adapt_state_dict(state_dict, model)


def image_cfg(**kwargs) -> dict:
    """An ImageNet-1k family's default pretrained cfg: 224×224 inputs evaluated as the official code does
    (``polaformer eval``): a square bicubic resize to size / ``crop_pct``, then a centre crop ('squash' in
    timm). ``kwargs`` (``first_conv``, ``pool_size``, ``license`` ...) add to it or override it."""
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7), "crop_pct": 0.875,
        "crop_mode": "squash", "interpolation": "bicubic", "fixed_input_size": False, "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD, "classifier": "head", **kwargs,
    }


def register_variants(module: str, variants: Iterable[str], create: Callable[..., nn.Module]) -> None:
    """A family's timm entry points: for each variant name, ``name(pretrained=False, **kwargs)`` returning
    ``create(name, pretrained, **kwargs)``, registered with timm's ``register_model`` and set on the family
    module ``module`` (its ``__name__``) under that name, as a ``@register_model def name(...)`` there would
    be. timm reads the module's ``default_cfgs`` while registering: define it first.

    ``variants`` may map each name to its sizes (``embed_dim``, ``depth``...): every entry point checks the sizes
    asked, over those, against the memory available before anything is built (:func:`polaformer.limits.
    check_model_memory`: blocks that cannot fit are one ValueError)."""
    namespace = sys.modules[module]
    for name in variants:
        sizes = variants[name] if isinstance(variants, Mapping) and isinstance(variants[name], Mapping) else {}
        entry_point = _entry_point(name, create, sizes)
        entry_point.__module__ = module
        setattr(namespace, name, register_model(entry_point))


def _entry_point(name: str, create: Callable[..., nn.Module], sizes: Mapping) -> Callable[..., nn.Module]:
    def entry_point(pretrained: bool = False, **kwargs) -> nn.Module:
        check_model_memory(name, {**sizes, **without_timm_extras(kwargs)})  # before anything is allocated
        return create(name, pretrained, **kwargs)

    entry_point.__name__ = entry_point.__qualname__ = name
    entry_point.__doc__ = f"``{name}``: ``timm.create_model({name!r}, pretrained=False, **kwargs)``."
    return entry_point


def check_global_pool(global_pool, pools: tuple[str, ...] = ("avg", "")) -> str:
    """``global_pool`` if it is one of ``pools``, else a ValueError naming them."""
    if global_pool not in pools:
        names = ", ".join(map(repr, pools[:-1])) + f" or {pools[-1]!r}" if len(pools) > 1 else repr(pools[0])
        raise ValueError(f"global_pool must be {names}, got {global_pool!r}")
    return global_pool


class ClassifierMixin:
    """timm's classifier API for a model with a ``head`` on ``num_features`` channels (an ``nn.Linear``, or
    Identity for 0 classes) after the pooling named by the string ``global_pool`` (one of ``global_pools``),
    and a ``grad_checkpointing`` flag its forward reads."""

    global_pools: tuple[str, ...] = ("avg", "")

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes, global_pool=None):
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool, self.global_pools)
        self.num_classes = num_classes
        dd = get_device_dtype(self)
        self.head = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)


def trunc_normal_init(module: nn.Module, layer: type[nn.Module] = nn.Linear) -> None:
    """timm's initialisation of one module: a ``layer``'s weight truncated normal (std 0.02) and its bias
    zero; a LayerNorm's weight one and bias zero (as built). For ``model.apply`` or a loop over
    ``model.modules()``."""
    if isinstance(module, layer):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
