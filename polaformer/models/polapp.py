"""PolaFormer++: a conv-stem pyramid of PaCS linear attention and RoPE softmax attention (official ``POLA_b*``).

Weight-compatible with the authors' ``POLA`` class (same module names and shapes; their checkpoints load
strictly):

- Stem: four 3×3 convs with BatchNorm (strides 2, 1, 1, 2), GELU between them: stride 4.
- Block: ``x + pos(x)`` (3×3 depthwise conv), then pre-norm attention and a conv FFN, each branch optionally
  scaled by a per-channel layerscale. Block type per the official flags: ``'l'`` = PaCS linear attention
  with RoPE over 2·head_dim, ``'v'`` = softmax attention with RoPE over head_dim; every stage holds both
  RoPE modules (``RoPE``, ``RoPE_linear``) as the official code does.
- PatchMerging (3×3 stride-2 conv + BatchNorm) closes stages 1-3; the pyramid features (strides 4/8/16/32)
  are the block outputs before it.
- Head: 1×1 conv to ``projection`` channels, BatchNorm, Swish, global average pool, 1×1 conv classifier.

RoPE tables follow the actual grid and every strided conv pads, so any input size runs (``img_size`` is
accepted for timm's API and changes nothing). ``pola_b0``..``pola_b5`` are timm deprecation aliases.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
from timm.layers import DropPath, SelectAdaptivePool2d, get_device_dtype
from timm.models import generate_default_cfgs
from timm.models._features import feature_take_indices
from timm.models._registry import register_model_deprecations
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PacsLinearAttention, RoPE2d, RopeSoftmaxAttention
from ..ops import tokens_to_map
from ._helpers import (
    build_image_model,
    check_architecture,
    check_image,
    empty_batch,
    factory_kwargs,
    image_cfg,
    register_variants,
    trunc_normal_init,
)
from .official import register_official

__all__ = ["PolaFormerPP"]


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of a (B, C, H, W) map; the inner ``norm`` keeps the official key names."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvFFN(nn.Module):
    """fc1 -> GELU -> (h + dwconv3x3(h)) -> fc2, on a (B, C, H, W) map."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.dwconv = nn.Conv2d(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        hidden = tokens_to_map(self.act(self.fc1(x.flatten(2).transpose(1, 2))), h, w)
        hidden = hidden + self.dwconv(hidden)
        return tokens_to_map(self.fc2(hidden.flatten(2).transpose(1, 2)), h, w)


class PolaPPBlock(nn.Module):
    """Conv positional encoding, then attention and FFN residual branches (layerscale optional)."""

    def __init__(self, block_type: str, dim: int, num_heads: int, ffn_dim: int, drop_path: float = 0.0,
                 layerscale: bool = False, layer_init_value: float = 1e-6):
        super().__init__()
        if block_type not in ("l", "v"):
            raise ValueError(f"block type must be 'l' (PaCS linear) or 'v' (softmax), got {block_type!r}")
        self.block_type = block_type
        self.norm1 = LayerNorm2d(dim)
        self.attn = PacsLinearAttention(dim, num_heads) if block_type == "l" else RopeSoftmaxAttention(dim, num_heads)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = LayerNorm2d(dim)
        self.ffn = ConvFFN(dim, ffn_dim)
        self.pos = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        if layerscale:
            self.gamma_1 = nn.Parameter(torch.full((1, dim, 1, 1), float(layer_init_value)))
            self.gamma_2 = nn.Parameter(torch.full((1, dim, 1, 1), float(layer_init_value)))
        else:
            self.gamma_1 = self.gamma_2 = None

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        x = x + self.pos(x)
        attn = self.attn(self.norm1(x), sin, cos)
        x = x + self.drop_path(attn if self.gamma_1 is None else self.gamma_1 * attn)
        ffn = self.ffn(self.norm2(x))
        return x + self.drop_path(ffn if self.gamma_2 is None else self.gamma_2 * ffn)


