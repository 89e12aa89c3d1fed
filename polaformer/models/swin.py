"""Pola-Swin: the Swin Transformer with PolaFormer attention (official ``pola_swin_*``).

Weight-compatible with the authors' ``PolaSwinTransformer``: the same module
names (``patch_embed``, ``layers.i.blocks.j.{norm1,attn,norm2,mlp}``,
``layers.i.downsample``, ``norm``, ``head``), shapes and buffers
(``relative_position_index``, ``attn_mask``), so released checkpoints load
strictly. ``attn_type`` gives one letter per stage: ``L`` = Pola linear
attention, ``S`` = softmax window attention with a relative position bias,
``M`` = the first ``n`` blocks linear and the rest softmax, ``n`` written after
the stage letters (``'LLMS3'``).

How the official code resolves each block, reproduced at the size the model
is built for:

- ``L`` blocks use ``window_size``; ``S`` blocks use 7 (12 if ``window_size``
  > 56). Odd blocks shift by half a window.
- A window at least as large as the stage is clipped to it (no shift). The
  official T/S/B configs (window 56/96 = the first stage's side) therefore run
  *global* linear attention in stages 1-2 and 7x7 (12x12) softmax windows in
  stages 3-4.
- Linear blocks roll the grid for shifted windows but ignore the attention
  mask; the ``attn_mask`` buffer is still held so checkpoints load strictly.

Other input sizes (any multiple of the total stride, non-square too), which the
official code rejects; the simplest layout that keeps the trained weights
meaningful:

- Linear blocks whose window covered the whole stage stay global: the window
  becomes the new stage grid. Other linear blocks keep their window, clipped per
  side to a smaller stage. The key ``positional_encoding`` is added row by row
  when the window has as many tokens as the table has rows (the official
  layer's rule, e.g. a 56x56 table on a 28x112 window); for another number of
  tokens it is resampled bilinearly from its square grid, in its own dtype.
- Softmax blocks keep the window they were built with, so the relative position
  bias table and index are used as trained (every offset in a window keeps its
  meaning; no table resampling). The grid is padded to whole windows and the
  mask, built on the fly for the padded grid, also hides the padding from every
  real token, so padding does not change the result.
- Windowed linear blocks on a grid that is not a multiple of their window are
  padded likewise (with zero tokens after ``norm1``, as timm's Swin does); linear
  attention has no mask, so there the padding takes part. The official configs
  never hit this case (their linear blocks are global).
- A shift is applied along a side only when that side holds more than one window.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, PatchEmbed, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs, register_notrace_module
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PolaLinearAttention, WindowAttention
from ._helpers import (
    ClassifierMixin,
    build_image_model,
    check_architecture,
    check_global_pool,
    check_grid,
    check_image,
    empty_batch,
    factory_kwargs,
    image_cfg,
    pos_table_for_grid,
    register_variants,
    trunc_normal_init,
)
from .official import register_official

__all__ = ["PolaSwinTransformer", "shifted_window_mask"]

MASK_VALUE = -100.0  # the official additive logit for tokens a window must not mix


def window_partition(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """(B, H, W, C) -> (B·windows, wh·ww, C); windows in raster order, image-major."""
    b, h, w, c = x.shape
    wh, ww = window
    x = x.view(b, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, c)


def window_reverse(windows: torch.Tensor, window: tuple[int, int], h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: (B·windows, wh·ww, C) -> (B, H, W, C)."""
    wh, ww = window
    c = windows.shape[-1]
    x = windows.view(-1, h // wh, w // ww, wh, ww, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, h, w, c)


def _shift_regions(size: int, window: int, shift: int, device) -> torch.Tensor:
    """Region of each row (column) of a rolled grid: 0 body, 1 last window's unwrapped part, 2 wrapped strip."""
    regions = torch.zeros(size, dtype=torch.long, device=device)
    if shift:
        regions[size - window:] = 1
        regions[size - shift:] = 2
    return regions


def shifted_window_mask(grid, window, shift, device=None) -> torch.Tensor:
    """(windows, N, N) additive mask for attention in the windows of a padded, rolled token grid.

    ``grid`` is the real (H, W) grid; it is padded at the bottom/right to whole windows and then
    rolled by ``-shift``. Two tokens of a window may attend to each other only if they lie in the
    same region of the roll (the official Swin mask) and are both real, or both padding.
    Without padding this equals the official ``attn_mask`` buffer.
    """
    (h, w), (wh, ww), (sh, sw) = grid, window, shift
    hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
    labels = _shift_regions(hp, wh, sh, device)[:, None] * 3 + _shift_regions(wp, ww, sw, device)[None, :]
    padding = torch.ones(hp, wp, dtype=torch.bool, device=device)
    padding[:h, :w] = False
    labels = labels.masked_fill(padding.roll((-sh, -sw), (0, 1)), -1)
    labels = window_partition(labels[None, :, :, None], (wh, ww)).squeeze(-1)  # (windows, N)
    apart = labels[:, :, None] != labels[:, None, :]
    return torch.zeros(apart.shape, device=device).masked_fill(apart, MASK_VALUE)


def hard_window_mask(mask: torch.Tensor) -> torch.Tensor:
    """The official mask with its ``MASK_VALUE`` logits set to -inf.

    ``exp(-100)`` is a float32 denormal: each softmax weight of a separated pair would be one, and
    every product that touches them (P·V, the backward's products) runs many times slower on x86. The weights
    become exact zeros instead of 3.7e-44, below the rounding of any unmasked weight (float32 or
    float64). Every row keeps its own token (a token is never apart from itself), so no row is empty.
    """
    return mask.masked_fill(mask <= MASK_VALUE, float("-inf"))


@register_notrace_module  # reason: the window layout (size, shift, padding) is chosen from the input's grid
class PolaSwinBlock(nn.Module):
    """Pre-norm block: (shifted) window attention, then an MLP; works on (B, H, W, C) maps.

    ``window_size``/``shift_size`` are the configured values; they are clipped to
    ``input_resolution`` (the stage grid at the build size) the official way.
    """

    def __init__(self, dim, input_resolution, num_heads, window_size=7, shift_size=0, mlp_ratio=4.0, qkv_bias=True,
                 qk_scale=None, drop=0.0, attn_drop=0.0, drop_path=0.0, norm_layer=nn.LayerNorm, alpha=4,
                 kernel_size=5, attn_type="L", attn_switches=None):
        super().__init__()
        self.input_resolution = tuple(input_resolution)
        if min(self.input_resolution) <= window_size:  # the window covers the stage: no partition, no shift
            window_size, shift_size = min(self.input_resolution), 0
        if not 0 <= shift_size < window_size:
            raise ValueError(f"shift_size {shift_size} must be in [0, window_size {window_size})")
        self.window_size = window_size
        self.shift_size = shift_size
        self.covers_stage = window_size >= max(self.input_resolution)
        self.linear = attn_type == "L"

        self.norm1 = norm_layer(dim)
        if self.linear:
            self.attn = PolaLinearAttention(dim, num_heads, qkv_bias=qkv_bias, proj_drop=drop, kernel_size=kernel_size,
                                            alpha=alpha, key_pos_tokens=window_size * window_size, fused_qkvg=True,
                                            **(attn_switches or {}))
        else:
            self.attn = WindowAttention(dim, window_size, num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale,
                                        attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        mask = None
        if shift_size:
            window = (window_size, window_size)
            mask = shifted_window_mask(self.input_resolution, window, (shift_size, shift_size))
        self.register_buffer("attn_mask", mask)

    def layout(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(window, shift) used on a (height, width) token grid (see the module docstring)."""
        w = self.window_size
        if self.linear and self.covers_stage:
            return (height, width), (0, 0)
        window = (min(w, height), min(w, width)) if self.linear else (w, w)
        return window, tuple(self.shift_size if side > w else 0 for side in (height, width))

    def _mask(self, grid, window, shift, padded, device):
        if not (any(shift) or padded):
            return None
        if grid == self.input_resolution and self.attn_mask is not None:
            mask = self.attn_mask
        else:
            if torch.jit.is_tracing():
                # TorchScript tracing (legacy ONNX export) hands sizes over as traced tensors, and the mask's
                # index writes would then be mis-traced; a trace holds for its own input size, so use plain ints.
                grid = tuple(int(side) for side in grid)
            mask = shifted_window_mask(grid, window, shift, device)
        return hard_window_mask(mask)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w, _ = x.shape
        (wh, ww), (sh, sw) = self.layout(h, w)
        pad_h, pad_w = -h % wh, -w % ww
        if pad_h or pad_w:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        if sh or sw:
            x = x.roll((-sh, -sw), (1, 2))
        windows = window_partition(x, (wh, ww))
        if self.linear:  # the official linear attention ignores the shift mask
            windows = self.attn(windows, wh, ww)
        else:
            windows = self.attn(windows, self._mask((h, w), (wh, ww), (sh, sw), pad_h or pad_w, x.device))
        x = window_reverse(windows, (wh, ww), h + pad_h, w + pad_w)
        if sh or sw:
            x = x.roll((sh, sw), (1, 2))
        return x[:, :h, :w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self._attention(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    """2x2 neighbours concatenated (order (0,0), (1,0), (0,1), (1,1) as (row, col)), normed, projected to 2C."""

    def __init__(self, dim, norm_layer=nn.LayerNorm):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = norm_layer(4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x))


class PolaSwinStage(nn.Module):
    """The blocks of one resolution, then the official PatchMerging (every stage but the last)."""

    def __init__(self, dim, input_resolution, depth, num_heads, window_sizes, attn_types, drop_path, downsample,
                 norm_layer, **block_kwargs):
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.ModuleList(
            PolaSwinBlock(dim, input_resolution, num_heads, window_size=window_sizes[i],
                          shift_size=0 if i % 2 == 0 else window_sizes[i] // 2, drop_path=drop_path[i],
                          norm_layer=norm_layer, attn_type=attn_types[i], **block_kwargs)
            for i in range(depth)
        )
        self.downsample = PatchMerging(dim, norm_layer) if downsample else None

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_blocks(x)
        return x if self.downsample is None else self.downsample(x)


def block_attn_types(attn_type: str, depths) -> list[list[str]]:
    """Per stage, per block attention letters ('L' or 'S') from the official ``attn_type`` string."""
    n = len(depths)
    stages, split = attn_type[:n], attn_type[n:]
    if len(stages) != n or set(stages) - set("LSM") or ("M" in stages) != split.isdigit():
        raise ValueError(
            f"attn_type {attn_type!r} must give one of L/S/M per stage ({n} stages), "
            "followed by the number of linear blocks if an M stage is present (e.g. 'LLMS3')"
        )
    return [
        ["L" if i < int(split) else "S" for i in range(d)] if kind == "M" else [kind] * d
        for kind, d in zip(stages, depths)
    ]


class PolaSwinTransformer(ClassifierMixin, nn.Module):
    """Swin Transformer whose stages use PolaFormer linear or softmax window attention.

    Args (official names and meaning):
        img_size: the size the model is built for: fixes the stored tables (key positional
            encodings, masks) and the official window clipping. Other sizes run too.
        patch_size, in_chans, num_classes, embed_dim, depths, num_heads, mlp_ratio, qkv_bias,
        qk_scale, drop_rate, attn_drop_rate, drop_path_rate, norm_layer, ape, patch_norm: as in Swin.
        window_size: window of the linear blocks; softmax blocks use 7 (12 if > 56).
        alpha: range of the learnable power, ``p ∈ (1, 1 + alpha)``.
        kernel_size: depthwise conv on v in the linear blocks.
        attn_type: per-stage attention letters (see the module docstring).
        global_pool: ``'avg'`` (the official token mean) or ``''``.
        polarity, polarity_coefficients, local: the attention's ablation switches (paper Table 3; see
            :class:`~polaformer.layers.PolaLinearAttention`); the defaults are the official model.
        device, dtype: where and in which dtype to build the parameters (timm's factory arguments).

    ``forward_features`` returns (B, H/32, W/32, C) maps: ``output_fmt`` is ``'NHWC'``, as timm's Swin.
    """

    output_fmt = "NHWC"

    @factory_kwargs
    def __init__(self, img_size=224, patch_size=4, in_chans=3, num_classes=1000, embed_dim=96, depths=(2, 2, 6, 2),
                 num_heads=(3, 6, 12, 24), window_size=7, mlp_ratio=4.0, qkv_bias=True, qk_scale=None, drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.1, norm_layer=nn.LayerNorm, ape=False, patch_norm=True,
                 alpha=4, kernel_size=5, attn_type="LLLL", global_pool="avg", polarity=True, polarity_coefficients=True,
                 local="dwc"):
        super().__init__()
        check_architecture(drop_path_rate, depths=list(depths), num_heads=list(num_heads), embed_dim=embed_dim,
                           in_chans=in_chans, patch_size=patch_size, window_size=window_size,
                           num_classes=num_classes, ratios={"mlp_ratio": mlp_ratio})
        check_grid(img_size, patch_size)
        check_global_pool(global_pool)
        if len(num_heads) != len(depths):
            raise ValueError(f"num_heads {tuple(num_heads)} and depths {tuple(depths)} differ in length")
        num_stages = len(depths)
        attn_types = block_attn_types(attn_type, depths)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = embed_dim * 2 ** (num_stages - 1)
        self.total_stride = tuple(p * 2 ** (num_stages - 1) for p in to_2tuple(patch_size))

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim,
                                      norm_layer=norm_layer if patch_norm else None, output_fmt="NHWC",
                                      strict_img_size=False)
        grid = self.patch_embed.grid_size
        self.absolute_pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1], embed_dim)) if ape else None
        self.pos_drop = nn.Dropout(drop_rate)

        total = sum(depths)
        dpr = [drop_path_rate * i / max(total - 1, 1) for i in range(total)]
        self.layers = nn.ModuleList()
        self.feature_info = []
        for i, depth in enumerate(depths):
            dim = embed_dim * 2 ** i
            softmax_window = 7 if window_size <= 56 else 12
            self.layers.append(PolaSwinStage(
                dim, (grid[0] // 2 ** i, grid[1] // 2 ** i), depth, num_heads[i],
                window_sizes=[window_size if t == "L" else softmax_window for t in attn_types[i]],
                attn_types=attn_types[i], drop_path=dpr[sum(depths[:i]):sum(depths[:i + 1])],
                downsample=i < num_stages - 1, norm_layer=norm_layer, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                qk_scale=qk_scale, drop=drop_rate, attn_drop=attn_drop_rate, alpha=alpha, kernel_size=kernel_size,
                attn_switches=dict(polarity=polarity, polarity_coefficients=polarity_coefficients, local=local),
            ))
            self.feature_info.append(dict(num_chs=dim, reduction=self.patch_embed.patch_size[0] * 2 ** i,
                                          module=f"layers.{i}.blocks.{depth - 1}"))
        self.norm = norm_layer(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        if self.absolute_pos_embed is not None:
            trunc_normal_(self.absolute_pos_embed, std=0.02)
        for m in self.modules():
            trunc_normal_init(m)

    @torch.jit.ignore
    def no_weight_decay(self):
        """Position tables and the linear attention's temperature/exponent parameters."""
        skip = ("absolute_pos_embed", "relative_position_bias_table", ".scale", ".power", ".positional_encoding")
        return {n for n, _ in self.named_parameters() if n.endswith(skip)}

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        return dict(
            stem=r"^patch_embed|^absolute_pos_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.blocks\.(\d+)", None),
                (r"^layers\.(\d+)\.downsample", (99999,)),  # joins the last block of its stage
                (r"^norm", (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        sh, sw = self.total_stride
        x = check_image(x, self.in_chans, (sh, sw), f"{sh if sh == sw else f'{sh}x{sw}'} (the total stride)")
        x = self.patch_embed(x)  # (B, H, W, C)
        if self.absolute_pos_embed is not None:
            b, h, w, c = x.shape
            pos = pos_table_for_grid(self.absolute_pos_embed, (h, w), self.patch_embed.grid_size)
            x = x + pos.reshape(1, h, w, c)
        return self.pos_drop(x)

    @empty_batch
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H/32, W/32, C) map after the final norm."""
        x = self._embed(x)
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @empty_batch
    def forward_intermediates(self, x, indices=None, norm=False, stop_early=False, output_fmt="NCHW",
                              intermediates_only=False):
        """Stage outputs before their PatchMerging, as NCHW (or NHWC) maps at strides 4/8/16/32.

        ``norm`` applies the final norm to the last stage's map (the only one it is sized for).
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.layers), indices)
        last = len(self.layers) - 1
        stages = self.layers[:max_index + 1] if stop_early else self.layers
        intermediates = []
        x = self._embed(x)
        for i, stage in enumerate(stages):
            x = stage.forward_blocks(x)
            if i in take:
                feat = self.norm(x) if norm and i == last else x
                intermediates.append(feat.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else feat)
            if stage.downsample is not None:
                x = stage.downsample(x)
        if intermediates_only:
            return intermediates
        return (self.norm(x) if len(stages) == last + 1 else x), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm=False, prune_head=True):
        take, max_index = feature_take_indices(len(self.layers), indices)
        prune_end = max_index < len(self.layers) - 1
        self.layers = self.layers[:max_index + 1]
        self.layers[-1].downsample = None  # its output would feed only the removed stages
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take


def _norm_layer(spec):
    """The official ``norm_layer`` record ({"callable": "torch.nn.LayerNorm", "kwargs": {...}}) as a class."""
    if spec is None:
        return nn.LayerNorm
    if not isinstance(spec, dict) or spec.get("callable") != "torch.nn.LayerNorm":
        raise ValueError(f"unsupported norm_layer {spec!r}; only torch.nn.LayerNorm is known")
    return partial(nn.LayerNorm, **spec["kwargs"]) if spec.get("kwargs") else nn.LayerNorm


@register_official("swin", "PolaSwinTransformer")
def _from_official(c: dict) -> PolaSwinTransformer:
    model = PolaSwinTransformer(
        img_size=c["img_size"], patch_size=c["patch_size"], in_chans=c["in_chans"], num_classes=c["num_classes"],
        embed_dim=c["embed_dim"], depths=c["depths"], num_heads=c["num_heads"], window_size=c["window_size"],
        mlp_ratio=c["mlp_ratio"], qkv_bias=c["qkv_bias"], qk_scale=c.get("qk_scale"), drop_rate=c["drop_rate"],
        attn_drop_rate=c["attn_drop_rate"], drop_path_rate=c["drop_path_rate"],
        norm_layer=_norm_layer(c.get("norm_layer")), ape=c["ape"], patch_norm=c["patch_norm"], alpha=c["alpha"],
        kernel_size=c["kernel_size"], attn_type=c["attn_type"],
    )
    model.set_grad_checkpointing(c.get("use_checkpoint", False))
    return model


# The official cfgs/pola_swin_*.yaml sizes (LLSS, global linear windows); caller kwargs override.
_OFFICIAL = dict(patch_size=4, window_size=56, attn_type="LLSS")
_SIZES = {
    "pola_swin_t": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.2),
    "pola_swin_s": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.3),
    "pola_swin_b": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), drop_path_rate=0.5),
    "pola_swin_b_384": dict(img_size=384, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32),
                            window_size=96, drop_path_rate=0.5),
}

_cfg = partial(image_cfg, first_conv="patch_embed.proj", license="mit")
default_cfgs = generate_default_cfgs({
    "pola_swin_t": _cfg(),
    "pola_swin_s": _cfg(),
    "pola_swin_b": _cfg(),
    # cfgs/pola_swin_b_384.yaml evaluates without a centre crop (TEST.CROP False): a 384x384 resize.
    "pola_swin_b_384": _cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
})


def _create(variant, pretrained=False, **kwargs) -> PolaSwinTransformer:
    return build_image_model(PolaSwinTransformer, variant, pretrained, **{**_OFFICIAL, **_SIZES[variant], **kwargs})


register_variants(__name__, _SIZES, _create)
