"""Packed (variable-length) causal calls outside the Triton kernels: the arguments checked, then one sequence at a
time, each seeing only its own earlier tokens."""
from __future__ import annotations

import torch

from .. import varlen
from .._common import check_packed_batch


def check_packed(q, cu_seqlens, key_padding_mask, initial_state, return_state, read_values: bool) -> None:
    """A packed call's arguments; the offsets' values too with ``read_values`` (where reading costs no sync)."""
    if initial_state is not None or return_state:
        raise ValueError("packed sequences (cu_seqlens) carry no state: pass neither initial_state nor return_state")
    check_packed_batch(q, key_padding_mask)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of at least two sequence offsets")
    if read_values:
        varlen.check_cu_seqlens(cu_seqlens, q.shape[-2])


def packed_attention(attend, q, k, v, cu_seqlens, tables=()):
    """A packed call in torch, one sequence at a time (each sees only its own earlier tokens); ``tables`` are
    (T, ·) RoPE rows over the packed tokens, cut alike."""
    offsets = varlen.check_cu_seqlens(cu_seqlens, q.shape[-2])
    parts = [attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], *(t[a:b] for t in tables))
             for a, b in zip(offsets, offsets[1:]) if b > a]
    return torch.cat(parts, dim=2) if parts else v.new_zeros(v.shape)
