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

On the CPU the elementwise stages (feature maps, their backward, the normalisation) call the native
kernels (:func:`.dispatch.cpu_kernels`) when they are built, and the torch-op versions here otherwise; a power-map
forward without gradients or key padding runs whole in one native call (``pola_forward_no_grad``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _common, varlen
from ._common import (
    block_tokens,
    check_broadcast,
    check_eps,
    check_float,
    check_key_padding_mask,
    check_layer_tensors,
    check_packed_batch,
    check_qkv,
    compute_dtype,
    full_precision,
    key_keep,
    local_and_gate,
    needs_grad,
    sum_to,
    swap_halves,
)
from .causal import causal_pola_linear_attention
from .dispatch import capturing, cpu_kernels, triton_kernels
from .feature_maps import check_power_values, learnable_power

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


def _native_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor):
    """The native kernels when the whole no-gradient forward can run in one native call: CPU inputs of one
    float dtype with unit stride along the channels, and no autocast (which would recast the products)."""
    if not (q.dtype == k.dtype == v.dtype == power.dtype and q.stride(-1) == 1 and k.stride(-1) == 1):
        return None
    if torch.is_autocast_enabled("cpu"):
        return None
    return cpu_kernels(q)


def _pola_attention_native(q, k, v, power, eps):
    """The whole forward without gradients or key padding in one native call (see :func:`_native_forward`)."""
    return cpu_kernels(q).pola_forward_no_grad(q, k, v, power, eps, _common.BLOCK_ELEMENTS, _common.MIN_BLOCK_TOKENS)


def _check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k):
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


