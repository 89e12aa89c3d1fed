"""PaCS attention's eager CPU forms: both streams in one feature tensor with a hand-written backward, the forward
without gradients by blocks of query tokens, and the whole op fused per row in one native call. Each stage calls
the native kernels (:func:`polaformer.ops.dispatch.cpu_kernels`) where they are built, its torch-op version
otherwise. A result that overflowed is marked NaN (:func:`_overflowed`) for the op to redo in the log domain."""
from __future__ import annotations

import collections
import functools
import weakref

import torch
from torch.autograd.function import once_differentiable

from .._common import block_tokens, sum_to, swap_halves
from ..dispatch import cpu_kernels


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
        halves = ((x[..., 0::2], grad[..., 0::2], slice(0, p)), (x[..., 1::2], grad[..., 1::2], slice(p, d)))
        for src, dst, cols in halves:
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
    :func:`pacs_linear_attention` to the log-domain formulation (:func:`pacs_attention_graph`)."""
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


def pacs_attention_no_grad(q, k, v, temp_same, temp_opposite, sin, cos, eps, keep, m):
    """:class:`PacsAttention`'s forward for a call that needs no gradient, the queries by blocks of tokens
    (see :func:`polaformer.ops.pola.autograd.pola_attention_no_grad`)."""
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


class PacsAttention(torch.autograd.Function):
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
    """:class:`PacsAttention`'s backward after the fused forward: one native call, the features recomputed."""
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
