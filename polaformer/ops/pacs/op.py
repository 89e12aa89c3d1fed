"""PolaFormer++'s PaCS attention, O(N·d²) in tokens: the channel-wise exponential feature map with one temperature
per stream, RoPE on the numerator only (:func:`pacs_linear_attention`; reference: :mod:`.naive`).

The forms of the op, one module each in this folder: the Triton kernels (``triton.py``), the CPU forms (one
fused native call, or stage by stage with a hand-written backward; ``autograd.py``), the torch formulation in the
log domain (``formulation.py``), packed sequences (``packed.py``) and the float64 reference (``naive.py``). It
shares the power-map op's conventions (input checks, key padding, the compute dtype, token blocks). Which form a
call takes is :func:`_path`, the one place the order is written.
"""
from __future__ import annotations

import torch

from ...capture import capturing, exporting
from .._common import (
    check_eps,
    check_float,
    check_key_padding_mask,
    check_layer_tensors,
    check_qkv,
    check_temperatures,
    compute_dtype,
    full_precision,
    key_keep,
    local_and_gate,
    needs_grad,
)
from ..causal import causal_pacs_linear_attention
from ..dispatch import triton_allowed
from ..feature_maps import pacs_temperature
from .autograd import PacsAttention, pacs_attention_no_grad
from .formulation import pacs_attention_export, pacs_attention_graph
from .packed import check_packed, packed_attention

__all__ = ["pacs_layer_attention", "pacs_linear_attention"]


def _check_call(q, k, sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k) -> None:
    """The arguments of a non-causal call besides q, k, v and the temperatures."""
    check_eps(eps)
    two_d = 2 * q.shape[-1]
    if (sin is None) != (cos is None):
        raise ValueError("pass both sin and cos, or neither")
    if sin is not None and (sin.shape[-2:] != (q.shape[-2], two_d) or q.shape[-2] != k.shape[-2]):
        raise ValueError(
            f"RoPE tables must be (N, 2*head_dim) = ({q.shape[-2]}, {two_d}) with as many keys as queries; "
            f"got {tuple(sin.shape)} for q{tuple(q.shape)}, k{tuple(k.shape)}"
        )
    if cu_seqlens is None and cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (the queries' offsets)")
    if cu_seqlens is not None:
        if key_padding_mask is not None:
            raise ValueError("pass key_padding_mask or cu_seqlens, not both: packed sequences carry their lengths")
        check_packed(q, k, cu_seqlens, cu_seqlens_k, sin is not None)
    if key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)


def _path(q, k, v, temp_same, temp_opposite, sin, *, packed: bool) -> str:
    """The path of a (non-causal) call: the first that applies. The one place the order is written."""
    pairs = sin is None or q.shape[-1] % 2 == 0  # the kernels' RoPE rotates channel pairs inside each half
    if pairs and triton_allowed(q):
        return "triton"  # CUDA tensors, eager or compiled (a triton_op), and the interpreter: triton.py
    if packed:
        return "packed"  # padded into a batch (or cut, with RoPE), then one of the paths below: packed.py
    graph = capturing()
    if graph and pairs and exporting():
        return "export"  # the log domain in the operators other runtimes run fastest: formulation.py
    # Off the CPU a finiteness test would wait for the device: there the log domain always runs.
    if graph or not pairs or q.device.type != "cpu":
        return "formulation"  # the log domain, autograd derives the backward: formulation.py
    if needs_grad(q, k, v, temp_same, temp_opposite):
        return "autograd"  # the hand-written backward (one fused native call each way where built): autograd.py
    return "no_grad"  # one fused native call where built, else query blocks, each in cache: autograd.py


# The forms of an unpacked call outside the kernels, by path. The fast ones mark an overflow with NaN, and the
# call is then redone in the log domain (pacs_linear_attention).
_FORMS = {"formulation": pacs_attention_graph, "export": pacs_attention_export, "autograd": PacsAttention.apply,
          "no_grad": pacs_attention_no_grad}


def _on_device(q, *tensors):
    """The mask and offsets on the queries' device (None stays None)."""
    return tuple(None if t is None else t.to(q.device) for t in tensors)