def _read_offsets(q, k, cu_seqlens, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """The queries' and the keys' offsets, checked against the token counts (a host sync)."""
    return (varlen.check_cu_seqlens(cu_seqlens, q.shape[-2]),
            varlen.check_cu_seqlens(cu_seqlens_k, k.shape[-2], "cu_seqlens_k"))


def _packed_attention(q, k, v, power, eps, cu_seqlens, cu_seqlens_k):
    """The torch formulation of a packed call: the padded op with its key mask (:func:`.varlen.padded_call`)."""

    def attend(pq, pk, pv, padding):
        return pola_linear_attention(pq, pk, pv, power, eps, key_padding_mask=padding)

    return varlen.padded_call(attend, q, k, v, *_read_offsets(q, k, cu_seqlens, cu_seqlens_k))


def _same_sign_width(v: torch.Tensor) -> int:
    """Value channels of the same-sign stream: the first chunk of ``torch.chunk(v, 2, -1)``."""
    return (v.shape[-1] + 1) // 2


def _power_features(x: torch.Tensor, power: torch.Tensor, keep_log: bool = True):
    """``[x⁺ᵖ ; x⁻ᵖ]`` with one log and one exp per element.

    ``s = sign(x)·|x|ᵖ`` carries both halves: ``x⁺ᵖ = relu(s)``, ``x⁻ᵖ = relu(s) − s``. The
    transcendental passes run on dense d-wide buffers and only the last two write the strided halves
    of the features: a pass over a half-row view is slower, worst for ``exp``.
    Returns the 2d-wide features and ``log|x|`` (kept for the exponent's gradient; None unless
    ``keep_log``). On the CPU the fused kernel does all of it in one pass.
    """
    native = cpu_kernels(x)
    if native is not None and x.stride(-1) == 1:
        feat, log_abs = native.power_features(x, power, keep_log)
        return feat, (log_abs if keep_log else None)
    d = x.shape[-1]
    log_abs = x.abs().log_()
    s = torch.mul(log_abs, power).exp_().copysign_(x)
    feat = x.new_empty(*x.shape[:-1], 2 * d)
    pos = torch.clamp(s, min=0, out=feat[..., :d])
    torch.sub(pos, s, out=feat[..., d:])
    return feat, (log_abs if keep_log else None)


def _power_backward(x, feat, log_abs, grad_feat, power, need_power_grad):
    """Chain rule through ``feat = [x⁺ᵖ ; x⁻ᵖ]``: returns (grad_x, grad_power).

    With ``s = sign(x)|x|ᵖ``: ``dL/ds · s = Σ_halves grad_feat ⊙ feat``, and
    ``ds/dx = p·s/x``, ``ds/dp = s·log|x|``; no transcendental function is needed.
    ``grad_power`` broadcasts to ``power``'s shape (per element here, summed over the tokens by the
    fused kernel). ``grad_feat`` is a temporary of ours and is overwritten.
    """
    native = cpu_kernels(x)
    if native is not None and x.stride(-1) == 1 and grad_feat.stride(-1) == 1:
        grad_x, grad_p = native.power_backward(x, feat, log_abs, grad_feat, power, need_power_grad)
        return grad_x, (grad_p if need_power_grad else None)
    d = x.shape[-1]
    grad_s_times_s = grad_feat[..., :d].mul_(feat[..., :d]).addcmul_(grad_feat[..., d:], feat[..., d:])
    grad_p = None
    if need_power_grad:
        # At x = 0 the product is 0·(-inf); the true derivative there is 0.
        grad_p = torch.mul(grad_s_times_s, log_abs, out=grad_feat[..., d:]).nan_to_num_(nan=0.0)
    # p·s/x is 0/0 at x = 0, where the derivative is 0 because p > 1.
    grad_x = torch.mul(grad_s_times_s, power).div_(x).nan_to_num_(nan=0.0)
    return grad_x, grad_p


def _pola_attention_graph(q, k, v, power, eps, keep, m):
    """The same math as :class:`_PolaPowerAttention`, written functionally (autograd derives the backward) for
    graph capture, devices without the kernels, and eager calls whose plain products could overflow
    (:func:`_may_overflow`). It works in the log domain, ``|x|ᵖ = e^(p·ln|x|)``: each key channel is shifted
    by ``s``, its largest ``p·ln|k|`` over the sequence, and each query row by ``c``, its largest
    ``p·ln|q| + s`` (at least 0). Products and ``eps`` are then all ``e^-c`` times the plain ones, so the
    ratio is unchanged, and no exponent is positive. The shifts are constants for autograd.
    """
    d = q.shape[-1]
    half = _same_sign_width(v)
    zero, one = q.new_zeros(()), q.new_ones(())

    def log_magnitude(x):  # p·ln|x| where x ≠ 0 (elsewhere the feature is 0 and its gradient too)
        nonzero = x != 0
        return torch.log(torch.where(nonzero, x.abs(), one)) * power, nonzero

    def halves(x, magnitude):
        return torch.cat([torch.where(x > 0, magnitude, zero), torch.where(x < 0, magnitude, zero)], dim=-1)

    log_k, k_used = log_magnitude(k)
    if keep is not None:
        k_used = k_used & (keep != 0)
    lowest = torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)  # no upload from the host
    shift = torch.where(k_used, log_k.detach(), lowest).amax(dim=-2, keepdim=True)  # (B, H, 1, d)
    # exponents of unused entries are 0 before exp, so that no inf meets a zero gradient (padded keys may be large)
    phi_k = halves(k, torch.where(k_used, torch.exp(torch.where(k_used, log_k - shift, zero)), zero))
    log_q, q_used = log_magnitude(q)
    row_shift = torch.where(q_used, log_q.detach() + shift, zero).amax(dim=-1, keepdim=True)  # (B, H, N, 1)
    # q = 0 lands in neither half; elsewhere the exponent is ≤ 0 exactly, rounded as the maximum was
    phi_q = halves(q, torch.exp(torch.where(q_used, log_q + shift - row_shift, zero)))

    kv = torch.matmul(phi_k.transpose(-2, -1), v) / m  # (B, H, 2d, dv)
    k_mean = phi_k.sum(dim=-2).unsqueeze(-1) / m  # (B, H, 2d, 1)
    swap = lambda t: torch.cat([t[..., d:, :], t[..., :d, :]], dim=-2)
    rhs = torch.cat([kv[..., :half], swap(kv[..., half:]), k_mean, swap(k_mean)], dim=-1)
    res = torch.matmul(phi_q, rhs)
    eps_rows = eps * torch.exp(-row_shift)
    return torch.cat([res[..., :half] / (res[..., -2:-1] + eps_rows), res[..., half:-2] / (res[..., -1:] + eps_rows)],
                     dim=-1)


