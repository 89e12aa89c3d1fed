"""Softmax attention inside local windows with a learned relative position bias (Swin's W-MSA).

This is the layer of the official Pola-Swin 'S' stages. Names follow the
official checkpoints: ``qkv``, ``proj``, ``relative_position_bias_table`` with
((2·Wh−1)·(2·Ww−1), heads) entries, and the int64 buffer
``relative_position_index`` (Wh·Ww, Wh·Ww) that picks, for every query/key
pair of a window, the table row of their offset.
"""
from __future__ import annotations

import torch
from timm.layers import to_2tuple, trunc_normal_
from torch import nn

from ..ops import window_softmax_attention

__all__ = ["WindowAttention", "relative_position_index"]


def relative_position_index(win_h: int, win_w: int) -> torch.Tensor:
    """(Wh·Ww, Wh·Ww) int64: row of the bias table for the offset between token i and token j.

    Tokens are raster-ordered in the window; the offset (dy, dx) = pos(i) − pos(j) is shifted
    to be non-negative and flattened row-major over a (2·Wh−1, 2·Ww−1) grid.
    """
    coords = torch.stack(torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij")).flatten(1)
    dy, dx = coords[:, :, None] - coords[:, None, :]
    return (dy + win_h - 1) * (2 * win_w - 1) + (dx + win_w - 1)


class WindowAttention(nn.Module):
    """Multi-head softmax attention over the tokens of each window, plus a relative position bias.

    Args:
        dim: channels of the input tokens.
        window_size: window side, or (height, width).
        num_heads: attention heads.
        qkv_bias: bias in the q/k/v projection.
        qk_scale: logit scale; ``head_dim ** -0.5`` when None (or 0, as in the official code).
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after the output projection.
    """

    def __init__(self, dim: int, window_size, num_heads: int, qkv_bias: bool = True, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.window_size = win_h, win_w = to_2tuple(window_size)
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * win_h - 1) * (2 * win_w - 1), num_heads))
        self.register_buffer("relative_position_index", relative_position_index(win_h, win_w))
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    def relative_position_bias(self) -> torch.Tensor:
        """(heads, N, N) additive logit bias for the N = Wh·Ww tokens of a window."""
        n = self.window_size[0] * self.window_size[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, self.num_heads).permute(2, 0, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: (windows·B, N, dim) with windows in batch-major order (all windows of image 0 first).

        ``mask``: optional (windows, N, N) additive logits (0 or a large negative value), the same
        for every image; it separates tokens that a cyclic shift or padding put in one window. Prefer
        -inf to a finite value such as the official -100 (rows must keep one finite entry): exp(-100) is a
        float32 denormal, which makes the products that read it many times slower on x86.
        """
        b_, n, c = x.shape
        if c != self.dim or n != self.window_size[0] * self.window_size[1]:
            raise ValueError(
                f"expected windows of shape (B, {self.window_size[0]}*{self.window_size[1]}, {self.dim}), "
                f"got {tuple(x.shape)}"
            )
        q, k, v = self.qkv(x).reshape(b_, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias().unsqueeze(0)
        if mask is not None:  # one mask per window position; the op broadcasts it over the images
            if b_ % mask.shape[0]:
                raise ValueError(f"{b_} windows are not a whole number of images of {mask.shape[0]} windows")
            bias = bias + mask.to(bias.dtype).unsqueeze(1)
        out = window_softmax_attention(q, k, v, bias.to(q.dtype), self.scale,
                                       dropout_p=self.attn_drop if self.training else 0.0)
        out = out.transpose(1, 2)
        if torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
            # SDPA's fused CPU kernel returns (B, N, H, d) memory, so the trace records a view here; the export's
            # decompositions give a (B, H, N, d)-contiguous output that cannot be viewed ("Cannot view a tensor
            # ...", ONNX export step 2/3). An explicit copy is recorded whatever the strides are.
            out = out.clone(memory_format=torch.contiguous_format)
        out = out.reshape(b_, n, c)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, window_size={self.window_size}, num_heads={self.num_heads}"
