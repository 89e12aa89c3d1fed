"""Softmax attention with spatially reduced keys/values (PVT's SRA), the baseline that Pola replaces.

Parameter names follow the official PVT code (``q``, ``kv``, ``proj``, ``sr``, ``norm``) so mixed
official models ('LSLS' attention types) load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import tokens_to_map

__all__ = ["SpatialReductionAttention", "add_spatial_reduction", "spatially_reduced"]


def add_spatial_reduction(module: nn.Module, dim: int, sr_ratio: int) -> None:
    """PVT's reduction of the keys/values, set on the attention ``module`` under the official names: ``sr``, a
    strided ``sr_ratio``×``sr_ratio`` conv, and ``norm``, a LayerNorm (neither at ratio 1)."""
    if sr_ratio > 1:
        module.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
        module.norm = nn.LayerNorm(dim)


def spatially_reduced(module: nn.Module, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H·W, C) tokens through ``module``'s ``sr`` and ``norm``: (B, ⌊H/r⌋·⌊W/r⌋, C) at its ``sr_ratio`` r,
    ``x`` itself at ratio 1. A grid smaller than r is refused; a larger one that r does not divide is floored
    by the strided conv, as in the official code."""
    ratio = module.sr_ratio
    if ratio <= 1:
        return x
    if height < ratio or width < ratio:
        raise ValueError(f"token grid {height}x{width} is smaller than the spatial reduction ratio {ratio}")
    return module.norm(module.sr(tokens_to_map(x, height, width)).flatten(2).transpose(1, 2))


class SpatialReductionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, *, qkv_bias: bool = False, qk_scale: float | None = None,
                 proj_drop: float = 0.0, sr_ratio: int = 1):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.sr_ratio = sr_ratio
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        add_spatial_reduction(self, dim, sr_ratio)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, n, c = x.shape
        if n != height * width or c != self.dim:
            raise ValueError(f"expected tokens (B, {height}*{width}, {self.dim}), got {tuple(x.shape)}")
        heads = self.num_heads
        q = self.q(x).reshape(b, n, heads, -1).transpose(1, 2)
        x = spatially_reduced(self, x, height, width)
        k, v = self.kv(x).reshape(b, -1, 2, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))
