"""Pola attention's torch formulation: functional, in the log domain, autograd deriving the backward. What graph
capture (export, ONNX, FX, the CPU under torch.compile), devices without kernels and eager calls whose plain
products could overflow run."""
from __future__ import annotations

import math

import torch


def same_sign_width(v: torch.Tensor) -> int:
    """Value channels of the same-sign stream: the first chunk of ``torch.chunk(v, 2, -1)``."""
    return (v.shape[-1] + 1) // 2


def pola_attention_graph(q, k, v, power, eps, keep, m):
    """The same math as :class:`PolaPowerAttention`, written functionally (autograd derives the backward) for
    graph capture, devices without the kernels, and eager calls whose plain products could overflow
    (:func:`may_overflow`). It works in the log domain, ``|x|ᵖ = e^(p·ln|x|)``: each key channel is shifted
    by ``s``, its largest ``p·ln|k|`` over the sequence, and each query row by ``c``, its largest
    ``p·ln|q| + s`` (at least 0). Products and ``eps`` are then all ``e^-c`` times the plain ones, so the
    ratio is unchanged, and no exponent is positive. The shifts are constants for autograd.
    """
    d = q.shape[-1]
    half = same_sign_width(v)
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
    def swap(t):
        return torch.cat([t[..., d:, :], t[..., :d, :]], dim=-2)

    rhs = torch.cat([kv[..., :half], swap(kv[..., half:]), k_mean, swap(k_mean)], dim=-1)
    res = torch.matmul(phi_q, rhs)
    eps_rows = eps * torch.exp(-row_shift)
    return torch.cat([res[..., :half] / (res[..., -2:-1] + eps_rows), res[..., half:-2] / (res[..., -1:] + eps_rows)],
                     dim=-1)


def may_overflow(q, k, v, power, dtype) -> bool:
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
