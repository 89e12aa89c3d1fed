"""PolaFormer++'s PaCS attention as the token mixer of a diffusion transformer (PolaDiT).

Tokens (B, N, C) in raster order of a square grid, no RoPE (the DiT adds a fixed sin-cos table to its
tokens). Parameter names follow the official PolaDiT (``qkvg``, ``s1``, ``s2``, ``lepe``, ``proj``).
"""
from __future__ import annotations

import math

import torch

from .pacs_attention import PacsLinearAttention

__all__ = ["PacsGridAttention"]


class PacsGridAttention(PacsLinearAttention):
    """PaCS linear attention on the tokens of a square grid: the parameters of PolaFormer++'s
    :class:`.PacsLinearAttention`, applied to tokens and without RoPE.

    One projection gives ``q, k, v, g``; queries use ``exp(s·x) − 1`` with ``s = sigmoid(s1)``
    (same-sign stream) or ``sigmoid(s2)`` (opposite-sign stream), keys ``exp(x) − 1``; a 5×5
    depthwise conv on v over the grid (LePE) is added, then the raw linear gate ``g`` multiplies
    before the output projection.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"expected tokens of shape (B, N, {self.dim}), got {tuple(x.shape)}")
        b, n, c = x.shape
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"PacsGridAttention needs the tokens of a square grid, got {n} tokens")
        q, k, v, g = self.qkvg(x).reshape(b, n, 4, c).unbind(2)
        return self.proj(self.attend(q, k, v, g, side, side))
