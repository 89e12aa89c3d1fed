"""Packed variable-length batches, as FlashAttention and flash-linear-attention take them.

A packed batch lays its sequences end to end on the token axis: ``q`` (1, H, T, d) with ``cu_seqlens``
(S + 1,) integer offsets ``[0, n₀, n₀ + n₁, …, T]``; sequence ``s`` is tokens ``cu_seqlens[s]:cu_seqlens[s+1]``
and attends only to its own keys. The torch formulation pads the sequences into a (S, H, L, ·) batch with a
key padding mask, runs the padded op (which gives every sequence exactly its unpadded output) and packs the
result again; the Triton kernels read the offsets directly.
"""
from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens", "check_offsets", "pack", "padded_call", "unpack"]


def check_offsets(cu_seqlens, name: str = "cu_seqlens") -> None:
    """What can be checked of offsets without reading their values (no host sync): type, shape, dtype."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
        torch.int32, torch.int64
    ):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor of sequence offsets")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} needs at least two offsets (one sequence), got {cu_seqlens.numel()}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate offsets for ``total`` packed tokens and return them as Python ints (one host sync)."""
    check_offsets(cu_seqlens, name)
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed token count {total}; "
                         f"got {offsets[0]}…{offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    return offsets


def unpack(x: torch.Tensor, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (1, H, T, c) → padded (S, H, L, c) with L the longest sequence, and the (S, L) bool mask that
    is True at padding (zeros are written there)."""
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"packed tensors must be (1, heads, tokens, dim), got {tuple(x.shape)}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    longest = max(max(lengths), 1)
    padded = x.new_zeros(len(lengths), x.shape[1], longest, x.shape[-1])
    padding = torch.ones(len(lengths), longest, dtype=torch.bool, device=x.device)
    for s, (start, n) in enumerate(zip(offsets, lengths)):
        padded[s, :, :n] = x[0, :, start:start + n]
        padding[s, :n] = False
    return padded, padding


def pack(padded: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Inverse of :func:`unpack`: (S, H, L, c) → (1, H, T, c), dropping the padding rows."""
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    return torch.cat([padded[s, :, :n] for s, n in enumerate(lengths)], dim=1).unsqueeze(0)


def padded_call(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int],
                key_offsets: list[int]) -> torch.Tensor:
    """The torch formulation of a packed call: ``attend(q, k, v, key_padding_mask)`` on the sequences padded
    into a batch, its output packed again."""
    padded_q, _ = unpack(q, offsets)
    padded_k, padding = unpack(k, key_offsets)
    padded_v, _ = unpack(v, key_offsets)
    return pack(attend(padded_q, padded_k, padded_v, padding), offsets)
