"""PaCS attention's torch formulation: functional, in the log domain, autograd deriving the backward. What graph
capture, devices without kernels and eager calls whose fast path overflowed run."""
from __future__ import annotations

import torch

from ..feature_maps import _expm1
from ..rope import apply_rope, turn_rows


def pacs_attention_graph(q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
    """The same math as :class:`PacsAttention`, written functionally (graph capture, devices without the
    kernels, and eager calls whose fast path overflowed), in the log domain so that no magnitude overflows.

    Each key channel is shifted by ``s``, its largest pre-activation over the sequence (shared by the two
    channels of a RoPE pair, which rotate together): ``φk·e^-s``. Each query row of each stream gets
    ``φq·e^(s−c)`` with ``c`` its largest ``x + s``. Products and ``eps`` are then all ``e^-c`` times the
    plain ones, so the ratio is unchanged; every exponent is ≤ 0 and each feature is formed as
    ``e^(x+s−c)·(1 − e^-x)``, exact for tiny ``x`` too. The shifts are constants for autograd.
    """
    half, d = v.shape[-1] // 2, q.shape[-1]
    zero = q.new_zeros(())
    y = torch.cat([torch.relu(k), torch.relu(-k)], -1)  # (B, H, M, 2d) key pre-activations
    if keep is not None:
        y = y * keep
    shift = y.detach().amax(dim=-2, keepdim=True) if y.shape[-2] else torch.zeros_like(y[..., :1, :])
    if sin is not None:
        shift = shift.unflatten(-1, (d, 2)).amax(-1, keepdim=True).expand(*shift.shape[:-1], d, 2).flatten(-2)
    phi_k = torch.exp(y - shift) * -_expm1(-y)
    k_mean = (phi_k.sum(dim=-2) / (m if keep is None else m[..., 0])).unsqueeze(-1)  # (B, H, 2d, 1)

    pos, neg = torch.relu(q), torch.relu(-q)
    x = torch.stack([torch.cat([pos, neg], -1) * temp_same, torch.cat([neg, pos], -1) * temp_opposite], dim=2)
    shift = shift.unsqueeze(2)  # (B, H, 1, 1, 2d) against the (B, H, 2, N, 2d) query pre-activations
    x_const = x.detach()
    # Channels whose feature is 0 (x = 0) take no part in the row's shift, which is ≥ 0, and keep a zero
    # exponent: e^(s−c) could overflow in front of their factor 0. Elsewhere x + s − c is ≤ 0 exactly, being
    # rounded as the maximum was.
    used = x_const != 0
    row_shift = torch.where(used, x_const.clamp_min(0) + shift, zero).amax(-1, keepdim=True)
    phi_q = torch.exp(torch.where(used, x + shift - row_shift, zero)) * -_expm1(-x)  # (B, H, 2, N, 2d)
    denom = torch.matmul(phi_q, k_mean.unsqueeze(2)) + eps * torch.exp(-row_shift)  # (B, H, 2, N, 1)
    if sin is not None:
        phi_k_num = apply_rope(phi_k, sin, cos)
        phi_q_num = apply_rope(phi_q, sin, cos)
    else:
        phi_k_num, phi_q_num = phi_k, phi_q
    kv = torch.matmul(phi_k_num.transpose(-2, -1), v) / m  # (B, H, 2d, dv)
    kv = torch.stack([kv[..., :half], kv[..., half:]], dim=2)  # (B, H, 2, 2d, dv/2)
    out = torch.matmul(phi_q_num, kv) / denom  # (B, H, 2, N, dv/2)
    return torch.cat([out[:, :, 0], out[:, :, 1]], dim=-1)


def pacs_attention_export(q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
    """:func:`pacs_attention_graph`'s math in few and cheap graph operators, for export (ONNX Runtime's
    ``Where`` and ``expm1``-free forms; see :func:`polaformer.ops.pola.formulation.pola_attention_export`).

    The same shifts: ``s``, each key channel's largest pre-activation (shared by a RoPE pair), and ``c``,
    each query row's largest ``x + s`` per stream; a feature ``e^(x+s−c)·(1 − e^-x)`` is formed as
    ``e^(x+s−c) − e^(s−c)`` (exact to a rounding of the row's largest feature; 0 where ``x = 0``). Unlike the
    graph form, ``c`` also counts channels where ``x = 0``: that only matters once a key exceeds the query
    row's other terms by about 80 (features beyond ``e^80``), where smaller channels' terms underflow.
    Both streams are one batched product along a stream axis; without RoPE numerators and normalisers
    come from one product (the ``1/m`` cancels, ``eps`` is multiplied by ``m``).
    """
    half = v.shape[-1] // 2
    y = torch.relu(torch.cat([k, -k], -1))  # (B, H, M, 2d) key pre-activations; a padded key's are 0
    if keep is not None:
        y = y * keep
    shift = y.amax(dim=-2, keepdim=True) if y.shape[-2] else torch.zeros_like(y[..., :1, :])
    if sin is not None:
        shift = shift.unflatten(-1, (-1, 2)).amax(-1, keepdim=True).expand(*shift.shape[:-1], -1, 2).flatten(-2)
    phi_k = torch.exp(y - shift) - torch.exp(-shift)  # e^-s·(e^y − 1)

    signed = torch.cat([q, -q], -1)
    temps = torch.stack([temp_same.expand_as(temp_opposite), temp_opposite.expand_as(temp_same)], dim=-3)
    x = torch.relu(torch.stack([signed, -signed], dim=-3)) * temps  # (B, H, 2, N, 2d): same-, opposite-sign
    top = x + shift.unsqueeze(-3)
    row_shift = top.amax(dim=-1, keepdim=True)  # (B, H, 2, N, 1), ≥ 0
    exponent = top - row_shift
    phi_q = torch.exp(exponent) - torch.exp(exponent - x)
    scale = eps * m  # a number, or (B, 1, 1, 1) valid keys with padding (also a 0-d tensor under tracing)
    eps_rows = (scale.unsqueeze(-3) if torch.is_tensor(scale) and scale.dim() == 4 else scale) * torch.exp(-row_shift)

    values = v.unflatten(-1, (2, half)).transpose(-3, -2)  # (B, H, 2, M, half)
    k_sum = phi_k.sum(dim=-2).unsqueeze(-1).unsqueeze(-3)  # (B, H, 1, 2d, 1)
    if sin is None:
        rhs = torch.cat([torch.matmul(phi_k.unsqueeze(-3).transpose(-2, -1), values), k_sum.expand(
            *values.shape[:-2], -1, 1)], dim=-1)
        res = torch.matmul(phi_q, rhs)  # (B, H, 2, N, half + 1)
        out = res[..., :half] / (res[..., half:] + eps_rows)
    else:
        # rope(x) = x·cos + turn(x)·sin, turn(a, b) = (−b, a) in each channel pair; a pair shares its angle, so
        # turn(x)·sin = turn(x·sin), and the turns move from the token rows onto the small (2d, half) states
        def states(features):  # (B, H, 2, 2d, half): sums over the keys
            return torch.matmul(features.unsqueeze(-3).transpose(-2, -1), values)

        kv = states(phi_k * cos) + turn_rows(states(phi_k * sin), transpose=True)
        numerator = torch.matmul(phi_q * cos, kv) + torch.matmul(phi_q * sin, turn_rows(kv))
        out = numerator / (torch.matmul(phi_q, k_sum) + eps_rows)
    return out.transpose(-3, -2).flatten(-2)  # (B, H, N, dv)
