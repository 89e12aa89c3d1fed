"""Fast polarity-aware linear attention, O(N·d²) in tokens.

Shapes: ``q`` (B, H, N, d), ``k`` (B, H, M, d), ``v`` (B, H, M, dv); the output
is (B, H, N, dv). ``v`` splits as ``torch.chunk(v, 2, -1)`` does in the official
code: the same-sign stream takes the first ``ceil(dv/2)`` channels, the
opposite-sign stream the rest. ``M`` may differ from ``N`` (spatial reduction of
keys, cross-attention).

Key padding. ``key_padding_mask`` (B, M) bool, True at padding (the convention
of ``nn.MultiheadAttention``): padded keys are zeroed in feature space, so they
take no part in ``φkᵀv`` nor in the key mean, and the mean divides by the number
of valid keys of each sequence. A padded batch therefore gives every sequence
exactly its unpadded output. A sequence whose keys are all padding attends to
nothing: its output is zero (and so are its gradients), never NaN.

How the two streams share work. With ``φq = [q⁺ᵖ; q⁻ᵖ]`` and ``φk = [k⁺ᵖ; k⁻ᵖ]``
the opposite-sign query ``[q⁻ᵖ; q⁺ᵖ]`` is ``φq`` with its halves swapped, and
``swap(φq)·X = φq·swap_rows(X)``. So a single ``S = φkᵀ·v / M`` (2d × dv) and a
single product ``φq·[S_same | swap_rows(S_opp) | km | swap(km)]`` give both
numerators and both normalisers; the swapped query copy never exists. The
backward pass is written out by hand so the power map costs one ``log`` and one
``exp`` per element (forward) and no transcendental work at all (backward).

The forms of the op, one module each in this folder: the Triton kernels (``triton.py``), the CPU forms with
the hand-written backward and the no-gradient ones (``autograd.py``), the torch formulation in the log domain
(``formulation.py``), packed sequences (``packed.py``) and the float64 reference (``naive.py``). Which one a call
takes is :func:`_path`, the one place the order is written.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...capture import capturing
from .._common import (
    check_broadcast,
    check_eps,
    check_float,
    check_key_padding_mask,
    check_layer_tensors,
    check_qkv,
    compute_dtype,
    full_precision,
    key_keep,
    local_and_gate,
    needs_grad,
)
from ..causal import causal_pola_linear_attention
from ..dispatch import triton_allowed
from ..feature_maps import check_power_values, learnable_power
from .autograd import PolaPowerAttention, native_forward, pola_attention_native, pola_attention_no_grad
from .formulation import may_overflow, pola_attention_graph
from .packed import check_packed, packed_attention, read_offsets

__all__ = ["linear_attention", "pola_layer_attention", "pola_linear_attention", "power_linear_attention"]


def _as_power(power, q: torch.Tensor) -> torch.Tensor:
    """``power`` as a tensor that broadcasts to (B, H, 1, d); a Python number is one exponent for every channel."""
    if isinstance(power, (int, float)) and not isinstance(power, bool):
        power = torch.full((), float(power), dtype=q.dtype, device=q.device)  # filled there: no upload
    check_float(power=power)
    target = (q.shape[0], q.shape[1], 1, q.shape[-1])
    if power.dim() > 4 or any(p not in (1, t) for p, t in zip(reversed(power.shape), reversed(target))):
        raise ValueError(f"power must broadcast to (B, H, 1, d) = {target}, got {tuple(power.shape)}")
    return power


def _path(q, k, v, power, key_padding_mask, *, packed: bool, graph: bool) -> str:
    """The path of a (non-causal) call: the first that applies. The one place the order is written."""
    if triton_allowed(q):
        return "triton"  # CUDA tensors, eager or compiled (a triton_op), and the interpreter: triton.py
    if packed:
        return "packed"  # padded into a batch, then one of the paths below: packed.py
    # Off the CPU the overflow bound would wait for the device: there the log domain always runs.
    if graph or q.device.type != "cpu" or may_overflow(q, k, v, power, compute_dtype(q, k, v, power)):
        return "formulation"  # the log domain, autograd derives the backward: formulation.py
    if needs_grad(q, k, v, power):
        return "autograd"  # the hand-written backward: autograd.py
    if key_padding_mask is None and native_forward(q, k, v, power) is not None:
        return "native"  # the whole forward in one native call
    return "no_grad"  # token blocks, each in cache


# The forms of an unpacked call outside the kernels, by path; each takes (q, k, v, power, eps, keep, count) in
# the compute dtype, except "native", which takes (q, k, v, power, eps) as given.
_FORMS = {
    "formulation": pola_attention_graph,
    "autograd": PolaPowerAttention.apply,
    "native": pola_attention_native,
    "no_grad": pola_attention_no_grad,
}


def pola_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """PolaFormer's polarity-aware linear attention with the learnable power map.

    Args:
        q: queries (B, H, N, d), already divided by the learnable scale.
        k: keys (B, H, M, d), same.
        v: values (B, H, M, dv): the first ``ceil(dv/2)`` channels feed the
            same-sign stream, the rest the opposite-sign stream (``torch.chunk``).
        power: exponents ``p ≥ 1`` broadcastable to (B, H, 1, d) (a tensor, or a
            number for all channels), e.g. from :func:`~polaformer.ops.learnable_power`.
        eps: added to each stream's normaliser.
        key_padding_mask: (B, M) bool, True for padded keys (see the module
            docstring); values there must be finite.
        cu_seqlens: packed variable-length batch (:mod:`polaformer.ops.varlen`):
            q, k, v are (1, H, T, ·) with sequences laid end to end, and these
            (S + 1,) int32/int64 offsets ``[0, n₀, n₀ + n₁, …, T]`` delimit the
            queries; each sequence attends only to its own keys. Excludes
            ``key_padding_mask``.
        cu_seqlens_k: the keys' (and values') offsets when they are packed
            differently from the queries (default: ``cu_seqlens``).
        causal: query ``t`` sees keys ``0..t`` only (N = M), the normaliser
            over that prefix: :func:`~polaformer.ops.causal_pola_linear_attention`.

    Returns:
        (B, H, N, dv) in ``v``'s dtype. Half-precision inputs and autocast
        regions are computed in float32, since ``|x|ᵖ`` and the products
        overflow float16 long before the output does.

    Numerics: the result is finite for any finite inputs whose output fits the
    dtype. A call whose ``|x|ᵖ`` products could overflow (a bound from max |q|,
    |k|, |v| and p) is computed in the log domain: key channels and query rows
    are shifted by their largest exponent, cancelling between numerator and
    normaliser (``eps`` shifted with them); see :func:`pola_attention_graph`.
    The Triton kernels always work that way, the shifts tracked inside them.

    Kernels: on CUDA tensors (``attention_backend()`` ``auto`` or ``triton``)
    the fused Triton kernels run (:mod:`polaformer.ops.pola.triton`), also
    inside ``torch.compile`` (as the op ``polaformer::pola_attention``), with
    no host synchronisation: there the exponent's ``p >= 1`` check and the
    offsets' value checks are skipped. The remaining syncs are on the CPU and
    torch paths only: the ``p >= 1`` check (CPU tensors) and the packed
    offsets' values (``varlen.check_cu_seqlens``) before padding them. Export,
    ONNX and FX tracing get the torch formulation.
    The eager paths with hand-written backward passes (CPU, Triton) are
    differentiable once: a second differentiation (a gradient penalty through
    ``create_graph=True``) raises one error line instead of returning
    gradients that ignore the inputs.
    """
    if causal:  # an op of its own (:mod:`polaformer.ops.causal`)
        return causal_pola_linear_attention(q, k, v, power, eps, key_padding_mask=key_padding_mask,
                                            cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k)
    check_qkv(q, k, v)
    check_eps(eps)
    graph = capturing()
    power = _as_power(power, q)
    packed = cu_seqlens is not None or cu_seqlens_k is not None
    if packed:
        cu_seqlens, cu_seqlens_k = check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k)
    elif key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)
    path = _path(q, k, v, power, key_padding_mask, packed=packed, graph=graph)
    if path == "triton":
        from . import triton

        check_power_values(power, graph)
        if packed and q.device.type == "cpu" and not graph:  # the interpreter: the check costs no device sync
            read_offsets(q, k, cu_seqlens, cu_seqlens_k)
        mask = None if key_padding_mask is None else key_padding_mask.to(q.device)
        return triton.pola_attention(q, k, v, power, eps, mask, cu_seqlens, cu_seqlens_k)
    if path == "packed":
        return packed_attention(lambda pq, pk, pv, padding: pola_linear_attention(
            pq, pk, pv, power, eps, key_padding_mask=padding), q, k, v, cu_seqlens, cu_seqlens_k)
    check_power_values(power, graph)
    attention = _FORMS[path]
    if path == "native":  # its inputs share one float dtype and autocast is off already
        return attention(q, k, v, power, eps)
    dtype = compute_dtype(q, k, v, power)
    keep, count = key_keep(key_padding_mask, k, dtype)
    with full_precision(q.device.type):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), power.to(dtype), eps, keep, count)
    return out.to(v.dtype)


def _check_alpha(alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


def _scaled_inputs(q, k, scale, power, alpha, key_positions, dtype=None):
    """The layer's arithmetic around the attention in torch: ``q / softplus(scale)``, ``(k + key_positions) /
    softplus(scale)`` and ``1 + alpha·sigmoid(power)``; the scale rounded to ``dtype`` first where given (so that
    half-precision q and k stay half)."""
    divisor = F.softplus(scale)
    if dtype is not None:
        divisor = divisor.to(dtype)
    if key_positions is not None:
        k = k + (key_positions if dtype is None else key_positions.to(dtype))
    return q / divisor, k / divisor, learnable_power(power, alpha)


def pola_layer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor,
    power: torch.Tensor,
    alpha: float = 4.0,
    key_positions: torch.Tensor | None = None,
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
    """PolaFormer's attention layer around its core, from the layer's raw parameters and projections::

        s = softplus(scale),   p = 1 + alpha·sigmoid(power)
        out = (pola_linear_attention(q / s, (k + key_positions) / s, v, p) + local) · gate

    Args:
        q, k, v: the projections split into heads, (B, H, N, d), (B, H, M, d), (B, H, M, dv), as the layer
            has them (any strides; half precision under autocast).
        scale, power: the raw scale and exponent weights, each broadcastable to (B, H, 1, d).
        alpha: the exponent's range, ``p ∈ (1, 1 + alpha)``.
        key_positions: added to the keys, broadcastable to (B, H, M, d), or None.
        eps, key_padding_mask, cu_seqlens, cu_seqlens_k: as :func:`pola_linear_attention` (no key positions
            with packed sequences).
        local: the local branch, (B, H, N', dv), added to the last ``N' ≤ N`` queries' outputs (the first
            ``N − N'``, e.g. a class token, get none), or None.
        gate: (B, H, N, dv) multiplying the output (the polarity coefficients), or None.
        causal: query ``t`` sees keys ``0..t`` (:func:`~polaformer.ops.causal_pola_linear_attention`, ``chunk_size``
            tokens per chunk).

    Returns:
        (B, H, N, dv) in ``v``'s dtype (over (B, N, H, dv) memory on the kernels).

    On the Triton kernels (CUDA) the whole function is one launch forward and one backward at the models'
    shapes: the softplus, the exponent and the positions in the kernels' prologue, their gradients from the
    per-channel sums the backward makes anyway, the local branch and the gate in the epilogue, and q, k, v read
    in their own dtype. Elsewhere (CPU, export) it is the same arithmetic in torch around
    :func:`pola_linear_attention`; the causal form applies the scale in torch too, in the kernels' input dtype.
    Reference: :func:`~polaformer.ops.naive_pola_layer_attention`.
    """
    check_qkv(q, k, v)
    check_eps(eps)
    _check_alpha(alpha)
    target = (q.shape[0], q.shape[1], 1, q.shape[-1])
    check_broadcast("scale", scale, target)
    check_broadcast("power", power, target)
    packed = cu_seqlens is not None or cu_seqlens_k is not None
    if key_positions is not None:
        check_broadcast("key_positions", key_positions, (*k.shape[:3], q.shape[-1]))
        if packed:
            raise ValueError("key_positions cannot be added to packed sequences (cu_seqlens): add them to k first")
    check_layer_tensors(q, v, local, gate, packed)
    # The layer's paths, the first that applies: the causal op (the scale applied here); the Triton kernels (the
    # whole layer in one launch each way); the torch arithmetic around pola_linear_attention (which takes _path).
    if causal:
        dtype = q.dtype if triton_allowed(q) else None  # the causal kernels take half-precision q and k
        q, k, power = _scaled_inputs(q, k, scale, power, alpha, key_positions, dtype)
        out = causal_pola_linear_attention(q, k, v, power, eps, chunk_size, key_padding_mask, cu_seqlens=cu_seqlens,
                                           cu_seqlens_k=cu_seqlens_k)
        return local_and_gate(out, local, gate)
    if packed:
        cu_seqlens, cu_seqlens_k = check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k)
    elif key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)
    if triton_allowed(q):
        from . import triton

        if packed and q.device.type == "cpu" and not capturing():  # the interpreter: the check costs no sync
            read_offsets(q, k, cu_seqlens, cu_seqlens_k)
        mask = None if key_padding_mask is None else key_padding_mask.to(q.device)
        return triton.pola_attention(q, k, v, power, eps, mask, cu_seqlens, cu_seqlens_k, alpha=alpha, scale=scale,
                                     key_positions=key_positions, local=local, gate=gate)
    q, k, power = _scaled_inputs(q, k, scale, power, alpha, key_positions)
    out = pola_linear_attention(q, k, v, power, eps, key_padding_mask, cu_seqlens=cu_seqlens,
                                cu_seqlens_k=cu_seqlens_k)
    return local_and_gate(out, local, gate)


def power_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PolaFormer's attention with its polarity split removed (paper Table 3, "Polarity" off).

    One stream, ``φ(x) = relu(x)ᵖ``: only the positive parts of q and k interact (the
    same-sign, non-negative ``q⁺k⁺`` term), over the whole value. Shapes, ``power`` and
    ``key_padding_mask`` as :func:`pola_linear_attention`; the output is (B, H, N, dv), computed
    in at least float32 as there. Reference: :func:`~polaformer.ops.naive_power_linear_attention`.
    """
    check_qkv(q, k, v, split_values=False)
    power = _as_power(power, q)
    check_power_values(power, capturing())
    dtype = compute_dtype(q, k, v, power)
    with full_precision(q.device.type):
        power = power.to(dtype)
        phi_q = torch.relu(q.to(dtype)) ** power
        phi_k = torch.relu(k.to(dtype)) ** power
        out = linear_attention(phi_q, phi_k, v.to(dtype), eps, key_padding_mask=key_padding_mask)
    return out.to(v.dtype)


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    eps: float = 1e-6,
    phi_q_num: torch.Tensor | None = None,
    phi_k_num: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean-normalised linear attention ``φq(φkᵀv/M) / (φq·mean φk + eps)`` on given features.

    ``phi_q_num``/``phi_k_num`` replace the features in the numerator only (used
    by RoPE variants). Used for the ELU+1, ReLU and focused baselines.
    ``key_padding_mask`` (B, M), True at padding, as in :func:`pola_linear_attention`.
    """
    check_float(phi_q=phi_q, phi_k=phi_k, v=v)
    num_q = phi_q if phi_q_num is None else phi_q_num
    num_k = phi_k if phi_k_num is None else phi_k_num
    keep, m = key_keep(key_padding_mask, phi_k, phi_k.dtype)
    if keep is not None:
        phi_k, num_k = phi_k * keep, num_k * keep
    kv = torch.matmul(num_k.transpose(-2, -1), v) / m
    k_mean = phi_k.sum(dim=-2, keepdim=True) / m
    denom = torch.matmul(phi_q, k_mean.transpose(-2, -1)) + eps
    return torch.matmul(num_q, kv) / denom
