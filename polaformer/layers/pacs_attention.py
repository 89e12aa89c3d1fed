"""PolaFormer++ attention layers, on channels-first feature maps (B, C, H, W).

Parameter names follow the official PolaFormer++ code (``qkvg``, ``s1``,
``s2``, ``lepe``, ``proj``; ``qkvo`` for the softmax layer; ``angle`` for RoPE)
so its checkpoints load unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import (
    pacs_layer_attention,
    rope_2d,
    rope_angles,
    rotate_pairs,
    tokens_to_map,
    window_softmax_attention,
)

__all__ = ["RoPE2d", "PacsLinearAttention", "RopeSoftmaxAttention"]


class RoPE2d(nn.Module):
    """Holds the RoPE frequency buffer ``angle`` and makes ``(sin, cos)`` for a grid.

    As the official module, it is built for any per-head width (a stage holds a table for each
    block type even if it has no block of that type); making tables needs a multiple of 4.

    Tables are kept per grid size while ``angle`` is unchanged (its version counter is checked), and
    returned as the same tensors each time: the PaCS kernel then rearranges them once, not per call.
    They never require grad and are made outside inference mode, so one set serves both modes.
    """

    def __init__(self, embed_dim: int, num_heads: int, base: float = 10000.0):
        super().__init__()
        self.head_width = embed_dim // num_heads
        self.register_buffer("angle", rope_angles(embed_dim, num_heads, base, allow_partial=True))
        self._tables: dict = {}

    def forward(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.head_width % 4:
            raise ValueError(f"RoPE needs a per-head width divisible by 4, got {self.head_width}")
        angle = self.angle
        if torch.compiler.is_compiling() or angle.is_inference() or angle.requires_grad:
            return rope_2d(angle, height, width)
        key = (height, width, angle.device, angle.dtype)
        # a dict lookup, not a comparison: under FX tracing the sizes are proxies, which hash but cannot compare
        version, tables = self._tables.get(key, (None, None))
        if version != angle._version:
            with torch.inference_mode(False):
                tables = rope_2d(angle, height, width)
            self._tables = {key: (angle._version, tables)}  # one grid kept: a model sees one size at a time
        return tables


def _check_map(x: torch.Tensor, dim: int, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[1] != dim:
        raise ValueError(f"expected a feature map of shape (B, {dim}, H, W), got {tuple(x.shape)}")
    if sin.shape[0] != x.shape[2] * x.shape[3]:
        raise ValueError(f"RoPE tables cover {sin.shape[0]} positions, the map has {x.shape[2]}x{x.shape[3]}")


class _GatedMapAttention(nn.Module):
    """What PolaFormer++'s attention blocks share around their attention: one projection of a map's
    (B, H·W, C) tokens into four streams (``q, k, v`` and the gate), and the output
    ``proj((out + lepe(v)) · gate)``."""

    def _streams(self, x: torch.Tensor, sin: torch.Tensor, projection: nn.Linear):
        """The four (B, H·W, C) streams of ``projection`` on the tokens of the (B, C, H, W) map ``x``."""
        _check_map(x, self.dim, sin)
        b, c, h, w = x.shape
        return projection(x.flatten(2).transpose(1, 2)).reshape(b, h * w, 4, c).unbind(2)

    def local_branch(self, v: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``lepe(v)`` of (B, H·W, C) value tokens, as (B, H·W, C) tokens."""
        return self.lepe(tokens_to_map(v, height, width)).flatten(2).transpose(1, 2)

    def local_branch_and_gate(self, out: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, height: int,
                              width: int) -> torch.Tensor:
        return (out + self.local_branch(v, height, width)) * gate

    def _output_map(self, out: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """(B, H·W, C) tokens of ``(attention + lepe(v)) · gate`` -> ``proj`` of them as a (B, C, H, W) map."""
        return tokens_to_map(self.proj(out), height, width)


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


class PacsLinearAttention(_GatedMapAttention):
    """Polarity-aware linear attention with channel-wise spikiness (PaCS).

    ``q, k, v, g`` come from one projection; queries use ``exp(s·x) − 1`` with a
    learnable temperature ``s = sigmoid(s1)`` (same-sign stream) or
    ``sigmoid(s2)`` (opposite-sign stream), keys ``exp(x) − 1``. RoPE over
    ``2·head_dim`` rotates the numerator only. A 5×5 depthwise conv on v (LePE)
    is added before the gate.
    """

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"dim {dim} must split into {num_heads} heads of even width")
        self.dim = dim
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkvg = nn.Linear(dim, 4 * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)
        self.proj = nn.Linear(dim, dim)
        self.s1 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * head_dim))
        self.s2 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * head_dim))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sin: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, local: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
        """``(attention + local) · gate`` of (B, H·W, C) projections as (B, H·W, C) tokens, either term None: the
        temperatures' weights, the local branch and the gate all handed to the attention op, which fuses them
        where it can (:func:`~polaformer.ops.pacs_layer_attention`)."""
        heads = lambda t: None if t is None else _split_heads(t, self.num_heads)  # noqa: E731
        out = pacs_layer_attention(heads(q), heads(k), heads(v), self.s1, self.s2, sin, cos, local=heads(local),
                                   gate=heads(gate))
        return out.transpose(1, 2).reshape(q.shape)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, height: int, width: int,
               sin: torch.Tensor | None = None, cos: torch.Tensor | None = None) -> torch.Tensor:
        """``(attention + lepe(v)) · g`` of the (B, H·W, C) projections of a height × width grid."""
        return self.attention(q, k, v, sin, cos, self.local_branch(v, height, width), g)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        """``x``: (B, C, H, W); ``sin``/``cos``: (H·W, 2·head_dim) from ``RoPE2d(2·dim, heads)``."""
        q, k, v, g = self._streams(x, sin, self.qkvg)
        return self._output_map(self.attend(q, k, v, g, x.shape[2], x.shape[3], sin, cos), x.shape[2], x.shape[3])


class RopeSoftmaxAttention(_GatedMapAttention):
    """Softmax attention with 2-D RoPE on q and k, LePE and an output gate (PolaFormer++'s 'v' blocks)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.qkvo = nn.Linear(dim, 4 * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        """``x``: (B, C, H, W); ``sin``/``cos``: (H·W, head_dim) from ``RoPE2d(dim, heads)``."""
        q, k, v, o = self._streams(x, sin, self.qkvo)
        heads = self.num_heads
        q = rotate_pairs(_split_heads(q, heads), sin, cos)
        k = rotate_pairs(_split_heads(k, heads), sin, cos)
        out = window_softmax_attention(q, k, _split_heads(v, heads))
        out = out.transpose(1, 2).reshape(x.shape[0], -1, self.dim)
        return self._output_map(self.local_branch_and_gate(out, v, o, x.shape[2], x.shape[3]), x.shape[2],
                                x.shape[3])
