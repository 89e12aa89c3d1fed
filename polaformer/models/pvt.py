"""Pola-PVT: the Pyramid Vision Transformer with PolaFormer attention (official ``pola_pvt_*``).

Weight-compatible with the authors' code: the same module names (``patch_embed{i}``,
``pos_embed{i}``, ``block{i}.{j}``, ``norm``, ``head``) and shapes, so the released checkpoints
load strictly. Quirks of the official model kept on purpose:

- The official build passes ``la_sr_ratios='1111'``: Pola blocks attend over all tokens of their
  stage (no spatial reduction); ``'8421'`` is the class default and gives a different layout.
- The final ``norm`` is built but never applied: features are the token mean of the last stage.
  Its weight and bias are held as buffers (:class:`HeldNorm`), so checkpoints keep loading strictly
  while every parameter of the model gets a gradient (timm's test-suite checks that).
- Patch embeddings use a LayerNorm with eps 1e-5; blocks use ``norm_layer`` (eps 1e-6).

Input sizes. Wherever the official model returns an output, this one returns the same:

- Strided patch embeddings floor, so any image at least as large as the total stride runs
  (official models built at 200 or 208 run at their own size: stage grids 50/25/12/6, 52/26/13/6).
- ``pos_embed{i}`` follows the official rule: added as it is when the stage has as many tokens as
  the *first* stage was built for (a one-row table broadcasts), else resampled bilinearly from
  the stage's built grid (in the table's dtype; no change on that grid).
- The attention's key table is added as it is when it has one row per key, whatever the grid
  (so a table built for 8x8 keys runs row by row on 4x16 keys, as in the official code).

Where the official model fails, this one goes further: a stage table that the official code
would add flat to a different number of tokens, and a key table of another length than the
keys (any other input size), are resampled bilinearly from their built grids.
"""
from __future__ import annotations

from functools import partial

import torch
from timm.layers import DropPath, Mlp, PatchEmbed, trunc_normal_
from timm.models import generate_default_cfgs
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PolaLinearAttention, SpatialReductionAttention
from ..ops import tokens_to_map
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

__all__ = ["HeldNorm", "PolaPVT", "PyramidBase"]


