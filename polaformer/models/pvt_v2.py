"""Pola-PVTv2 b0–b5 (paper Table 5). No official code exists; this follows FLatten Transformer's
PVTv2 with the Pola attention swapped in:

- overlapping patch embeddings (7×7 stride 4, then 3×3 stride 2) and an MLP with a 3×3
  depthwise conv (timm's PVTv2 pieces), a LayerNorm after every stage, token-mean pooling;
- Pola linear attention in every block with no spatial reduction of keys/values, a learnable
  key positional table per block (resampled bilinearly for other input sizes), the 5×5
  depthwise conv on v and the output gate.

Sizes are PVTv2's: b0 32/64/160/256 wide, b1–b5 64/128/320/512; heads 1/2/5/8.
"""
from __future__ import annotations

from functools import partial

import torch
from timm.layers import DropPath
from timm.models import generate_default_cfgs
from timm.models.pvt_v2 import OverlapPatchEmbed
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PolaLinearAttention
from ..ops import tokens_to_map
from ._helpers import (
    build_image_model,
    check_architecture,
    check_global_pool,
    factory_kwargs,
    image_cfg,
    register_variants,
    trunc_normal_init,
)
from .pvt import PyramidBase

__all__ = ["PolaPVTv2"]


class DepthwiseConvMlp(nn.Module):
    """fc1 -> 3×3 depthwise conv -> GELU -> fc2 on tokens (B, H·W, C): PVTv2's MLP (timm's
    ``MlpWithDepthwiseConv``)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.dwconv = nn.Conv2d(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        hidden = self.act(self.dwconv(tokens_to_map(self.fc1(x), height, width)))
        return self.fc2(hidden.flatten(2).transpose(1, 2))


class PolaPVTv2Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, num_tokens, drop_path, norm_layer, alpha, kernel_size,
                 attn_switches=None):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = PolaLinearAttention(dim, num_heads, qkv_bias=True, kernel_size=kernel_size, alpha=alpha,
                                        key_pos_tokens=num_tokens, **(attn_switches or {}))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = DepthwiseConvMlp(dim, int(dim * mlp_ratio))

    def forward(self, x, height: int, width: int):
        x = x + self.drop_path(self.attn(self.norm1(x), height, width))
        return x + self.drop_path(self.mlp(self.norm2(x), height, width))


class PolaPVTv2(PyramidBase):
    """PVTv2 with Pola linear attention.

    Args:
        drop_rate: dropout before the classifier (as timm's PVTv2 ``drop_rate``).
        device, dtype: where and in which dtype to build the parameters (timm's factory arguments).
        Others (the ablation switches included): as :class:`~polaformer.models.PolaPVT`.
    """

    @factory_kwargs
    def __init__(self, img_size=224, in_chans=3, num_classes=1000, embed_dims=(64, 128, 320, 512),
                 num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4), depths=(3, 4, 6, 3), drop_rate=0.0,
                 drop_path_rate=0.0, norm_layer=partial(nn.LayerNorm, eps=1e-6), alpha=4, kernel_size=5,
                 global_pool="avg", polarity=True, polarity_coefficients=True, local="dwc"):
        super().__init__()
        check_architecture(drop_path_rate, depths=list(depths), num_heads=list(num_heads), embed_dims=list(embed_dims),
                           in_chans=in_chans, img_size=img_size, num_classes=num_classes,
                           ratios={"mlp_ratios": mlp_ratios})
        check_global_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_stages = len(depths)
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.grad_checkpointing = False
        self.total_stride = 4 * 2 ** (self.num_stages - 1)
        dpr = [drop_path_rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
        cur = 0
        self.feature_info = []
        for i, depth in enumerate(depths):
            stride = 4 if i == 0 else 2
            embed = OverlapPatchEmbed(7 if i == 0 else 3, stride, in_chans if i == 0 else embed_dims[i - 1],
                                      embed_dims[i])
            grid = img_size // (4 * 2**i)
            setattr(self, f"patch_embed{i + 1}", embed)
            setattr(self, f"block{i + 1}", nn.ModuleList(
                PolaPVTv2Block(embed_dims[i], num_heads[i], mlp_ratios[i], grid * grid, dpr[cur + j], norm_layer,
                               alpha, kernel_size,
                               dict(polarity=polarity, polarity_coefficients=polarity_coefficients, local=local))
                for j in range(depth)
            ))
            setattr(self, f"norm{i + 1}", norm_layer(embed_dims[i]))
            cur += depth
            self.feature_info.append(dict(num_chs=embed_dims[i], reduction=4 * 2**i, module=f"norm{i + 1}"))
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        for m in self.modules():
            trunc_normal_init(m)

    def _stage_modules(self, i: int) -> tuple[str, ...]:
        return (f"patch_embed{i + 1}", f"block{i + 1}", f"norm{i + 1}")

    def _stage(self, i: int, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self, f"patch_embed{i + 1}")(x)  # NHWC
        b, height, width, c = x.shape
        x = x.reshape(b, height * width, c)
        for blk in getattr(self, f"block{i + 1}"):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, height, width, use_reentrant=False)
            else:
                x = blk(x, height, width)
        x = getattr(self, f"norm{i + 1}")(x)
        return tokens_to_map(x, height, width)


_WIDE = (64, 128, 320, 512)
_SIZES = {
    "pola_pvt_v2_b0": dict(embed_dims=(32, 64, 160, 256), depths=(2, 2, 2, 2)),
    "pola_pvt_v2_b1": dict(embed_dims=_WIDE, depths=(2, 2, 2, 2)),
    "pola_pvt_v2_b2": dict(embed_dims=_WIDE, depths=(3, 4, 6, 3)),
    "pola_pvt_v2_b3": dict(embed_dims=_WIDE, depths=(3, 4, 18, 3)),
    "pola_pvt_v2_b4": dict(embed_dims=_WIDE, depths=(3, 8, 27, 3)),
    "pola_pvt_v2_b5": dict(embed_dims=_WIDE, depths=(3, 6, 40, 3), mlp_ratios=(4, 4, 4, 4)),
}

default_cfgs = generate_default_cfgs({name: image_cfg(first_conv="patch_embed1.proj", license="apache-2.0")
                                      for name in _SIZES})


def _create(variant, pretrained=False, **kwargs) -> PolaPVTv2:
    return build_image_model(PolaPVTv2, variant, pretrained, **{**_SIZES[variant], **kwargs})


register_variants(__name__, _SIZES, _create)