class PatchMerging(nn.Module):
    """3×3 stride-2 conv + BatchNorm between stages."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.reduction = nn.Conv2d(dim, out_dim, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.reduction(x))


class ConvStem(nn.Module):
    """Four 3×3 convs with BatchNorm, GELU between them; stride 4 overall."""

    def __init__(self, in_chans: int, embed_dim: int):
        super().__init__()
        mid = embed_dim // 2
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, mid, 3, 2, 1), nn.BatchNorm2d(mid), nn.GELU(),
            nn.Conv2d(mid, mid, 3, 1, 1), nn.BatchNorm2d(mid), nn.GELU(),
            nn.Conv2d(mid, mid, 3, 1, 1), nn.BatchNorm2d(mid), nn.GELU(),
            nn.Conv2d(mid, embed_dim, 3, 2, 1), nn.BatchNorm2d(embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class PolaPPStage(nn.Module):
    """Blocks at one resolution, then (except in the last stage) PatchMerging."""

    def __init__(self, dim: int, out_dim: int | None, depth: int, num_heads: int, block_types: str,
                 ffn_dim: int, drop_path: Sequence[float], layerscale: bool, layer_init_value: float):
        super().__init__()
        self.grad_checkpointing = False
        self.RoPE = RoPE2d(dim, num_heads)
        self.RoPE_linear = RoPE2d(2 * dim, num_heads)
        self.blocks = nn.ModuleList(
            PolaPPBlock(block_types[i], dim, num_heads, ffn_dim, drop_path[i], layerscale, layer_init_value)
            for i in range(depth)
        )
        self.downsample = PatchMerging(dim, out_dim) if out_dim is not None else None

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's blocks without the PatchMerging: the pyramid feature of this stage."""
        height, width = x.shape[-2:]
        tables = {}  # only the RoPE tables that this stage's blocks use
        for blk in self.blocks:
            if blk.block_type not in tables:
                rope = self.RoPE_linear if blk.block_type == "l" else self.RoPE
                tables[blk.block_type] = rope(height, width)
            sin, cos = tables[blk.block_type]
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, sin, cos, use_reentrant=False)
            else:
                x = blk(x, sin, cos)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_blocks(x)
        return x if self.downsample is None else self.downsample(x)


def _expand_block_types(block_types, depths) -> list[str]:
    """One 'l'/'v' flag per block: a single flag covers its whole stage."""
    if len(block_types) != len(depths):
        raise ValueError(f"block_types has {len(block_types)} stages, depths has {len(depths)}")
    out = []
    for i, (types, depth) in enumerate(zip(block_types, depths)):
        types = "".join(types)
        if len(types) == 1:
            types *= depth
        if len(types) != depth:
            raise ValueError(f"stage {i}: {len(types)} block types for depth {depth}")
        out.append(types)
    return out