class PyramidBase(ClassifierMixin, nn.Module):
    """What the PVT-style families share: flat ``patch_embed{i}``/``block{i}`` stages (the official
    module names), the timm API (the classifier's from :class:`ClassifierMixin`), size checks and
    stage-wise intermediates.

    Subclasses set ``in_chans``, ``num_stages``, ``total_stride``, ``num_features``, ``feature_info``,
    ``global_pool``, ``head_drop``, ``head`` and ``grad_checkpointing``, and implement ``_stage(i, x)`` mapping an
    NCHW map to the next stage's NCHW map, and ``_stage_modules(i)`` naming the stage's modules.
    """

    @torch.jit.ignore
    def no_weight_decay(self):
        skip = (".scale", ".power", ".positional_encoding")
        return {n for n, _ in self.named_parameters() if n.startswith("pos_embed") or n.endswith(skip)}

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        return dict(
            stem=r"^patch_embed1|^pos_embed1",
            blocks=r"^(?:block|patch_embed|pos_embed|norm)(\d+)" if coarse else [
                (r"^block(\d+)\.(\d+)", None), (r"^(?:patch_embed|pos_embed|norm)(\d+)", (0,)), (r"^norm$", (99999,))
            ],
        )

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        stride = self.total_stride
        return check_image(x, self.in_chans, (stride, stride), f"the total stride {stride}")

    @empty_batch
    def forward_intermediates(self, x, indices=None, norm=False, stop_early=False, output_fmt="NCHW",
                              intermediates_only=False):
        """Stage outputs as NCHW maps (``norm`` has no effect: stage outputs are taken as the stages emit them)."""
        if output_fmt != "NCHW":
            raise ValueError("intermediates are NCHW maps")
        x = self._check_input(x)
        take, max_index = feature_take_indices(self.num_stages, indices)
        intermediates = []
        last = max_index if stop_early else self.num_stages - 1
        for i in range(last + 1):
            x = self._stage(i, x)
            if i in take:
                intermediates.append(x)
        return intermediates if intermediates_only else (x, intermediates)

    def prune_intermediate_layers(self, indices=1, prune_norm=False, prune_head=True):
        take, max_index = feature_take_indices(self.num_stages, indices)
        for i in range(max_index + 1, self.num_stages):
            for name in self._stage_modules(i):
                delattr(self, name)
        if max_index < self.num_stages - 1:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        self.num_stages = max_index + 1
        if prune_head or max_index < len(self.feature_info) - 1:
            self.reset_classifier(0, "")
        return take

    @empty_batch
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's map (B, C, H/32, W/32)."""
        x = self._check_input(x)
        for i in range(self.num_stages):
            x = self._stage(i, x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(-2, -1))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class HeldNorm(nn.Module):
    """The official final LayerNorm's ``weight`` and ``bias``, held as buffers: the official model
    builds the norm but never applies it, so they are loaded and saved, never trained."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(dim))
        self.register_buffer("bias", torch.zeros(dim))


class PolaPVTBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, qkv_bias, drop, drop_path, norm_layer, sr_ratio,
                 attn_type, num_tokens, alpha, kernel_size, qk_scale=None, attn_switches=None):
        super().__init__()
        self.norm1 = norm_layer(dim)
        if attn_type == "L":
            self.attn = PolaLinearAttention(
                dim, num_heads, qkv_bias=qkv_bias, proj_drop=drop, sr_ratio=sr_ratio, kernel_size=kernel_size,
                alpha=alpha, key_pos_tokens=num_tokens // (sr_ratio * sr_ratio), **(attn_switches or {}),
            )
        elif attn_type == "S":
            self.attn = SpatialReductionAttention(
                dim, num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale, proj_drop=drop, sr_ratio=sr_ratio
            )
        else:
            raise ValueError(f"attention type must be 'L' (Pola) or 'S' (softmax), got {attn_type!r}")
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x, height: int, width: int):
        x = x + self.drop_path(self.attn(self.norm1(x), height, width))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PolaPVT(PyramidBase):
    """PVT (v1) with Pola linear attention; arguments use the official names.

    Args:
        attn_type: one letter per stage, ``L`` = Pola linear attention, ``S`` = softmax SRA.
        sr_ratios: key/value reduction of softmax ('S') stages.
        la_sr_ratios: key/value reduction of Pola ('L') stages, one digit per stage.
        alpha, kernel_size: the power map's range and the depthwise conv size.
        polarity, polarity_coefficients, local: the attention's ablation switches (paper Table 3; see
            :class:`~polaformer.layers.PolaLinearAttention`); the defaults are the official model.
        device, dtype: where and in which dtype to build the parameters (timm's factory arguments).
    """

    @factory_kwargs
    def __init__(self, img_size=224, patch_size=4, in_chans=3, num_classes=1000, embed_dims=(64, 128, 320, 512),
                 num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4), qkv_bias=True, qk_scale=None, drop_rate=0.0,
                 drop_path_rate=0.0, norm_layer=partial(nn.LayerNorm, eps=1e-6), depths=(2, 2, 2, 2),
                 sr_ratios=(8, 4, 2, 1), la_sr_ratios="1111", num_stages=4, alpha=4, kernel_size=5,
                 attn_type="LLLL", global_pool="avg", polarity=True, polarity_coefficients=True, local="dwc"):
        super().__init__()
        check_architecture(drop_path_rate, depths=list(depths), num_heads=list(num_heads), sr_ratios=list(sr_ratios),
                           embed_dims=list(embed_dims), in_chans=in_chans, patch_size=patch_size,
                           num_classes=num_classes, ratios={"mlp_ratios": mlp_ratios})
        check_grid(img_size, patch_size)
        lists = dict(embed_dims=embed_dims, num_heads=num_heads, mlp_ratios=mlp_ratios, depths=depths,
                     sr_ratios=sr_ratios, attn_type=attn_type, la_sr_ratios=str(la_sr_ratios))
        short = [name for name, values in lists.items() if len(values) < num_stages]
        if num_stages < 1 or short:
            raise ValueError(f"num_stages={num_stages}: need at least one stage and an entry per stage in "
                             f"{', '.join(short) or 'each list'}")
        if len(embed_dims) < 4 or embed_dims[num_stages - 1] != embed_dims[3]:
            # The official head and final norm take embed_dims[3] channels, whatever num_stages is.
            raise ValueError(f"embed_dims[{num_stages - 1}] must equal embed_dims[3] (the head's input), "
                             f"got {tuple(embed_dims)} with num_stages={num_stages}")
        check_global_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_stages = num_stages
        self.depths = list(depths)
        self.num_features = self.head_hidden_size = embed_dims[3]
        self.grad_checkpointing = False
        self.total_stride = patch_size * 2 ** (num_stages - 1)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        cur = 0
        self.feature_info = []
        for i in range(num_stages):
            stage_img = img_size if i == 0 else img_size // 2 ** (i + 1)
            embed = PatchEmbed(stage_img, patch_size if i == 0 else 2, in_chans if i == 0 else embed_dims[i - 1],
                               embed_dims[i], norm_layer=nn.LayerNorm, strict_img_size=False)
            sr = sr_ratios[i] if attn_type[i] == "S" else int(str(la_sr_ratios)[i])
            blocks = nn.ModuleList(
                PolaPVTBlock(embed_dims[i], num_heads[i], mlp_ratios[i], qkv_bias, drop_rate, dpr[cur + j],
                             norm_layer, sr, attn_type[i], embed.num_patches, alpha, kernel_size, qk_scale,
                             dict(polarity=polarity, polarity_coefficients=polarity_coefficients, local=local))
                for j in range(depths[i])
            )
            cur += depths[i]
            setattr(self, f"patch_embed{i + 1}", embed)
            setattr(self, f"pos_embed{i + 1}", nn.Parameter(torch.zeros(1, embed.num_patches, embed_dims[i])))
            setattr(self, f"block{i + 1}", blocks)
            reduction = patch_size * 2**i
            self.feature_info.append(dict(num_chs=embed_dims[i], reduction=reduction, module=f"block{i + 1}"))
        self.flat_pos_tokens = self.patch_embed1.num_patches  # official: tables are added flat at this count
        self.norm = HeldNorm(embed_dims[3])  # held for checkpoint compatibility; never applied (official)
        self.head_drop = nn.Identity()  # the official drop_rate acts inside the blocks, not before the head
        self.head = nn.Linear(embed_dims[3], num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _stage_modules(self, i: int) -> tuple[str, ...]:
        return (f"patch_embed{i + 1}", f"pos_embed{i + 1}", f"block{i + 1}")

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        stride = self.total_stride
        return check_image(x, self.in_chans, (stride, stride), f"the total stride {stride}", floor=True)

    def _stage(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``i`` (0-based) on an NCHW map; returns the NCHW map it produces."""
        embed = getattr(self, f"patch_embed{i + 1}")
        ph, pw = embed.patch_size
        height, width = x.shape[-2] // ph, x.shape[-1] // pw
        x = embed(x[..., :height * ph, :width * pw])  # the official strided conv floors: drop the remainder
        pos = pos_table_for_grid(getattr(self, f"pos_embed{i + 1}"), (height, width), embed.grid_size,
                                 interpolation="bilinear", antialias=False, flat_tokens=self.flat_pos_tokens)
        x = self.pos_drop(x + pos)
        for blk in getattr(self, f"block{i + 1}"):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, height, width, use_reentrant=False)
            else:
                x = blk(x, height, width)
        return tokens_to_map(x, height, width)

    def _init_weights(self):
        for i in range(self.num_stages):
            trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=0.02)
        for m in self.modules():
            trunc_normal_init(m)


