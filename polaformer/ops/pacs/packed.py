"""Packed (variable-length) PaCS calls outside the Triton kernels: the arguments checked, then the sequences
padded into a batch with a key padding mask, or, with RoPE tables, one call per sequence."""
from __future__ import annotations

import torch

from ...capture import capturing
from ..varlen import check_cu_seqlens, padded_call


def check_packed(q, k, cu_seqlens, cu_seqlens_k, rope: bool) -> None:
    """Arguments of a packed batch. The offsets' values are read (a host sync) only where they are on the CPU;
    the torch formulation reads them anyway (:func:`packed_attention`)."""
    if q.shape[0] != 1:
        raise ValueError(f"packed q, k, v must be (1, heads, tokens, head_dim), got q{tuple(q.shape)}")
    if rope and cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens:
        raise ValueError("with RoPE tables the keys must be packed like the queries: leave cu_seqlens_k None")
    for name, offsets, total in (("cu_seqlens", cu_seqlens, q.shape[-2]),
                                 ("cu_seqlens_k", cu_seqlens_k, k.shape[-2])):
        if offsets is None:
            offsets = cu_seqlens
        if isinstance(offsets, torch.Tensor) and (offsets.device.type != "cpu" or capturing()):
            if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.numel() < 2:
                raise ValueError(f"{name} must be a 1-D int32/int64 tensor of at least two sequence offsets")
        else:
            check_cu_seqlens(offsets, total, name)
    if cu_seqlens_k is not None and cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_k must hold as many sequences as cu_seqlens: "
                         f"{cu_seqlens_k.numel() - 1} vs {cu_seqlens.numel() - 1}")


def packed_attention(attend, q, k, v, sin, cos, cu_seqlens, cu_seqlens_k):
    """A packed batch as the op on padded or cut sequences: ``attend(q, k, v, key_padding_mask, sin, cos)``.
    Without RoPE tables the sequences are padded into a batch with a key padding mask (each gets exactly its own
    output); with them (one row per packed token), one call per sequence."""
    offsets = check_cu_seqlens(cu_seqlens, q.shape[-2])
    if sin is not None:
        parts = [attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, sin[a:b], cos[a:b])
                 for a, b in zip(offsets, offsets[1:]) if b > a]
        return torch.cat(parts, dim=2) if parts else v.new_empty(*q.shape[:-1], v.shape[-1])
    offsets_k = offsets if cu_seqlens_k is None else check_cu_seqlens(cu_seqlens_k, k.shape[-2], "cu_seqlens_k")
    return padded_call(lambda pq, pk, pv, padding: attend(pq, pk, pv, padding, None, None), q, k, v, offsets,
                       offsets_k)