class PolaFormerPP(nn.Module):
    """PolaFormer++ (official class ``POLA``); arguments use the official names except ``block_types``.

    Args:
        in_chans, num_classes: image channels and classes.
        embed_dims, depths, num_heads, mlp_ratios: per stage.
        block_types: per stage, a string (or sequence) of ``'l'``/``'v'`` flags, one per block or a
            single flag for the whole stage (the official ``flagss``, cut to the depths).
        drop_rate: dropout before the classifier; drop_path_rate: stochastic depth, linear in depth.
        projection: channels of the 1×1 projection before pooling.
        layerscales, layer_init_values: per stage, whether blocks scale their branches, and the initial scale.
        global_pool: pooling before the classifier (``'avg'`` as in the official model).
        img_size: accepted for timm's API; no effect (RoPE tables follow the input, any size runs).
        device, dtype: where and in which dtype to build the parameters (timm's factory arguments).
    """

    @factory_kwargs
    def __init__(self, in_chans=3, num_classes=1000, embed_dims=(96, 192, 384, 768), depths=(2, 2, 6, 2),
                 num_heads=(3, 6, 12, 24), mlp_ratios=(3, 3, 3, 3), block_types=("l", "l", "v", "v"),
                 drop_rate=0.0, drop_path_rate=0.1, projection=1024, layerscales=(False,) * 4,
                 layer_init_values=(1e-6,) * 4, global_pool="avg", img_size=None):
        super().__init__()
        check_architecture(drop_path_rate, depths=list(depths), num_heads=list(num_heads), embed_dims=list(embed_dims),
                           in_chans=in_chans, projection=projection, num_classes=num_classes,
                           ratios={"mlp_ratios": mlp_ratios})
        num_stages = len(depths)
        for name, values in (("embed_dims", embed_dims), ("num_heads", num_heads), ("mlp_ratios", mlp_ratios),
                             ("layerscales", layerscales), ("layer_init_values", layer_init_values)):
            if len(values) != num_stages:
                raise ValueError(f"{name} has {len(values)} entries, depths has {num_stages}")
        block_types = _expand_block_types(block_types, depths)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.grad_checkpointing = False
        self.patch_embed = ConvStem(in_chans, embed_dims[0])
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        self.layers = nn.ModuleList()
        self.feature_info = []
        for i in range(num_stages):
            start = sum(depths[:i])
            self.layers.append(PolaPPStage(
                embed_dims[i], embed_dims[i + 1] if i < num_stages - 1 else None, depths[i], num_heads[i],
                block_types[i], int(mlp_ratios[i] * embed_dims[i]), dpr[start:start + depths[i]],
                layerscales[i], layer_init_values[i],
            ))
            self.feature_info.append(
                dict(num_chs=embed_dims[i], reduction=4 * 2 ** i, module=f"layers.{i}.blocks.{depths[i] - 1}")
            )
        self.num_features = self.head_hidden_size = projection
        self.proj = nn.Conv2d(embed_dims[-1], projection, 1)
        self.norm = nn.BatchNorm2d(projection)
        self.swish = nn.SiLU()
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Conv2d(projection, num_classes, 1) if num_classes > 0 else nn.Identity()
        # As the official code: only convs (truncated normal) and LayerNorms are re-initialised.
        self.apply(partial(trunc_normal_init, layer=nn.Conv2d))

    @torch.jit.ignore
    def no_weight_decay(self):
        """The PaCS temperatures ``s1``/``s2`` (1-D parameters and biases are skipped by the optimizer anyway;
        the official code still decays the layerscale gammas and ``pos`` weights)."""
        return {name for name, _ in self.named_parameters() if name.endswith((".s1", ".s2"))}

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        return dict(
            stem=r"^patch_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.blocks\.(\d+)", None),
                (r"^layers\.(\d+)\.downsample", (99998,)),
                (r"^proj|^norm", (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable
        for stage in self.layers:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes, global_pool=None):
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool)
        dd = get_device_dtype(self)
        self.head = nn.Conv2d(self.num_features, num_classes, 1, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        return check_image(x, self.in_chans, (1, 1), "one pixel", floor=True)

    @empty_batch
    def forward_intermediates(self, x, indices=None, norm=False, stop_early=False, output_fmt="NCHW",
                              intermediates_only=False):
        """Stage features (before each PatchMerging) at strides 4/8/16/32, NCHW; ``norm`` has no effect (the
        final BatchNorm follows the 1×1 projection, not any stage feature)."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        x = self.patch_embed(self._check_input(x))
        stages = self.layers[:max_index + 1] if stop_early else self.layers
        intermediates = []
        for i, stage in enumerate(stages):
            x = stage.forward_blocks(x)
            if i in take_indices:
                intermediates.append(x)
            if i < len(stages) - 1:
                x = stage.downsample(x)
        if intermediates_only:
            return intermediates
        if len(stages) == len(self.layers):
            x = self._final_conv(x)
        return x, intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm=False, prune_head=True):
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        self.layers = self.layers[:max_index + 1]
        self.layers[-1].downsample = None  # the feature is taken before it
        # The 1×1 projection and its norm follow the last stage and never feed a feature.
        if prune_norm or prune_head or max_index < len(self.feature_info) - 1:
            self.proj = self.norm = self.swish = nn.Identity()
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
            self.reset_classifier(0, "")
        return take_indices

    def _final_conv(self, x: torch.Tensor) -> torch.Tensor:
        return self.swish(self.norm(self.proj(x)))

    @empty_batch
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, projection, H/32, W/32): the map after projection, BatchNorm and Swish, before pooling."""
        x = self.patch_embed(self._check_input(x))
        for stage in self.layers:
            x = stage(x)
        return self._final_conv(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.global_pool(x))
        if pre_logits:
            return x.flatten(1)
        x = self.head(x)
        return x if self.global_pool.is_identity() else x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


_OFFICIAL_RENAMES = {"flagss": "block_types"}


@register_official("polapp", "POLA")
def _from_official(constructor: dict) -> PolaFormerPP:
    """Official ``POLA(**constructor)``; its ``flagss`` lists may be longer than the depths (extra flags unused)."""
    kwargs = {_OFFICIAL_RENAMES.get(k, k): v for k, v in constructor.items()}
    if "block_types" in kwargs:
        depths = kwargs.get("depths", (2, 2, 6, 2))
        kwargs["block_types"] = [list(types)[:depth] for types, depth in zip(kwargs["block_types"], depths)]
    return PolaFormerPP(**kwargs)


# Official factory arguments (polaformer++/models/pola.py); every stage uses mlp ratio 3.5 and layerscale.
# README, per variant: params, FLOPs, ImageNet top-1.
_B = dict(mlp_ratios=(3.5,) * 4, layerscales=(True,) * 4)
_SIZES = {
    "POLA_b0": dict(embed_dims=(32, 64, 128, 384), depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 12),  # 7M, 0.7G, 76.9%
                    drop_path_rate=0.1, projection=2048, layer_init_values=(1, 1, 1, 1), **_B),
    "POLA_b1": dict(embed_dims=(32, 64, 192, 384), depths=(2, 2, 4, 2), num_heads=(1, 2, 6, 12),  # 9M, 1.0G, 79.1%
                    drop_path_rate=0.1, projection=2048, layer_init_values=(1, 1, 1, 1), **_B),
    "POLA_b2": dict(embed_dims=(64, 128, 256, 512), depths=(2, 2, 6, 2), num_heads=(1, 2, 4, 8),  # 16M, 2.7G, 82.8%
                    drop_path_rate=0.1, projection=2048, layer_init_values=(1, 1, 1, 1), **_B),
    "POLA_b3": dict(embed_dims=(64, 128, 320, 512), depths=(3, 5, 9, 3), num_heads=(1, 2, 5, 8),  # 27M, 5.1G, 84.3%
                    drop_path_rate=0.15, projection=2048, layer_init_values=(1, 1, 1, 1), **_B),
    "POLA_b4": dict(embed_dims=(96, 192, 384, 512), depths=(4, 6, 12, 6), num_heads=(1, 2, 6, 8),  # 50M, 11G, 85.4%
                    drop_path_rate=0.4, projection=2048, layer_init_values=(1, 1, 1e-6, 1e-6), **_B),
    "POLA_b5": dict(embed_dims=(96, 192, 448, 640), depths=(4, 7, 19, 8), num_heads=(1, 2, 7, 10),  # 97M, 18G, 85.6%
                    drop_path_rate=0.55, projection=2560, layer_init_values=(1e-6,) * 4, **_B),
}

# The official evaluation resizes both sides to 256 (bicubic) and center-crops 224 (timm's 'squash').
default_cfgs = generate_default_cfgs({name: image_cfg(first_conv="patch_embed.proj.0") for name in _SIZES})


def _create(variant, pretrained=False, **kwargs) -> PolaFormerPP:
    """Build a variant; the caller's keyword arguments override the variant's sizes."""
    return build_image_model(PolaFormerPP, variant, pretrained, **{**_SIZES[variant], **kwargs})


register_variants(__name__, _SIZES, _create)

# The lower-case names some configs use: timm aliases that warn and build the official model.
register_model_deprecations(__name__, {name.lower(): name for name in _SIZES})