@register_official("pvt", "PyramidVisionTransformer")
def _from_official(c: dict) -> PolaPVT:
    norm = c.get("norm_layer")  # {"callable": "torch.nn.LayerNorm", "kwargs": {...}}; no kwargs = eps 1e-5
    eps = norm["kwargs"].get("eps", 1e-5) if isinstance(norm, dict) else 1e-6
    return PolaPVT(
        img_size=c["img_size"], patch_size=c["patch_size"], in_chans=c["in_chans"], num_classes=c["num_classes"],
        embed_dims=c["embed_dims"], num_heads=c["num_heads"], mlp_ratios=c["mlp_ratios"], qkv_bias=c["qkv_bias"],
        qk_scale=c.get("qk_scale"), drop_rate=c["drop_rate"], drop_path_rate=c["drop_path_rate"],
        norm_layer=partial(nn.LayerNorm, eps=eps), depths=c["depths"], sr_ratios=c["sr_ratios"],
        la_sr_ratios=c["la_sr_ratios"], num_stages=c["num_stages"], alpha=c["alpha"], kernel_size=c["kernel_size"],
        attn_type=c["attn_type"] or "LLLL",
    )


# Official sizes and build settings (la_sr_ratios '1111' as the official build passes).
_OFFICIAL = dict(patch_size=4, embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4),
                 qkv_bias=True, sr_ratios=(8, 4, 2, 1), la_sr_ratios="1111")
_SIZES = {
    "pola_pvt_tiny": dict(depths=(2, 2, 2, 2)),
    "pola_pvt_small": dict(depths=(3, 4, 6, 3)),
    "pola_pvt_medium": dict(depths=(3, 4, 18, 3)),
    "pola_pvt_large": dict(depths=(3, 8, 27, 3)),
}

default_cfgs = generate_default_cfgs({name: image_cfg(first_conv="patch_embed1.proj", license="apache-2.0")
                                      for name in _SIZES})


def _create(variant, pretrained=False, **kwargs) -> PolaPVT:
    return build_image_model(PolaPVT, variant, pretrained, **{**_OFFICIAL, **_SIZES[variant], **kwargs})


register_variants(__name__, _SIZES, _create)