def pacs_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    temp_same: torch.Tensor,
    temp_opposite: torch.Tensor,
    sin: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """PolaFormer++'s attention with the PaCS map; RoPE (if given) rotates the numerator only.

    Args:
        q, k, v: as in :func:`pola_linear_attention`; here ``M`` must equal ``N``
            when RoPE tables are given.
        temp_same, temp_opposite: channel-wise temperatures ``sigmoid(w)``,
            broadcastable to (B, H, 1, 2d).
        sin, cos: (N, 2d) tables from :func:`~polaformer.ops.rope_2d`, or None;
            for a packed batch one row per packed token, (T, 2d).
        key_padding_mask: (B, M) bool, True for padded keys, as in
            :func:`pola_linear_attention`.
        cu_seqlens: packed variable-length batch (:mod:`polaformer.ops.varlen`): q, k, v are
            (1, H, T, ·) and sequence ``s`` is tokens ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens_k: the keys' offsets when they are packed differently from
            the queries (default ``cu_seqlens``; not with RoPE tables).
        causal: query ``t`` sees keys ``0..t`` only:
            :func:`~polaformer.ops.causal_pacs_linear_attention`.

    Both streams share one ``φkᵀv`` product. Numerics: without RoPE the result
    is finite for any finite q, k (up to float32's largest value). Where the
    plain ``exp`` features or their products overflow, the call is computed in
    the log domain instead: keys and query rows are shifted by their largest
    exponent, the shifts cancelling between numerator and denominator (``eps``
    shifted with them); see :func:`pacs_attention_graph`. With RoPE the
    numerator pairs channels that the denominator does not, so the output
    itself grows like ``e^|x|``; it is finite where it fits the dtype. The
    Triton kernels (CUDA) always work in the log domain, the shifts tracked
    inside them. The causal form is not shifted.

    Host synchronisations: none on the Triton path (CUDA) with offsets on the
    device, whose values are then trusted; offsets on the CPU are checked. The
    torch formulation of a packed batch reads the offsets (one sync). Under
    ``torch.compile`` the kernels run as the op ``polaformer::pacs_attention``.
    The eager kernel paths are differentiable once (a second differentiation
    raises), as :func:`pola_linear_attention`'s.
    """
    if causal:
        if cu_seqlens_k is not None:
            raise ValueError("causal attention packs keys with the queries: pass cu_seqlens only")
        return causal_pacs_linear_attention(q, k, v, temp_same, temp_opposite, sin, cos, eps,
                                            key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
    check_qkv(q, k, v, even_head_dim=True)
    check_float(temp_same=temp_same, temp_opposite=temp_opposite)
    check_temperatures(temp_same, temp_opposite, q.shape[-1])
    _check_call(q, k, sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
    path = _path(q, k, v, temp_same, temp_opposite, sin, packed=cu_seqlens is not None)
    if path == "triton":
        from . import triton

        return triton.pacs_attention(q, k, v, temp_same, temp_opposite, sin, cos, eps,
                                     *_on_device(q, key_padding_mask, cu_seqlens, cu_seqlens_k))
    if path == "packed":
        return packed_attention(lambda pq, pk, pv, padding, psin, pcos: pacs_linear_attention(
            pq, pk, pv, temp_same, temp_opposite, psin, pcos, eps, padding), q, k, v, sin, cos, cu_seqlens,
            cu_seqlens_k)
    dtype = compute_dtype(q, k, v, temp_same, temp_opposite)
    keep, m = key_keep(key_padding_mask, k, dtype)
    out_dtype = v.dtype
    attention = _FORMS[path]
    if sin is not None:
        sin, cos = sin.to(dtype), cos.to(dtype)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), temp_same.to(dtype), temp_opposite.to(dtype), sin, cos, eps,
            keep, m)
    with full_precision(q.device.type):
        out = attention(*args)
        # the sum is finite only if every entry is; a fast path that overflowed is redone in the log domain
        if path in ("autograd", "no_grad") and not bool(torch.isfinite(out.sum())):
            out = pacs_attention_graph(*args)
    return out.to(out_dtype)


def pacs_layer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    same: torch.Tensor,
    opposite: torch.Tensor,
    sin: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    *,
    local: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    causal: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """PolaFormer++'s attention layer around its core, from the layer's raw temperature weights::

        out = (pacs_linear_attention(q, k, v, sigmoid(same), sigmoid(opposite), sin, cos) + local) · gate

    ``same``, ``opposite``: the raw weights (``s1``, ``s2``), broadcastable to (B, H, 1, 2d); ``local``
    (B, H, N', dv) is added to the last ``N' ≤ N`` queries' outputs and ``gate`` (B, H, N, dv) multiplies them,
    each where given; the other arguments as :func:`pacs_linear_attention` (``causal``: its causal form, in
    chunks of ``chunk_size`` tokens). On the Triton kernels (CUDA) the sigmoids run in the kernels' prologue
    (their gradients from the per-channel sums the backward makes anyway) and the local branch and the gate in
    the epilogue: one launch forward and one backward at the models' shapes. Elsewhere the same arithmetic in
    torch. Reference: :func:`~polaformer.ops.naive_pacs_layer_attention`.
    """
    packed = cu_seqlens is not None or cu_seqlens_k is not None
    check_qkv(q, k, v, even_head_dim=True)
    check_float(same=same, opposite=opposite)
    check_temperatures(same, opposite, q.shape[-1])
    check_layer_tensors(q, v, local, gate, packed)
    # The layer's paths, the first that applies: the causal op, or the torch arithmetic around
    # pacs_linear_attention (which takes _path) unless the Triton kernels run the whole layer in one launch.
    on_kernels = not causal and (sin is None or q.shape[-1] % 2 == 0) and triton_allowed(q)
    if not on_kernels:
        out = pacs_linear_attention(q, k, v, pacs_temperature(same), pacs_temperature(opposite), sin, cos, eps,
                                    key_padding_mask, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, causal=causal)
        return local_and_gate(out, local, gate)
    _check_call(q, k, sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
    from . import triton

    return triton.pacs_attention(q, k, v, same, opposite, sin, cos, eps,
                                 *_on_device(q, key_padding_mask, cu_seqlens, cu_seqlens_k), raw=True, local=local,
                                 gate=gate)
