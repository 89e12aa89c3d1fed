"""PolaFormer++'s PaCS attention, O(N·d²) in tokens: the channel-wise exponential feature map with one temperature
per stream, RoPE on the numerator only (:func:`pacs_linear_attention`; reference: :mod:`.naive`).

It shares the power-map op's conventions and helpers (:mod:`.pola_attention`): input checks, key padding, the
compute dtype, token blocks and the native kernel lookup. On the CPU the whole op runs fused per row in the native
kernels, on CUDA in the Triton kernels (:mod:`polaformer.backends.triton.pacs`, under torch.compile too); export
and the CPU under torch.compile get :func:`_pacs_attention_graph`.
"""
from __future__ import annotations

import collections
import functools
import weakref

import torch
from torch.autograd.function import once_differentiable

from .causal import causal_pacs_linear_attention
from .dispatch import capturing, cpu_kernels, triton_kernels
from .feature_maps import _expm1, pacs_temperature
from ._common import (
    block_tokens,
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
    sum_to,
    swap_halves,
)
from .rope import apply_rope
from .varlen import check_cu_seqlens, padded_call

__all__ = ["pacs_layer_attention", "pacs_linear_attention"]


@functools.lru_cache(maxsize=32)
def _pacs_indices(d: int, rope: bool, device: torch.device):
    """Channel bookkeeping of the fused PaCS kernel (cached: it depends only on the head size).

    Features are ``[q⁺ ; q⁻]`` with, under RoPE, each half stored as [even | odd] channels: RoPE rotates
    pairs (2i, 2i+1), which this turns into a planar complex multiply on whole blocks. The order is
    internal, every product contracts over it. Returns the gather and scatter indices of the two
    temperature vectors concatenated (4d): the same-sign stream in that order, then the opposite-sign
    one with its halves swapped.
    """
    half = torch.arange(d)
    if rope:
        half = torch.cat([half[0::2], half[1::2]])
    order = torch.cat([half, half + d])
    temps = torch.cat([order, 2 * d + (order + d) % (2 * d)])
    return temps.to(device), torch.argsort(temps).to(device)


# Tables rearranged for the fused kernel, by the identity of the (sin, cos) pair they came from: every
# block of a stage passes the same tables, and rearranging them costs as much as the rest of a small
# attention call. An entry holds weak references and the version counters of both tables, so a table
# that was freed or modified in place is never matched.
_ROPE_TABLE_CACHE: collections.OrderedDict = collections.OrderedDict()
_ROPE_TABLE_CACHE_SIZE = 16


