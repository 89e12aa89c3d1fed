"""2-D rotary position embedding (the RoPE of PolaFormer++), as pure functions.

Channels are rotated in adjacent pairs ``(2i, 2i+1)``. The first half of the
channels carries the row index, the second half the column index, each with
the frequencies ``base^-linspace(0, 1, head_dim/4)`` (every frequency used by
one pair).
"""
from __future__ import annotations

import torch

from ..capture import capturing, exporting
from .dispatch import cpu_kernels

__all__ = ["rope_angles", "rope_1d", "rope_2d", "apply_rope", "apply_rope_export", "rotate_pairs", "turn_rows"]


def rope_angles(embed_dim: int, num_heads: int, base: float = 10000.0, dtype=torch.float32,
                allow_partial: bool = False) -> torch.Tensor:
    """Per-channel angle table of length ``embed_dim // num_heads // 2`` (each frequency twice).

    A per-head width not divisible by 4 is an error, unless ``allow_partial``: then the table the
    official ``RoPE`` module builds anyway (``2·(per_head // 4)`` angles, too short to rotate a
    head) is returned, for modules that hold it without using it.
    """
    per_head = embed_dim // num_heads
    if per_head % 4 and not allow_partial:
        raise ValueError(f"RoPE needs a per-head width divisible by 4, got {per_head} (= {embed_dim} / {num_heads})")
    freqs = 1.0 / (base ** torch.linspace(0, 1, per_head // 4, dtype=dtype))
    return freqs.repeat_interleave(2)


def rope_2d(angle: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin, cos)`` tables of shape (height·width, 2·len(angle)), rows in raster order."""
    rows = torch.arange(height, device=angle.device, dtype=angle.dtype)[:, None] * angle
    cols = torch.arange(width, device=angle.device, dtype=angle.dtype)[:, None] * angle
    phase = torch.cat(
        [rows[:, None, :].expand(height, width, -1), cols[None, :, :].expand(height, width, -1)], dim=-1
    ).reshape(height * width, -1)
    return torch.sin(phase), torch.cos(phase)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x`` (…, N, D) by the angles behind ``sin``/``cos`` (N, D)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([-odd, even], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _pair_turn(like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``(a, b) @ t = (-b, a)``: :func:`apply_rope`'s turn of one channel pair, as a matrix."""
    return torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=like.dtype, device=like.device)


def apply_rope_export(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the pair rotation ``(a, b) -> (-b, a)`` as a product with a constant 2×2 matrix, for
    export: onnxruntime copies the strided slices and the interleaving stack of :func:`apply_rope` element by
    element, and runs this product as one GEMM. The same values for finite ``x`` (each output of the product is one
    input times ±1 plus a zero)."""
    rotated = torch.matmul(x.unflatten(-1, (-1, 2)), _pair_turn(x)).flatten(-2)
    return x * cos + rotated * sin


def turn_rows(m: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``T @ m`` for the (…, D, c) matrix ``m``, where ``x @ T`` turns each channel pair of a row ``x`` as
    :func:`apply_rope` does, ``(a, b) -> (-b, a)``; ``Tᵀ @ m`` with ``transpose``. What the export forms use to turn
    a small state instead of every token's features."""
    turn = _pair_turn(m)
    return torch.matmul(turn.t() if transpose else turn, m.unflatten(-2, (-1, 2))).flatten(-3, -2)


class _RotatePairs(torch.autograd.Function):
    """:func:`apply_rope` in one native pass, and its backward (the transposed rotation) in another."""

    @staticmethod
    def forward(ctx, x, sin, cos, kernels):
        ctx.save_for_backward(sin, cos)
        ctx.kernels = kernels
        return kernels.rope_pairs(x, sin, cos, False)

    @staticmethod
    def backward(ctx, grad):
        sin, cos = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return ctx.kernels.rope_pairs(grad, sin, cos, True), None, None, None


def rotate_pairs(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for (B, H, N, d) ``x``, the same values up to rounding: on the CPU one native pass over
    ``x`` forward and one backward, instead of a stack, a negation and three elementwise passes (and their
    backward); the result is contiguous there. Elsewhere (graph capture, autocast, other devices or dtypes,
    tables that take gradients) it is :func:`apply_rope`."""
    if capturing():  # the plain formulation; under FX the sizes are proxies
        return apply_rope_export(x, sin, cos) if exporting() else apply_rope(x, sin, cos)
    if (x.dim() == 4 and x.stride(-1) == 1
            and x.shape[-1] % 2 == 0 and sin.dtype == cos.dtype == x.dtype and sin.shape == cos.shape == x.shape[-2:]
            and sin.is_contiguous() and cos.is_contiguous() and not (sin.requires_grad or cos.requires_grad)
            and not torch.is_autocast_enabled("cpu")):
        kernels = cpu_kernels(x)
        if kernels is not None:
            return _RotatePairs.apply(x, sin, cos, kernels)
    return apply_rope(x, sin, cos)


def rope_1d(angle: torch.Tensor, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin, cos)`` tables (length, len(angle)) for token positions ``start … start + length − 1`` of a
    sequence: every channel pair turns by its angle times the position (text, causal models)."""
    if not capturing() and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise ValueError(f"length must be an integer >= 0 (a number of tokens), got {length!r}")
    phase = torch.arange(start, start + length, device=angle.device, dtype=angle.dtype)[:, None] * angle
    return torch.sin(phase), torch.cos(phase)
