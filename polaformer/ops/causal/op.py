"""Causal polarity-aware linear attention: each query sees the keys up to its own position.

Definition (reference: :func:`polaformer.ops.naive_pola_linear_attention` and the PaCS one, ``causal=True``): the causal
masked form of the bidirectional op, with the mean over the prefix. Query ``t`` of a stream with features ``φq`` and
value channels ``v`` gives

    out_t = Σ_{i≤t} (φq_t·φk_i) v_i / n_t  /  (Σ_{i≤t} φq_t·φk_i / n_t + eps)

where ``n_t`` counts the valid keys up to ``t`` (at least 1), so ``eps`` weighs exactly as in the bidirectional
op. The same-sign stream takes ``φq`` and the first ``ceil(dv/2)`` value channels, the opposite-sign stream
the swapped query features and the rest; PaCS rotates the numerator's features with RoPE.

Two forms of that one function:

- chunked-parallel (training, :func:`causal_pola_linear_attention`, :func:`causal_pacs_linear_attention`): the
  tokens in chunks of ``chunk_size``; inside a chunk the masked products ``tril(φq φkᵀ) v``, across chunks a
  running state ``S = Σ φkᵀv`` and key sum, O(N·C·d + N·d²);
- recurrent (generation, :func:`causal_pola_step`, :func:`causal_pacs_step`): one token at a time, carrying
  :class:`CausalState` (``S`` per stream, the key sum and the count), O(d²) per token.

Both are computed in at least float32 with autocast off, in plain torch (``forms.py``; autograd derives the
gradients), except that where :func:`polaformer.ops.dispatch.triton_allowed` allows the Triton kernels (CUDA
tensors; also under torch.compile, where they are a registered op) the chunked form runs fused in them
(``triton.py``): features, key sums, normaliser and both streams, forward and backward, in a fixed number of
launches per call, packed batches included. That path reads no tensor value on the host: on CUDA the exponent's
``p >= 1`` check and the packed offsets' values are skipped (trusted), and ``cu_seqlens_k`` is compared with
``cu_seqlens`` by shape only; on CPU tensors (the interpreter) they are checked. It gives an initial state's kv
and key sum gradients but not its count (a state whose count requires grad takes the torch form), and is
once-differentiable (a second differentiation raises). Which form a call takes is :func:`_path`; packed sequences
outside the kernels are ``packed.py``'s, the float64 reference of the one-stream op ``naive.py``'s (the Pola and
PaCS references take ``causal=True``).
"""
from __future__ import annotations

import math

import torch

from ...capture import capturing
from .._common import (
    check_key_padding_mask,
    check_qkv,
    check_temperatures,
    compute_dtype,
    full_precision,
    key_keep,
    swap_halves,
)
from ..dispatch import triton_allowed
from ..feature_maps import check_power_values, pacs_key_features, pacs_query_features, power_feature
from ..rope import apply_rope
from .forms import CausalState, Stream, torch_form
from .packed import check_packed, packed_attention

__all__ = [
    "CausalState",
    "causal_linear_attention",
    "causal_pacs_linear_attention",
    "causal_pacs_step",
    "causal_pola_linear_attention",
    "causal_pola_step",
]


