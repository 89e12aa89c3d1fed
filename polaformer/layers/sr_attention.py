"""Softmax attention with spatially reduced keys/values (PVT's SRA), the baseline that Pola replaces.

Parameter names follow the official PVT code (``q``, ``kv``, ``proj``, ``sr``, ``norm``) so mixed
official models ('LSLS' attention types) load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import tokens_to_map

__all__ = ["SpatialReductionAttention"]


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
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, n, c = x.shape
        if n != height * width or c != self.dim:
            raise ValueError(f"expected tokens (B, {height}*{width}, {self.dim}), got {tuple(x.shape)}")
        heads = self.num_heads
        q = self.q(x).reshape(b, n, heads, -1).transpose(1, 2)
        if self.sr_ratio > 1:
            if height < self.sr_ratio or width < self.sr_ratio:  # else the strided conv floors, as the official one
                raise ValueError(
                    f"token grid {height}x{width} is smaller than the spatial reduction ratio {self.sr_ratio}"
                )
            x = self.norm(self.sr(tokens_to_map(x, height, width)).flatten(2).transpose(1, 2))
        k, v = self.kv(x).reshape(b, -1, 2, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))
