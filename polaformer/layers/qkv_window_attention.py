"""Window softmax attention on projections made by the caller (MambaIRv2's ``win_mhsa``).

Unlike :class:`~polaformer.layers.window_attention.WindowAttention`, the q/k/v projection lives in the
enclosing block (the official ``wqkv``, applied to the whole map before the shift and the window split) and
the relative position index is one buffer of the model, handed in on each call. The layer holds only the
bias table and the output projection, under the official names.
"""
from __future__ import annotations

import torch
from timm.layers import trunc_normal_
from torch import nn

from ..ops import window_softmax_attention

__all__ = ["QKVWindowAttention"]


class QKVWindowAttention(nn.Module):
    """``proj(softmax(q kᵀ / √d + bias + mask) v)`` over windows of precomputed ``q, k, v``.

    Args:
        dim: channels of q, k, v and of the output.
        window_size: window side (square windows).
        num_heads: attention heads.
    """

    def __init__(self, dim: int, window_size: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        self.proj = nn.Linear(dim, dim)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, qkv: torch.Tensor, relative_index: torch.Tensor, mask: torch.Tensor | None = None):
        """``qkv``: (images·windows, N, 3·dim) in batch-major window order; ``relative_index``: (N, N) rows of
        the bias table; ``mask``: optional (windows, N, N) additive logits shared by the images."""
        b_, n, c3 = qkv.shape
        if c3 != 3 * self.dim or n != self.window_size ** 2:
            raise ValueError(f"expected windows of shape (B, {self.window_size}*{self.window_size}, {3 * self.dim}), "
                             f"got {tuple(qkv.shape)}")
        q, k, v = qkv.reshape(b_, n, 3, self.num_heads, self.dim // self.num_heads).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias_table[relative_index.reshape(-1)]
        bias = bias.view(n, n, self.num_heads).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            if b_ % mask.shape[0]:
                raise ValueError(f"{b_} windows are not a whole number of images of {mask.shape[0]} windows")
            bias = bias + mask.to(bias.dtype).unsqueeze(1)
        out = window_softmax_attention(q, k, v, bias.to(q.dtype))
        return self.proj(out.transpose(1, 2).reshape(b_, n, self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, window_size={self.window_size}, num_heads={self.num_heads}"