def _check_inputs(q, k, v, chunk_size=None):
    check_qkv(q, k, v, causal=True)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_state(state, q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> CausalState:
    """``state`` in ``dtype`` if it can continue these tokens' sequences: a :class:`CausalState` of two streams
    whose tensors are (B, H, 2d, dv − dv//2), (B, H, 2d, dv//2), (B, H, 2d) and (B, 1, 1) on ``q``'s device. A
    state of other sequences (another batch, other heads or sizes) or no state at all is one error naming it."""
    if not isinstance(state, CausalState):
        raise TypeError(f"state must be the CausalState a previous call returned (or None), got "
                        f"{type(state).__name__}")
    b, h, _, d = q.shape
    dv = v.shape[-1]
    kv = state.kv
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        count = f" of {len(kv)}" if isinstance(kv, (tuple, list)) else ""
        raise ValueError(f"state.kv must hold the two streams' tensors, got a {type(kv).__name__}{count}")
    parts = {"kv[0]": (kv[0], (b, h, 2 * d, dv - dv // 2)), "kv[1]": (kv[1], (b, h, 2 * d, dv // 2)),
             "key_sum": (state.key_sum, (b, h, 2 * d)), "count": (state.count, (b, 1, 1))}
    for name, (tensor, shape) in parts.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"state.{name} must be a floating-point tensor, got "
                            f"{tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"state.{name} is {tuple(tensor.shape)}, these tokens (batch {b}, {h} heads, head_dim "
                             f"{d}, value head_dim {dv}) continue from {shape}: pass the state of these sequences, "
                             f"or None to start new ones")
        if tensor.device != q.device:
            raise ValueError(f"state.{name} is on {tensor.device}, the tokens on {q.device}")
    return CausalState(tuple(t.to(dtype) for t in kv), state.key_sum.to(dtype), state.count.to(dtype))


def _host_checks(x: torch.Tensor) -> bool:
    """Whether checks that read tensor values run: eager calls on CPU tensors, where reading costs no device
    synchronisation. On CUDA the values are trusted, and graph capture cannot read them."""
    return x.device.type == "cpu" and not capturing()


def _path(q: torch.Tensor, *, recurrent: bool = False, packed: bool = False,
          state: CausalState | None = None) -> str:
    """The form of a call: the first that applies. The one place the order is written."""
    if recurrent:
        return "recurrent"  # one token at a time, in torch: forms.py
    # the kernels give an initial state's count no gradient: such a state takes the torch form
    if (state is None or not state.count.requires_grad) and triton_allowed(q):
        return "triton"  # the chunked form fused, CUDA tensors (eager or compiled) and the interpreter: triton.py
    if packed:
        return "packed"  # one sequence at a time, each in the chunked form: packed.py
    return "chunked"  # the chunked form in torch: forms.py


def _refuse_overflow(out: torch.Tensor, what: str, *inputs: torch.Tensor) -> None:
    """One line instead of a silent NaN where finite inputs overflowed the compute dtype. The bidirectional ops
    redo such calls in the log domain; the causal forms have no such redo (their state would have to carry the
    shifts), so they refuse. Eager CPU calls only: elsewhere the test would wait for the device."""
    if not _host_checks(out) or bool(out.isfinite().all()):
        return
    if all(bool(t.isfinite().all()) for t in inputs):
        raise FloatingPointError(f"causal {what} overflowed {str(out.dtype).removeprefix('torch.')}; the causal "
                                 f"forms have no log-domain fallback: scale q and k down or compute in float64")


def _kernel_state(state: CausalState | None):
    """A state as the kernels take it: (kv₀, kv₁, key sum, count), kv₁ None for one stream."""
    if state is None:
        return None
    kv = tuple(state.kv)
    return (kv[0], kv[1] if len(kv) > 1 else None, state.key_sum, state.count)


def _from_kernel(final, streams: int) -> CausalState:
    kv0, kv1, key_sum, count = final
    return CausalState((kv0, kv1)[:streams], key_sum, count)


def _pola_streams(q, k, v, power, eps):
    phi_q, phi_k = power_feature(q, power), power_feature(k, power)
    half = (v.shape[-1] + 1) // 2
    swapped = swap_halves(phi_q)
    return [Stream(phi_q, phi_q, v[..., :half], eps), Stream(swapped, swapped, v[..., half:], eps)], phi_k, phi_k


def _pola(q, k, v, power, eps, key_padding_mask, form, chunk_size=None, state=None, cu_seqlens=None):
    _check_inputs(q, k, v, chunk_size)
    dtype = compute_dtype(q, k, v, power if isinstance(power, torch.Tensor) else q)
    if state is not None:
        state = _check_state(state, q, v, dtype)
    path = _path(q, recurrent=form == "recurrent", state=state)
    if path == "triton":
        from . import triton

        if key_padding_mask is not None:
            check_key_padding_mask(key_padding_mask, k)
        if not isinstance(power, torch.Tensor):
            power = torch.full((), power, dtype=dtype, device=q.device)
        check_power_values(power, not _host_checks(power))
        out, final = triton.causal_attention("pola", q, k, v, (power, None), key_padding_mask=key_padding_mask,
                                             cu_seqlens=cu_seqlens, initial_state=_kernel_state(state), eps=eps,
                                             chunk_size=chunk_size)
        _refuse_overflow(out, "Pola attention (the power map's products)", q, k, v, power)
        return out, _from_kernel(final, 2)
    power = torch.as_tensor(power, dtype=dtype, device=q.device)
    check_power_values(power, not _host_checks(power))
    with full_precision(q.device.type):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        streams, phi_k, k_num = _pola_streams(q, k, v, power.to(dtype), eps)
        keep = key_keep(key_padding_mask, k, k.dtype)[0]
        outs, state = torch_form(path, streams, phi_k, k_num, keep, chunk_size, state)
        out = torch.cat(outs, dim=-1)
        _refuse_overflow(out, "Pola attention (the power map's products)", q, k, v, power)
    return out, state


def _check_tables(sin, cos, n, two_d):
    if (sin is None) != (cos is None):
        raise ValueError("pass both sin and cos, or neither")
    if sin is not None and (sin.shape != (n, two_d) or cos.shape != (n, two_d)):
        raise ValueError(f"RoPE tables must be (tokens, 2*head_dim) = ({n}, {two_d}); got sin{tuple(sin.shape)}, "
                         f"cos{tuple(cos.shape)}")


def _pacs_streams(q, k, v, temp_same, temp_opposite, sin, cos, eps):
    """PaCS features; each query row is divided by a power of two (and eps with it), which changes no
    value but keeps ``exp`` features from overflowing the products."""
    phi_k = pacs_key_features(k)
    rotate = (lambda x: apply_rope(x, sin, cos)) if sin is not None else (lambda x: x)
    half = v.shape[-1] // 2
    streams = []
    for phi_q, values in zip(pacs_query_features(q, temp_same, temp_opposite), (v[..., :half], v[..., half:])):
        scale = torch.exp2(torch.floor(torch.log2(phi_q.detach().amax(dim=-1, keepdim=True).clamp_min(1.0))))
        phi_q = phi_q / scale
        streams.append(Stream(phi_q, rotate(phi_q), values, eps / scale))
    return streams, phi_k, rotate(phi_k)


def _pacs(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, form, chunk_size=None, state=None,
          cu_seqlens=None):
    _check_inputs(q, k, v, chunk_size)
    if v.shape[-1] % 2:
        raise ValueError(f"value head_dim must be even for PaCS's two streams, got {v.shape[-1]}")
    check_temperatures(temp_same, temp_opposite, q.shape[-1])
    _check_tables(sin, cos, q.shape[-2], 2 * q.shape[-1])
    dtype = compute_dtype(q, k, v, temp_same, temp_opposite)
    if state is not None:
        state = _check_state(state, q, v, dtype)
    overflow = (f"PaCS attention (its exp features need |k| and |q|·temperature below about "
                f"{int(math.log(torch.finfo(dtype).max))})")
    path = _path(q, recurrent=form == "recurrent", state=state)
    if path == "triton":
        from . import triton

        if key_padding_mask is not None:
            check_key_padding_mask(key_padding_mask, k)
        out, final = triton.causal_attention("pacs", q, k, v, (temp_same, temp_opposite), (sin, cos),
                                             key_padding_mask, cu_seqlens, _kernel_state(state), eps, chunk_size)
        _refuse_overflow(out, overflow, q, k, v, temp_same, temp_opposite)
        return out, _from_kernel(final, 2)
    with full_precision(q.device.type):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if sin is not None:
            sin, cos = sin.to(dtype), cos.to(dtype)
        streams, phi_k, k_num = _pacs_streams(q, k, v, temp_same.to(dtype), temp_opposite.to(dtype), sin, cos, eps)
        keep = key_keep(key_padding_mask, k, k.dtype)[0]
        outs, state = torch_form(path, streams, phi_k, k_num, keep, chunk_size, state)
        out = torch.cat(outs, dim=-1)
        _refuse_overflow(out, overflow, q, k, v, temp_same, temp_opposite)
    return out, state


def causal_pola_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    power,
    eps: float = 1e-6,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    initial_state: CausalState | None = None,
    return_state: bool = False,
):
    """Causal :func:`~polaformer.ops.pola_linear_attention` in the chunked-parallel form.

    Args:
        q, k, v: (B, H, N, d), (B, H, N, d), (B, H, N, dv); query ``t`` sees keys ``0..t``.
        power: exponents ``p ≥ 1`` broadcastable to (B, H, 1, d), or a number.
        eps: added to each stream's normaliser (over the prefix mean, as in the bidirectional op).
        chunk_size: tokens per chunk (the results do not depend on it beyond rounding).
        key_padding_mask: (B, N) bool, True at padding: those keys count for no query.
        cu_seqlens: packed sequences (1, H, T, ·) with (S + 1,) offsets (:mod:`polaformer.ops.varlen`); excludes the
            mask.
        cu_seqlens_k: accepted only equal to ``cu_seqlens`` (keys are the queries' own tokens).
        initial_state: the state after earlier tokens (a prompt), as :func:`causal_pola_step` returns it.
        return_state: also return the :class:`CausalState` after the last token.

    Returns:
        (B, H, N, dv) in ``v``'s dtype (computed in at least float32), and the state if asked for.
    """
    if cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens and (
            cu_seqlens is None or cu_seqlens_k.shape != cu_seqlens.shape
            or (_host_checks(cu_seqlens_k) and not torch.equal(cu_seqlens_k, cu_seqlens))):
        raise ValueError("causal attention packs keys as its queries: pass cu_seqlens only")
    if cu_seqlens is not None:
        _check_inputs(q, k, v, chunk_size)
        check_packed(q, cu_seqlens, key_padding_mask, initial_state, return_state, _host_checks(cu_seqlens))
        if _path(q, packed=True) == "packed":
            return packed_attention(lambda *qkv: causal_pola_linear_attention(*qkv, power, eps, chunk_size), q, k, v,
                           cu_seqlens)
        cu_seqlens = cu_seqlens.to(q.device)
    out, state = _pola(q, k, v, power, eps, key_padding_mask, "chunked", chunk_size, initial_state, cu_seqlens)
    return (out.to(v.dtype), state) if return_state else out.to(v.dtype)


def causal_pola_step(q, k, v, power, state: CausalState | None = None, eps: float = 1e-6,
                     key_padding_mask: torch.Tensor | None = None):
    """The recurrent form of :func:`causal_pola_linear_attention`: tokens (B, H, T, ·) one after another
    (T = 1 when generating), starting from ``state`` (None: no earlier token). Returns ``(out, state)``."""
    out, state = _pola(q, k, v, power, eps, key_padding_mask, "recurrent", state=state)
    return out.to(v.dtype), state


def causal_pacs_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    temp_same: torch.Tensor,
    temp_opposite: torch.Tensor,
    sin: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    key_padding_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: CausalState | None = None,
    return_state: bool = False,
):
    """Causal :func:`~polaformer.ops.pacs_linear_attention` in the chunked-parallel form.

    ``sin``/``cos``: (N, 2d) RoPE tables of the tokens' positions (:func:`~polaformer.ops.rope_1d` for text),
    rotating the numerator only. With packed sequences (``cu_seqlens``) the tables are (T, 2d) over the packed
    tokens, each sequence's rows its own positions. Other arguments as :func:`causal_pola_linear_attention`.
    """
    if cu_seqlens is not None:
        _check_inputs(q, k, v, chunk_size)
        check_packed(q, cu_seqlens, key_padding_mask, initial_state, return_state, _host_checks(cu_seqlens))
        _check_tables(sin, cos, q.shape[-2], 2 * q.shape[-1])
        if _path(q, packed=True) == "packed":
            return packed_attention(lambda pq, pk, pv, *tables: causal_pacs_linear_attention(
                pq, pk, pv, temp_same, temp_opposite, *(tables or (None, None)), eps, chunk_size),
                q, k, v, cu_seqlens, () if sin is None else (sin, cos))
        cu_seqlens = cu_seqlens.to(q.device)
    out, state = _pacs(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, "chunked", chunk_size,
                       initial_state, cu_seqlens)
    return (out.to(v.dtype), state) if return_state else out.to(v.dtype)


def causal_pacs_step(q, k, v, temp_same, temp_opposite, sin=None, cos=None, state: CausalState | None = None,
                     eps: float = 1e-6, key_padding_mask: torch.Tensor | None = None):
    """The recurrent form of :func:`causal_pacs_linear_attention`; ``sin``/``cos`` are the (T, 2d) rows of these
    tokens' positions. Returns ``(out, state)``."""
    out, state = _pacs(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, "recurrent", state=state)
    return out.to(v.dtype), state


def causal_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6,
                            chunk_size: int = 64, *, initial_state: CausalState | None = None,
                            recurrent: bool = False):
    """Causal mean-normalised linear attention on given non-negative features (one stream, e.g. ELU+1):
    ``out_t = Σ_{i≤t} (φq_t·φk_i) v_i / (Σ_{i≤t} φq_t·φk_i + eps·(t+1))``. Returns ``(out, state)``; the
    recurrent form with ``recurrent=True``."""
    if phi_q.shape != phi_k.shape or phi_q.shape[:3] != v.shape[:3] or phi_q.dim() != 4:
        raise ValueError(f"phi_q and phi_k must be (B, H, N, F) alike and v (B, H, N, dv); got "
                         f"{tuple(phi_q.shape)}, {tuple(phi_k.shape)}, {tuple(v.shape)}")
    path = _path(phi_q, recurrent=recurrent, state=initial_state)
    if path == "triton":
        from . import triton

        out, final = triton.causal_attention("linear", phi_q, phi_k, v, initial_state=_kernel_state(initial_state),
                                             eps=eps, chunk_size=chunk_size)
        _refuse_overflow(out, "linear attention", phi_q, phi_k, v)
        return out, _from_kernel(final, 1)
    dtype = compute_dtype(phi_q, phi_k, v)
    with full_precision(phi_q.device.type):
        phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
        outs, state = torch_form(path, [Stream(phi_q, phi_q, v, eps)], phi_k, phi_k, None, chunk_size, initial_state)
        _refuse_overflow(outs[0], "linear attention", phi_q, phi_k, v)
    return outs[0].to(v.dtype), state