def _may_overflow(q, k, v, power, dtype) -> bool:
    """Whether the plain power-map products could leave ``dtype``'s range: each term is at most
    ``max(1, |q|)ᵖ·max(1, |k|)ᵖ·max(1, |v|)``, summed over M keys and 2d channels (reads q, k and v once)."""
    def bits(t):
        if not t.numel():
            return 0.0
        low, high = torch.aminmax(t.detach())
        return math.log2(max(1.0, -float(low), float(high)))

    p = float(power.detach().amax())
    total = p * (bits(q) + bits(k)) + bits(v) + math.log2(max(1, k.shape[-2]) * 2 * q.shape[-1])
    return total >= math.log2(torch.finfo(dtype).max) - 2


def _stream_rhs(kv: torch.Tensor, k_sum: torch.Tensor, m, half: int) -> torch.Tensor:
    """``[S_same | swap_rows(S_opp) | km | swap(km)]``, the one right-hand side of both streams, from
    ``kv = φkᵀv`` (B, H, 2d, dv) and ``k_sum = Σφk`` (B, H, 2d), both divided by ``m`` here (``kv`` and
    ``k_sum`` may be overwritten)."""
    native = cpu_kernels(kv)
    if native is not None and not isinstance(m, torch.Tensor):
        return native.stream_rhs(kv, k_sum, float(m), half)
    kv, k_mean = kv.div_(m), k_sum.unsqueeze(-1).div_(m)
    return torch.cat([kv[..., :half], swap_halves(kv[..., half:], -2), k_mean, swap_halves(k_mean, -2)], dim=-1)


def _stream_rhs_backward(grad_rhs: torch.Tensor, m, half: int):
    """The gradients of ``kv`` and ``k_sum`` (B, H, 2d) from that of :func:`_stream_rhs`'s output."""
    native = cpu_kernels(grad_rhs)
    if native is not None and not isinstance(m, torch.Tensor):
        return native.stream_rhs_backward(grad_rhs, float(m), half)
    dv = grad_rhs.shape[-1] - 2
    grad_kv = torch.cat([grad_rhs[..., :half], swap_halves(grad_rhs[..., half:dv], -2)], dim=-1).div_(m)
    grad_k_sum = (grad_rhs[..., -2:-1] + swap_halves(grad_rhs[..., -1:], -2)).div_(m).squeeze(-1)
    return grad_kv, grad_k_sum


def _token_major_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, H, N, dv) view of (B, N, H, dv) memory, so that merging the heads afterwards is a view."""
    return v.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)


def _normalise(res: torch.Tensor, eps: float, half: int, out: torch.Tensor) -> torch.Tensor:
    """Both streams' numerators (``res[..., :-2]``) over their normalisers into ``out``; returns the normalisers."""
    native = cpu_kernels(res)
    if native is not None and out.stride(-1) == 1 and res.is_contiguous():
        return native.normalise(res, eps, half, out)
    denom = res[..., -2:].add_(eps)
    torch.div(res[..., :half], denom[..., :1], out=out[..., :half])
    torch.div(res[..., half:-2], denom[..., 1:], out=out[..., half:])
    return denom


def _output_grad(grad_out: torch.Tensor, denom: torch.Tensor, out: torch.Tensor, half: int) -> torch.Tensor:
    """Gradient at the products' output ``[numerators | normalisers]``: ``dO / z`` and ``-Σ (dO / z)·O`` per stream."""
    native = cpu_kernels(out)
    if native is not None and out.stride(-1) == 1 and denom.stride(-1) == 1:
        return native.output_grad(grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous(), denom, out, half)
    dv_ = out.shape[-1]
    g = out.new_empty(*out.shape[:-1], dv_ + 2)
    g_num = g[..., :-2]
    torch.div(grad_out[..., :half], denom[..., :1], out=g_num[..., :half])
    torch.div(grad_out[..., half:], denom[..., 1:], out=g_num[..., half:])
    prod = g_num * out
    torch.sum(prod[..., :half], dim=-1, keepdim=True, out=g[..., -2:-1])
    torch.sum(prod[..., half:], dim=-1, keepdim=True, out=g[..., -1:])
    g[..., -2:].neg_()
    return g


