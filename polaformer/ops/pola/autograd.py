"""Pola attention's eager CPU forms: the hand-written autograd function (one ``log`` and one ``exp`` per element
forward, no transcendental work backward), the forward without gradients by blocks of tokens, and the whole
no-gradient forward in one native call. Each elementwise stage calls the native kernels
(:func:`polaformer.ops.dispatch.cpu_kernels`) where they are built, its torch-op version otherwise."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .. import _common
from .._common import block_tokens, sum_to, swap_halves
from ..dispatch import cpu_kernels
from .formulation import same_sign_width


def native_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor):
    """The native kernels when the whole no-gradient forward can run in one native call: CPU inputs of one
    float dtype with unit stride along the channels, and no autocast (which would recast the products)."""
    if not (q.dtype == k.dtype == v.dtype == power.dtype and q.stride(-1) == 1 and k.stride(-1) == 1):
        return None
    if torch.is_autocast_enabled("cpu"):
        return None
    return cpu_kernels(q)


def pola_attention_native(q, k, v, power, eps):
    """The whole forward without gradients or key padding in one native call (see :func:`native_forward`)."""
    return cpu_kernels(q).pola_forward_no_grad(q, k, v, power, eps, _common.BLOCK_ELEMENTS, _common.MIN_BLOCK_TOKENS)


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


def pola_attention_no_grad(q, k, v, power, eps, keep, m):
    """:class:`PolaPowerAttention`'s forward for a call that needs no gradient, by blocks of tokens.

    Nothing full-size but the output is written (no features, no ``log|x|`` kept for a backward), and
    each block's elementwise passes run in cache, which pays from a few thousand tokens up. The key
    sums are accumulated block by block, equal to the one-block sums up to rounding.
    """
    n, d = q.shape[-2:]
    half = same_sign_width(v)
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


class PolaPowerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, power, eps, keep, m):
        # keep: (B, 1, M, 1) 0/1 key factor or None; m: valid keys, a number or (B, 1, 1, 1).
        half = same_sign_width(v)
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
        half = same_sign_width(v)

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
