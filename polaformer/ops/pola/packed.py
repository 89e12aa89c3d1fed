"""Packed (variable-length) Pola calls outside the Triton kernels: the offsets checked, then the sequences padded
into a batch with a key padding mask (:func:`polaformer.ops.varlen.padded_call`), each getting exactly its own
output."""
from __future__ import annotations

from .. import varlen
from .._common import check_packed_batch


def check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k):
    """Shape checks of a packed call that need no device sync; returns the offsets on ``q``'s device
    ``(cu_seqlens, cu_seqlens_k)``, the second defaulting to the first."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (the query offsets)")
    check_packed_batch(q, key_padding_mask)
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    varlen.check_offsets(cu_seqlens)
    varlen.check_offsets(cu_seqlens_k, "cu_seqlens_k")
    if cu_seqlens.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens and cu_seqlens_k must describe as many sequences; got "
                         f"{cu_seqlens.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    return cu_seqlens.to(q.device), cu_seqlens_k.to(q.device)


def read_offsets(q, k, cu_seqlens, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """The queries' and the keys' offsets, checked against the token counts (a host sync)."""
    return (varlen.check_cu_seqlens(cu_seqlens, q.shape[-2]),
            varlen.check_cu_seqlens(cu_seqlens_k, k.shape[-2], "cu_seqlens_k"))


def packed_attention(attend, q, k, v, cu_seqlens, cu_seqlens_k):
    """A packed call padded into a batch, ``attend(q, k, v, key_padding_mask)`` the op on it."""
    return varlen.padded_call(attend, q, k, v, *read_offsets(q, k, cu_seqlens, cu_seqlens_k))