def _pola_attention_no_grad(q, k, v, power, eps, keep, m):
    """:class:`_PolaPowerAttention`'s forward for a call that needs no gradient, by blocks of tokens.

    Nothing full-size but the output is written (no features, no ``log|x|`` kept for a backward), and
    each block's elementwise passes run in cache, which pays from a few thousand tokens up. The key
    sums are accumulated block by block, equal to the one-block sums up to rounding.
    """
    n, d = q.shape[-2:]
    half = _same_sign_width(v)
    step = block_tokens(k, d)
    kv = k_sum = None
    for i in range(0, k.shape[-2], step):
        phi_k, _ = _power_features(k[:, :, i:i + step], power, keep_log=False)
        if keep is not None:
            phi_k.mul_(keep[:, :, i:i + step])
        part_kv, part_sum = torch.matmul(phi_k.transpose(-2, -1), v[:, :, i:i + step]), phi_k.sum(dim=-2)
        if kv is None:
            kv, k_sum = part_kv, part_sum
        else:
            kv.add_(part_kv)
            k_sum.add_(part_sum)
    rhs = _stream_rhs(kv, k_sum, m, half)
    out = _token_major_output(q, v)
    step = block_tokens(q, d)
    for i in range(0, n, step):
        phi_q, _ = _power_features(q[:, :, i:i + step], power, keep_log=False)
        _normalise(torch.matmul(phi_q, rhs), eps, half, out[:, :, i:i + step])
    return out


def _formulation(q, k, v, power, key_padding_mask, graph: bool, dtype: torch.dtype):
    """The formulation of an unpacked call that the Triton kernels do not take: the first that applies."""
    # Off the CPU the overflow bound would wait for the device: there the log domain always runs.
    if graph or q.device.type != "cpu" or _may_overflow(q, k, v, power, dtype):
        return _pola_attention_graph  # the log domain; autograd derives the backward
    if needs_grad(q, k, v, power):
        return _PolaPowerAttention.apply  # the hand-written backward
    if key_padding_mask is None and _native_forward(q, k, v, power) is not None:
        return _pola_attention_native  # one native call, the whole forward
    return _pola_attention_no_grad  # token blocks, each in cache