def _pacs_rope_tables(sin: torch.Tensor, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_arrange_rope_tables`, reused while the same two tables are passed unchanged.

    Inference tensors have no version counter, so their tables are rearranged on every call.
    """
    if sin.is_inference() or cos.is_inference() or sin.requires_grad or cos.requires_grad:
        return _arrange_rope_tables(sin, cos)
    key = (id(sin), id(cos), torch.is_inference_mode_enabled())
    entry = _ROPE_TABLE_CACHE.get(key)
    if entry is not None:
        sin_ref, cos_ref, versions, tables = entry
        if sin_ref() is sin and cos_ref() is cos and versions == (sin._version, cos._version):
            _ROPE_TABLE_CACHE.move_to_end(key)
            return tables
    tables = _arrange_rope_tables(sin, cos)
    _ROPE_TABLE_CACHE[key] = (weakref.ref(sin), weakref.ref(cos), (sin._version, cos._version), tables)
    while len(_ROPE_TABLE_CACHE) > _ROPE_TABLE_CACHE_SIZE:
        _ROPE_TABLE_CACHE.popitem(last=False)
    return tables


def _arrange_rope_tables(sin: torch.Tensor, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 2d) RoPE tables in the fused kernel's order for both streams: ``(cos, cross)``, (2, N, 2d) each.

    Per half, pairs (2i, 2i+1) become [even | odd] blocks (:func:`_pacs_indices`); the opposite-sign
    stream's halves are swapped; ``cross`` is sin negated at the even positions (see :func:`_rotate`).
    """
    n, two_d = cos.shape
    p = two_d // 4
    out = cos.new_empty(2, 2, n, 2, 2, p)  # (cos|sin, stream, N, half, even|odd, pair)
    for dst, table in zip(out, (cos, sin)):
        planar = table.reshape(n, 2, p, 2).transpose(-2, -1)  # (N, half, even|odd, pair)
        dst[0].copy_(planar)
        dst[1, :, 0].copy_(planar[:, 1])
        dst[1, :, 1].copy_(planar[:, 0])
    out[1, :, :, :, 0].neg_()
    cos, cross = out.flatten(-3).unbind(0)
    return cos, cross


def _relu_halves(x: torch.Tensor, rope: bool, exp_minus_one: bool = False) -> torch.Tensor:
    """``[relu(x) ; relu(-x)]`` (2d channels, in :func:`_pacs_indices` order), written into one new buffer.

    With ``exp_minus_one``, ``exp`` of that minus 1: the key features (one fused pass on the CPU).
    """
    native = cpu_kernels(x)
    if native is not None and x.stride(-1) == 1:
        return native.pacs_halves(x, rope, exp_minus_one)[0]
    d = x.shape[-1]
    out = x.new_empty(*x.shape[:-1], 2 * d)
    parts = ((x[..., 0::2], slice(0, d // 2)), (x[..., 1::2], slice(d // 2, d))) if rope else ((x, slice(0, d)),)
    for src, cols in parts:
        torch.clamp(src, min=0, out=out[..., cols])
        torch.clamp(src, max=0, out=out[..., d:][..., cols]).neg_()
    # exp(x) - 1 as in the official code: torch's exp is vectorised on CPU, expm1 is not.
    return out.exp_().sub_(1.0) if exp_minus_one else out


def _pacs_exp_features(p_q: torch.Tensor, temps: torch.Tensor, tables=None, k_means=None, eps: float = 0.0):
    """Both streams' query features ``exp(p_q ⊙ T_s) − 1``, (B, H, 2, N, 2d), their RoPE rotation (the
    features themselves without tables), and, given ``k_means`` (B, H, 2, 2d, 1), the normalisers
    ``φ·k_mean + eps`` (B, H, 2, N, 1) where the fused kernel forms them in its pass (else None)."""
    native = cpu_kernels(p_q)
    if native is not None and p_q.is_contiguous():
        cos, cross = tables if tables is not None else (None, None)
        out = native.pacs_exp_features(p_q, temps, cos, cross, k_means, eps)
        return out[0], out[1], (out[2] if k_means is not None else None)
    phi_q = (p_q.unsqueeze(2) * temps).exp_().sub_(1.0)
    return phi_q, (phi_q if tables is None else _rotate(phi_q, *tables)), None


def _rotate(x: torch.Tensor, cos: torch.Tensor, cross: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """RoPE (or its transpose) on features in :func:`_pacs_indices` order: per half, (E, O) -> (E·c − O·s, O·c + E·s).

    ``cross`` holds ``-sin`` at even and ``+sin`` at odd positions. Returns a new tensor.
    """
    p = x.shape[-1] // 4
    out = x * cos
    x4, o4, s4 = x.unflatten(-1, (2, 2, p)), out.unflatten(-1, (2, 2, p)), cross.unflatten(-1, (2, 2, p))
    # forward: E += O·cross_E, O += E·cross_O; transpose: E += O·cross_O, O += E·cross_E
    o4[..., 0, :].addcmul_(x4[..., 1, :], s4[..., 1 if transpose else 0, :])
    o4[..., 1, :].addcmul_(x4[..., 0, :], s4[..., 0 if transpose else 1, :])
    return out


def _unrelu(x: torch.Tensor, grad_halves: torch.Tensor, rope: bool) -> torch.Tensor:
    """Gradient through :func:`_relu_halves`: ``sgn(x)·(grad⁺ where x > 0 else grad⁻)``, in x's channel order."""
    d = x.shape[-1]
    grad = torch.empty(x.shape, dtype=grad_halves.dtype, device=x.device)
    pos, neg = grad_halves[..., :d], grad_halves[..., d:]
    if rope:
        p = d // 2
        for src, dst, cols in ((x[..., 0::2], grad[..., 0::2], slice(0, p)), (x[..., 1::2], grad[..., 1::2], slice(p, d))):
            torch.where(src > 0, pos[..., cols], neg[..., cols], out=dst)
    else:
        torch.where(x > 0, pos, neg, out=grad)
    return grad.mul_(x.sign())


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def _pacs_stacked_temperatures(temp_same, temp_opposite, d, rope, device):
    """Both streams' temperatures in the kernel's channel order, (…, 2, 1, 2d), the opposite one half-swapped."""
    ts, to = torch.broadcast_tensors(_as_4d(temp_same), _as_4d(temp_opposite))
    temps = torch.cat([ts, to], -1).index_select(-1, _pacs_indices(d, rope, device)[0])
    return temps.unflatten(-1, (2, 2 * d)).transpose(2, 3)


def _pacs_key_side(k, v, keep, m, tables):
    """Key features and what the queries multiply: ``(φk, rotated φk, [S_same ; swapped S_opp], key means)``."""
    native = cpu_kernels(k)
    if native is not None and keep is None and k.stride(-1) == 1:
        # features and their rotation in one pass
        phi_k, k_num = native.pacs_halves(k, tables is not None, True,
                                          *(() if tables is None else (tables[0][:1], tables[1][:1])))
        return phi_k, k_num, *_pacs_key_products(phi_k, k_num, v, m, None)
    phi_k = _relu_halves(k, tables is not None, exp_minus_one=True)
    if keep is not None:
        phi_k.mul_(keep)
    k_num = phi_k if tables is None else _rotate(phi_k, tables[0][0], tables[1][0])
    return phi_k, k_num, *_pacs_key_products(phi_k, k_num, v, m, keep)


def _pacs_key_products(phi_k, k_num, v, m, keep):
    """``([S_same ; swapped S_opp], key means)`` from the key features and their rotation."""
    half = v.shape[-1] // 2
    k_mean = phi_k.sum(dim=-2).div_(m if keep is None else m[..., 0])  # (B, H, 2d)
    k_means = torch.stack([k_mean, swap_halves(k_mean)], dim=2).unsqueeze(-1)
    kv = torch.matmul(k_num.transpose(-2, -1), v).div_(m)  # (B, H, 2d, dv)
    kvs = torch.stack([kv[..., :half], swap_halves(kv[..., half:], -2)], dim=2)
    return kvs, k_means


def _pacs_output(q, v):
    """Token-major output memory (B, N, H, 2, dv/2) and its (B, H, 2, N, dv/2) view."""
    out_tok = v.new_empty(q.shape[0], q.shape[2], q.shape[1], 2, v.shape[-1] // 2)
    return out_tok, out_tok.permute(0, 2, 3, 1, 4)


def _pacs_query_side(p_q, temps, tables, kvs, k_means, eps, out):
    """Query features of both streams and the normalised products, written into ``out``: ``(φq, rotated φq,
    normalisers)``. Where a feature or product overflows, ``out`` is filled with NaN (see :func:`_overflowed`)."""
    half = out.shape[-1]
    # (B, H, 2, N, 2d) features, their rotation and (from the native kernel) their normalisers
    phi_q, q_num, denom = _pacs_exp_features(p_q, temps, tables, k_means, eps)
    if denom is not None:  # the normalisers came with the features: the product needs only the numerators
        num = torch.matmul(q_num, kvs)
    elif tables is not None:
        num = torch.matmul(q_num, kvs)
        denom = torch.matmul(phi_q, k_means).add_(eps)
    else:
        res = torch.matmul(phi_q, torch.cat([kvs, k_means], -1))
        num, denom = res[..., :half], res[..., half:].add_(eps)
    torch.div(num, denom, out=out)
    # a finite numerator over an infinite normaliser divides to a finite, wrong zero
    if not bool(torch.isfinite(denom.sum())):
        _overflowed(out)
    return phi_q, q_num, denom


def _overflowed(out: torch.Tensor) -> torch.Tensor:
    """Mark a fast-path result whose features or products overflowed: filled with NaN, which sends
    :func:`pacs_linear_attention` to the log-domain formulation (:func:`_pacs_attention_graph`)."""
    return out.fill_(float("nan"))


def _pacs_fused(q, k, v, temps, tables, eps, keep):
    """The whole op on the native fused kernel (no key padding, unit channel strides, native kernels built):
    ``(out memory (B, N, H, dv), denom, kvs, k_means)``, the output marked by :func:`_overflowed` where a value
    came out non-finite; None where the kernel does not apply."""
    native = cpu_kernels(q)
    if (native is None or keep is not None or not hasattr(native, "pacs_fused_forward")
            or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    cos, cross = tables if tables is not None else (None, None)
    results, finite = native.pacs_fused_forward(q, k, v, temps, cos, cross, eps)
    if not finite:
        _overflowed(results[0])
    return results


def _pacs_attention_no_grad(q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
    """:class:`_PacsAttention`'s forward for a call that needs no gradient, the queries by blocks of tokens
    (see :func:`.pola_attention._pola_attention_no_grad`)."""
    rope = sin is not None
    temps = _pacs_stacked_temperatures(temp_same, temp_opposite, q.shape[-1], rope, q.device)
    tables = _pacs_rope_tables(sin, cos) if rope else None
    fused = _pacs_fused(q, k, v, temps, tables, eps, keep)
    if fused is not None:
        return fused[0].transpose(1, 2)
    _, _, kvs, k_means = _pacs_key_side(k, v, keep, m, tables)
    out_tok, out = _pacs_output(q, v)
    n, d = q.shape[-2:]
    # Blocks of about _common.BLOCK_ELEMENTS query elements (4x that many features, both streams 2d wide): the
    # PaCS steps per block are more than the Pola ones, and blocks sized by the features ran slower.
    step = block_tokens(q, d)
    for i in range(0, n, step):
        rows = slice(i, i + step)
        _pacs_query_side(_relu_halves(q[:, :, rows], rope), temps,
                         None if tables is None else tuple(t[:, rows] for t in tables), kvs, k_means, eps,
                         out[:, :, :, rows])
    return out_tok.flatten(-2).transpose(1, 2)


class _PacsAttention(torch.autograd.Function):
    """PaCS attention, both streams in one (B, H, 2, N, 2d) feature tensor.

    The opposite-sign stream is kept in the same channel order as the same-sign one (its temperatures,
    RoPE tables, ``φkᵀv`` rows and key mean are swapped instead of its features), so the features are
    ``exp([q⁺ ; q⁻] ⊙ T) − 1`` for a stacked temperature ``T``: one multiply and one ``exp`` for both.
    """

    @staticmethod
    def forward(ctx, q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
        rope = sin is not None
        temps = _pacs_stacked_temperatures(temp_same, temp_opposite, q.shape[-1], rope, q.device)
        tables = _pacs_rope_tables(sin, cos) if rope else None
        ctx.rope, ctx.temp_shapes = rope, (temp_same.shape, temp_opposite.shape)
        fused = _pacs_fused(q, k, v, temps, tables, eps, keep)
        ctx.fused = fused is not None
        if ctx.fused:  # the backward recomputes the features from q and k
            out_tok, denom, kvs, k_means = fused
            ctx.save_for_backward(q, k, v, temps, kvs, k_means, denom, out_tok, *(tables or ()))
            return out_tok.transpose(1, 2)
        phi_k, k_num, kvs, k_means = _pacs_key_side(k, v, keep, m, tables)
        p_q = _relu_halves(q, rope)  # (B, H, N, 2d)
        out_tok, out = _pacs_output(q, v)
        phi_q, q_num, denom = _pacs_query_side(p_q, temps, tables, kvs, k_means, eps, out)

        ctx.eps_m = m if keep is None else None
        ctx.save_for_backward(q, k, v, temps, p_q, phi_q, q_num, phi_k, k_num, kvs, k_means, denom, out,
                              *(() if keep is None else (keep, m)), *(tables or ()))
        ctx.has_keep = keep is not None
        return out_tok.flatten(-2).transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.fused:
            return _pacs_backward_fused(ctx, grad_out)
        q, k, v, temps, p_q, phi_q, q_num, phi_k, k_num, kvs, k_means, denom, out, *rest = ctx.saved_tensors
        keep, m = (rest.pop(0), rest.pop(0)) if ctx.has_keep else (None, ctx.eps_m)
        tables = rest if ctx.rope else None
        d = q.shape[-1]
        half = v.shape[-1] // 2
        b, h, n = q.shape[:3]

        g_out = grad_out.unflatten(-1, (2, half)).transpose(2, 3)  # (B, H, 2, N, dv/2) view
        g_num = g_out / denom
        g_den = (g_num * out).sum(-1, keepdim=True).neg_()  # (B, H, 2, N, 1)
        if ctx.rope:
            grad_q_num = torch.matmul(g_num, kvs.transpose(-2, -1))
            grad_kvs = torch.matmul(q_num.transpose(-2, -1), g_num)
            grad_phi_q = _rotate(grad_q_num, *tables, transpose=True).addcmul_(g_den, k_means.transpose(-2, -1))
            grad_k_means = torch.matmul(phi_q.transpose(-2, -1), g_den)
        else:
            g = torch.cat([g_num, g_den], -1)
            grad_phi_q = torch.matmul(g, torch.cat([kvs, k_means], -1).transpose(-2, -1))
            grad_rhs = torch.matmul(phi_q.transpose(-2, -1), g)
            grad_kvs, grad_k_means = grad_rhs[..., :half], grad_rhs[..., half:]
        # Back to the key layout: the opposite stream's rows are swapped.
        grad_kv = torch.cat([grad_kvs[:, :, 0], swap_halves(grad_kvs[:, :, 1], -2)], -1).div_(m)  # (B, H, 2d, dv)
        grad_k_mean = (grad_k_means[:, :, 0] + swap_halves(grad_k_means[:, :, 1], -2)).div_(m).transpose(-2, -1)

        grad_v = torch.matmul(k_num, grad_kv) if ctx.needs_input_grad[2] else None
        grad_k = None
        if ctx.needs_input_grad[1]:
            grad_k_num = torch.matmul(v, grad_kv.transpose(-2, -1))
            grad_phi_k = _rotate(grad_k_num, *(t[0] for t in tables), transpose=True) if ctx.rope else grad_k_num
            grad_phi_k.add_(grad_k_mean)
            if keep is not None:
                grad_phi_k.mul_(keep)
            # d(exp(x) - 1) = phi + 1; padded rows are already zero
            native = cpu_kernels(k)
            if native is not None and k.stride(-1) == 1 and grad_phi_k.stride(-1) == 1:
                grad_k = native.pacs_key_backward(k, phi_k, grad_phi_k, ctx.rope)
            else:
                grad_k = _unrelu(k, grad_phi_k.addcmul_(grad_phi_k, phi_k), ctx.rope)

        need_temps = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        native = cpu_kernels(q)
        if native is not None and q.stride(-1) == 1 and grad_phi_q.is_contiguous():
            # one pass: grad_q, and the temperatures' gradient summed over the tokens
            grad_q, grad_temps = native.pacs_query_backward(q, p_q, phi_q, grad_phi_q, temps, ctx.rope, need_temps)
            grad_q = grad_q if ctx.needs_input_grad[0] else None
            grad_temps = sum_to(grad_temps, temps.shape) if need_temps else None
            return (grad_q, grad_k, grad_v, *_pacs_temperature_grads(ctx, grad_temps, d, q.device),
                    None, None, None, None, None)

        # d/d(pre) of exp(pre) - 1 is phi_q + 1
        grad_pre = grad_phi_q.addcmul_(grad_phi_q, phi_q)
        grad_q = None
        if ctx.needs_input_grad[0]:
            grad_p_q = torch.mul(grad_pre[:, :, 0], temps[:, :, 0]).addcmul_(grad_pre[:, :, 1], temps[:, :, 1])
            grad_q = _unrelu(q, grad_p_q, ctx.rope)
        grad_temps = sum_to(grad_pre.mul_(p_q.unsqueeze(2)), temps.shape) if need_temps else None  # (tb, th, 2, 1, 2d)
        return (grad_q, grad_k, grad_v, *_pacs_temperature_grads(ctx, grad_temps, d, q.device),
                None, None, None, None, None)


def _pacs_backward_fused(ctx, grad_out):
    """:class:`_PacsAttention`'s backward after the fused forward: one native call, the features recomputed."""
    q, k, v, temps, kvs, k_means, denom, out_tok, *tables = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need_temps = needs[3] or needs[4]
    cos, cross = tables if tables else (None, None)
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    grad_q, grad_k, grad_v, grad_temps = cpu_kernels(q).pacs_fused_backward(
        grad_out, q, k, v, temps, cos, cross, kvs, k_means, denom, out_tok.transpose(1, 2), need_temps)
    grad_temps = sum_to(grad_temps, temps.shape) if need_temps else None
    return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None,
            *_pacs_temperature_grads(ctx, grad_temps, q.shape[-1], q.device), None, None, None, None, None)


def _pacs_temperature_grads(ctx, grad_temps, d, device):
    """(grad_same, grad_opposite) from the stacked temperatures' gradient, in the inputs' order and shapes."""
    if grad_temps is None:
        return None, None
    temp_inverse = _pacs_indices(d, ctx.rope, device)[1]
    grad_ts, grad_to = grad_temps.transpose(2, 3).flatten(-2).index_select(-1, temp_inverse).chunk(2, -1)
    grad_ts = sum_to(grad_ts, ctx.temp_shapes[0]) if ctx.needs_input_grad[3] else None
    grad_to = sum_to(grad_to, ctx.temp_shapes[1]) if ctx.needs_input_grad[4] else None
    return grad_ts, grad_to


def _pacs_attention_graph(q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
    """The same math as :class:`_PacsAttention`, written functionally (graph capture, devices without the
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


def _check_packed(q, k, cu_seqlens, cu_seqlens_k, rope: bool) -> None:
    """Arguments of a packed batch. The offsets' values are read (a host sync) only where they are on the CPU;
    the torch formulation reads them anyway (:func:`_pacs_packed`)."""
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


def _pacs_packed(q, k, v, temp_same, temp_opposite, sin, cos, eps, cu_seqlens, cu_seqlens_k):
    """The torch formulation of a packed batch: the sequences padded into a batch with a key padding mask (each
    gets exactly its own output), or, with RoPE tables (one row per packed token), one call per sequence."""
    offsets = check_cu_seqlens(cu_seqlens, q.shape[-2])
    if sin is not None:
        parts = [pacs_linear_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], temp_same, temp_opposite,
                                       sin[a:b], cos[a:b], eps) for a, b in zip(offsets, offsets[1:]) if b > a]
        return torch.cat(parts, dim=2) if parts else v.new_empty(*q.shape[:-1], v.shape[-1])
    offsets_k = offsets if cu_seqlens_k is None else check_cu_seqlens(cu_seqlens_k, k.shape[-2], "cu_seqlens_k")

    def attend(pq, pk, pv, padding):
        return pacs_linear_attention(pq, pk, pv, temp_same, temp_opposite, eps=eps, key_padding_mask=padding)

    return padded_call(attend, q, k, v, offsets, offsets_k)


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
        _check_packed(q, k, cu_seqlens, cu_seqlens_k, sin is not None)
    if key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, k)


def _kernels(q: torch.Tensor, sin: torch.Tensor | None):
    """The Triton kernels for a call (:func:`.dispatch.triton_kernels`), or None. Their RoPE works on channel
    pairs inside each half: tables for an odd head_dim take the plain path."""
    return triton_kernels(q) if sin is None or q.shape[-1] % 2 == 0 else None


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
        cu_seqlens: packed variable-length batch (:mod:`.varlen`): q, k, v are
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
    shifted with them); see :func:`_pacs_attention_graph`. With RoPE the
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
    kernels = _kernels(q, sin)
    if kernels is not None:
        return kernels.pacs_attention(q, k, v, temp_same, temp_opposite, sin, cos, eps,
                                      *_on_device(q, key_padding_mask, cu_seqlens, cu_seqlens_k))
    if cu_seqlens is not None:
        return _pacs_packed(q, k, v, temp_same, temp_opposite, sin, cos, eps, cu_seqlens, cu_seqlens_k)
    pairs = sin is None or q.shape[-1] % 2 == 0
    dtype = compute_dtype(q, k, v, temp_same, temp_opposite)
    keep, m = key_keep(key_padding_mask, k, dtype)
    out_dtype = v.dtype
    # Off the CPU a finiteness test would wait for the device: there the log domain always runs.
    if capturing() or not pairs or q.device.type != "cpu":
        attention = _pacs_attention_graph
    elif needs_grad(q, k, v, temp_same, temp_opposite):
        attention = _PacsAttention.apply
    else:
        attention = _pacs_attention_no_grad
    if sin is not None:
        sin, cos = sin.to(dtype), cos.to(dtype)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), temp_same.to(dtype), temp_opposite.to(dtype), sin, cos, eps,
            keep, m)
    with full_precision(q.device.type):
        out = attention(*args)
        # the sum is finite only if every entry is; a fast path that overflowed is redone in the log domain
        if attention is not _pacs_attention_graph and not bool(torch.isfinite(out.sum())):
            out = _pacs_attention_graph(*args)
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
    kernels = None if causal else _kernels(q, sin)
    if kernels is None:
        out = pacs_linear_attention(q, k, v, pacs_temperature(same), pacs_temperature(opposite), sin, cos, eps,
                                    key_padding_mask, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, causal=causal)
        return local_and_gate(out, local, gate)
    _check_call(q, k, sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
    return kernels.pacs_attention(q, k, v, same, opposite, sin, cos, eps,
                                  *_on_device(q, key_padding_mask, cu_seqlens, cu_seqlens_k), raw=True, local=local,
                                  gate=gate)