class _PolaPowerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, power, eps, keep, m):
        # keep: (B, 1, M, 1) 0/1 key factor or None; m: valid keys, a number or (B, 1, 1, 1).
        half = _same_sign_width(v)
        phi_k, log_k = _power_features(k, power)
        if keep is not None:
            # Zero features drop padded keys from kᵀv and the mean, and (as the backward
            # multiplies by them) from every gradient too.
            phi_k.mul_(keep)

        # One kᵀv product for both streams, plus the key mean.
        rhs = _stream_rhs(torch.matmul(phi_k.transpose(-2, -1), v), phi_k.sum(dim=-2), m, half)
        out = _token_major_output(q, v)
        phi_q, log_q = _power_features(q, power)
        denom = _normalise(torch.matmul(phi_q, rhs), eps, half, out)

        ctx.m = m if keep is None else None
        ctx.save_for_backward(q, k, v, power, phi_q, phi_k, log_q, log_k, rhs, denom, out,
                              *(() if keep is None else (m,)))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, power, phi_q, phi_k, log_q, log_k, rhs, denom, out, *count = ctx.saved_tensors
        m = count[0] if count else ctx.m
        half = _same_sign_width(v)

        # d(numerator) = dO / z, d(z) = -Σ dO·O / z per stream.
        g = _output_grad(grad_out, denom, out, half)

        grad_phi_q = torch.matmul(g, rhs.transpose(-2, -1))  # (B, H, N, 2d)
        grad_rhs = torch.matmul(phi_q.transpose(-2, -1), g)  # (B, H, 2d, dv + 2)
        grad_kv, grad_k_mean = _stream_rhs_backward(grad_rhs, m, half)

        grad_v = grad_power = None
        if ctx.needs_input_grad[2]:
            grad_v = torch.matmul(phi_k, grad_kv)
        # Padded rows of grad_phi_k need no masking: _power_backward multiplies by phi_k, zero there.
        grad_phi_k = torch.matmul(v, grad_kv.transpose(-2, -1)).add_(grad_k_mean.unsqueeze(-2))

        need_power_grad = ctx.needs_input_grad[3]
        grad_q, grad_p_q = _power_backward(q, phi_q, log_q, grad_phi_q, power, need_power_grad)
        grad_k, grad_p_k = _power_backward(k, phi_k, log_k, grad_phi_k, power, need_power_grad)
        if ctx.needs_input_grad[3]:
            grad_power = sum_to(grad_p_q, power.shape) + sum_to(grad_p_k, power.shape)
        return (
            grad_q if ctx.needs_input_grad[0] else None,
            grad_k if ctx.needs_input_grad[1] else None,
            grad_v,
            grad_power,
            None,
            None,
            None,
        )


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
    normaliser (``eps`` shifted with them); see :func:`_pola_attention_graph`.
    The Triton kernels always work that way, the shifts tracked inside them.

    Kernels: on CUDA tensors (``attention_backend()`` ``auto`` or ``triton``)
    the fused Triton kernels run (:mod:`polaformer.backends.triton.pola`), also
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
    if causal:  # an op of its own (:mod:`.causal`)
        return causal_pola_linear_attention(q, k, v, power, eps, key_padding_mask=key_padding_mask,
                                            cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k)
    check_qkv(q, k, v)
    check_eps(eps)
    graph = capturing()
    power = _as_power(power, q)
    packed = cu_seqlens is not None or cu_seqlens_k is not None
    if packed:
        cu_seqlens, cu_seqlens_k = _check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k)
    elif key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)
    kernels = triton_kernels(q)
    if kernels is not None:  # CUDA tensors, eager or compiled, and the interpreter: the fused Triton kernels
        check_power_values(power, graph)
        if packed and q.device.type == "cpu" and not graph:  # the interpreter: the check costs no device sync
            _read_offsets(q, k, cu_seqlens, cu_seqlens_k)
        mask = None if key_padding_mask is None else key_padding_mask.to(q.device)
        return kernels.pola_attention(q, k, v, power, eps, mask, cu_seqlens, cu_seqlens_k)
    if packed:  # padded into a batch, then one of the formulations below
        return _packed_attention(q, k, v, power, eps, cu_seqlens, cu_seqlens_k)
    check_power_values(power, graph)
    dtype = compute_dtype(q, k, v, power)
    attention = _formulation(q, k, v, power, key_padding_mask, graph, dtype)
    if attention is _pola_attention_native:  # its inputs share one float dtype and autocast is off already
        return attention(q, k, v, power, eps)
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
    if causal:
        kernels = triton_kernels(q)
        dtype = q.dtype if kernels is not None else None  # the causal kernels take half-precision q and k
        q, k, power = _scaled_inputs(q, k, scale, power, alpha, key_positions, dtype)
        out = causal_pola_linear_attention(q, k, v, power, eps, chunk_size, key_padding_mask, cu_seqlens=cu_seqlens,
                                           cu_seqlens_k=cu_seqlens_k)
        return local_and_gate(out, local, gate)
    if packed:
        cu_seqlens, cu_seqlens_k = _check_packed(q, k, key_padding_mask, cu_seqlens, cu_seqlens_k)
    elif key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)
    kernels = triton_kernels(q)
    if kernels is not None:
        if packed and q.device.type == "cpu" and not capturing():  # the interpreter: the check costs no sync
            _read_offsets(q, k, cu_seqlens, cu_seqlens_k)
        mask = None if key_padding_mask is None else key_padding_mask.to(q.device)
        return kernels.pola_attention(q, k, v, power, eps, mask, cu_seqlens, cu_seqlens_k, alpha=alpha, scale=scale,
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
