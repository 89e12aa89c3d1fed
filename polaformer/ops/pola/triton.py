"""Fused Triton kernels of :func:`polaformer.ops.pola_linear_attention` (the power map ``|x|ᵖ``).

Per (sequence, head), with ``a = x⁺ᵖ`` and ``b = x⁻ᵖ`` the two halves of a token's features and ``m`` the
number of valid keys, the forward pass builds one routed state in fp32 (never rounded to the inputs' dtype)::

    top[:, j]    = Σ_keys (a if j < half else b)ᵀ v[:, j] / m      (d × dv)
    bottom[:, j] = Σ_keys (b if j < half else a)ᵀ v[:, j] / m      (d × dv)
    key_pos = Σ_keys a / m,  key_neg = Σ_keys b / m                 (d)

so both streams' numerators are ``a·top + b·bottom`` (the opposite-sign query is routed through the state's
columns instead of being written), and the normalisers are ``a·key_pos + b·key_neg`` (same sign) and
``a·key_neg + b·key_pos`` (opposite sign). Features are recomputed in registers wherever they are needed and
never written to memory.

Log domain. Features are formed as ``2^(p·log2|x| − shift)``: each key channel is shifted by its largest
exponent over the sequence (kept as a running maximum while the keys are summed, the state rescaled when it
grows, as flash attention keeps its row maxima), each query row by its largest exponent plus that key shift,
and ``eps`` with it. The shifts cancel between numerator and normaliser, no feature exceeds 1, and the result
is finite wherever the exact one is, with no host synchronisation; the same formulation as the op's torch
path (``formulation.pola_attention_graph``).

Launches (:func:`polaformer.backends.triton.common.plan`): at the models' shapes one program per (query span, head,
sequence) builds the key state itself and writes its queries' output, one launch; the backward is one program per (head,
sequence) for the query side then the key side, one launch (plus one torch sum for the exponent's gradient
over the sequences). Long sequences with few (sequence, head) pairs split the keys over a state launch and the
backward over a query-side and a key-side launch; partial sums are added in a fixed order, no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ...backends.triton.common import (
    accumulator_dtype,
    dot,
    dots,
    padded_width,
    plan,
    pola_tile,
    program,
    sequence_tokens,
    share,
    sigmoid,
    softplus,
    traceable,
    unpadded_keys,
)

__all__ = ["PolaAttention", "pola_attention", "pola_backward", "pola_forward"]

# Below every exponent a float32 feature can have: the shift of a channel no valid key reaches. Finite, so
# that shift differences stay finite (an infinite one would give inf − inf).
_NO_KEY = tl.constexpr(-1.0e30)


@triton.jit
def _log_magnitude(x, p):
    """``(p·log2|x|, x ≠ 0)``; the exponent is ``_NO_KEY`` where x is 0 (masked and padded entries too)."""
    used = x != 0
    return tl.where(used, p * tl.log2(tl.where(used, tl.abs(x), 1.0)), _NO_KEY), used


@triton.jit
def _halves(x, magnitude, used):
    """``(x⁺ᵖ, x⁻ᵖ)`` from the (shifted) magnitude."""
    magnitude = tl.where(used, magnitude, 0.0)
    return tl.where(x > 0, magnitude, 0.0), tl.where(x < 0, magnitude, 0.0)


@triton.jit
def _channel_params(p_base, s_base, stride_pc, stride_sc, alpha, D, DP: tl.constexpr, POWER_WEIGHT: tl.constexpr,
                    HAS_SCALE: tl.constexpr, ACC: tl.constexpr):
    """``(p, 1/scale)`` per channel: the exponent (``1 + α·sigmoid(w)`` from the raw weight with
    ``POWER_WEIGHT``) and the inverse of ``softplus`` of the raw scale weight (ones without one)."""
    c = tl.arange(0, DP)
    ok = c < D
    p = tl.load(p_base + c * stride_pc, mask=ok, other=0.0).to(ACC)
    if POWER_WEIGHT:
        p = 1.0 + alpha * sigmoid(p)
    else:
        p = tl.where(ok, p, 1.0)
    inv_scale = tl.full([DP], 1.0, dtype=ACC)
    if HAS_SCALE:
        inv_scale = 1.0 / softplus(tl.load(s_base + c * stride_sc, mask=ok, other=0.0).to(ACC))
    return p, inv_scale


@triton.jit
def _rows(base, t, ok, c, stride_t, stride_c, D, ACC: tl.constexpr):
    """A (tokens, channels) block, zero outside ``ok`` rows and ``D`` channels."""
    return tl.load(base + t[:, None] * stride_t + c[None, :] * stride_c, mask=ok[:, None] & (c < D)[None, :],
                   other=0.0).to(ACC)


@triton.jit
def _keys(k_base, pos_base, t, keep, c, stride_kt, stride_kc, stride_xt, stride_xc, inv_scale, D,
          HAS_POS: tl.constexpr, ACC: tl.constexpr):
    """Keys ``(k + positions) / scale`` of rows ``t`` (zero where not kept), as the features take them."""
    x = _rows(k_base, t, keep, c, stride_kt, stride_kc, D, ACC)
    if HAS_POS:
        x += _rows(pos_base, t, keep, c, stride_xt, stride_xc, D, ACC)
    return x * inv_scale[None, :]


@triton.jit
def _key_state(k_base, v_base, pos_base, mask_base, p, inv_scale, lo, hi,
               stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, D, DV, HALF,
               BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, HAS_MASK: tl.constexpr,
               HAS_POS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """The routed state of keys ``[lo, hi)`` (sums, not yet divided by m), its per-channel shift and the number
    of valid keys. The shift is a running maximum; the sums are rescaled whenever it grows."""
    c = tl.arange(0, DP)
    j = tl.arange(0, DVP)
    same = (j < HALF)[None, :]
    top = tl.zeros([DP, DVP], dtype=ACC)
    bottom = tl.zeros([DP, DVP], dtype=ACC)
    key_pos = tl.zeros([DP], dtype=ACC)
    key_neg = tl.zeros([DP], dtype=ACC)
    shift = tl.full([DP], _NO_KEY, dtype=ACC)
    count = tl.zeros([BLOCK], dtype=ACC)
    for t0 in range(lo, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        keep = unpadded_keys(mask_base, t, t < hi, stride_mt, HAS_MASK)
        x = _keys(k_base, pos_base, t, keep, c, stride_kt, stride_kc, stride_xt, stride_xc, inv_scale, D, HAS_POS,
                  ACC)
        values = tl.load(v_base + t[:, None] * stride_vt + j[None, :] * stride_vc,
                         mask=keep[:, None] & (j < DV)[None, :], other=0.0).to(ACC)
        exponent, used = _log_magnitude(x, p[None, :])
        grown = tl.maximum(shift, tl.max(exponent, 0))
        rescale = tl.exp2(shift - grown)
        shift = grown
        pos, neg = _halves(x, tl.exp2(exponent - shift[None, :]), used)
        sum_pos = dot(tl.trans(pos), values, DOT, PRECISION, ACC)
        sum_neg = dot(tl.trans(neg), values, DOT, PRECISION, ACC)
        top = top * rescale[:, None] + tl.where(same, sum_pos, sum_neg)
        bottom = bottom * rescale[:, None] + tl.where(same, sum_neg, sum_pos)
        key_pos = key_pos * rescale + tl.sum(pos, 0)
        key_neg = key_neg * rescale + tl.sum(neg, 0)
        count += keep.to(ACC)
    return top, bottom, key_pos, key_neg, shift, tl.sum(count, 0)


@triton.jit
def _merge_partials(part_base, SPLITS: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, ACC: tl.constexpr):
    """The state of a sequence from its ``SPLITS`` partial states, rescaled to their largest shift and added in
    split order."""
    c = tl.arange(0, DP)
    cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
    width: tl.constexpr = 2 * DP * DVP + 3 * DP + 1
    shift = tl.full([DP], _NO_KEY, dtype=ACC)
    for split in range(SPLITS):
        shift = tl.maximum(shift, tl.load(part_base + split * width + 2 * DP * DVP + 2 * DP + c))
    top = tl.zeros([DP, DVP], dtype=ACC)
    bottom = tl.zeros([DP, DVP], dtype=ACC)
    key_pos = tl.zeros([DP], dtype=ACC)
    key_neg = tl.zeros([DP], dtype=ACC)
    count = tl.zeros((), dtype=ACC)
    for split in range(SPLITS):
        base = part_base + split * width
        rescale = tl.exp2(tl.load(base + 2 * DP * DVP + 2 * DP + c) - shift)
        top += tl.load(base + cell) * rescale[:, None]
        bottom += tl.load(base + DP * DVP + cell) * rescale[:, None]
        key_pos += tl.load(base + 2 * DP * DVP + c) * rescale
        key_neg += tl.load(base + 2 * DP * DVP + DP + c) * rescale
        count += tl.load(base + 2 * DP * DVP + 3 * DP)
    return top, bottom, key_pos, key_neg, shift, count


@triton.jit
def _store_state(base, top, bottom, key_pos, key_neg, shift, count, DP: tl.constexpr, DVP: tl.constexpr):
    c = tl.arange(0, DP)
    cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
    tl.store(base + cell, top)
    tl.store(base + DP * DVP + cell, bottom)
    tl.store(base + 2 * DP * DVP + c, key_pos)
    tl.store(base + 2 * DP * DVP + DP + c, key_neg)
    tl.store(base + 2 * DP * DVP + 2 * DP + c, shift)
    tl.store(base + 2 * DP * DVP + 3 * DP, count)


@triton.jit
def _load_state(base, DP: tl.constexpr, DVP: tl.constexpr):
    """A saved state (already divided by its count): (top, bottom, key_pos, key_neg, shift, 1/m)."""
    c = tl.arange(0, DP)
    cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
    inv_m = 1.0 / tl.maximum(tl.load(base + 2 * DP * DVP + 3 * DP), 1.0)
    return (tl.load(base + cell), tl.load(base + DP * DVP + cell), tl.load(base + 2 * DP * DVP + c),
            tl.load(base + 2 * DP * DVP + DP + c), tl.load(base + 2 * DP * DVP + 2 * DP + c), inv_m)


@triton.jit
def _query_features(x, p, shift):
    """Query features shifted by their key channel's shift and by the row's largest shifted exponent
    (entries of x = 0 count as 0, as in the torch formulation), and that row shift."""
    exponent, used = _log_magnitude(x, p)
    exponent = exponent + shift[None, :]
    row_shift = tl.max(tl.where(used, exponent, 0.0), 1)
    pos, neg = _halves(x, tl.exp2(exponent - row_shift[:, None]), used)
    return pos, neg, row_shift


@triton.jit
def _normalisers(pos, neg, key_pos, key_neg, eps_row, same_stream):
    """Each output channel's normaliser: ``a·key_pos + b·key_neg + eps`` for the same-sign channels,
    ``a·key_neg + b·key_pos + eps`` for the opposite-sign ones."""
    same = tl.sum(pos * key_pos[None, :], 1) + tl.sum(neg * key_neg[None, :], 1) + eps_row
    opposite = tl.sum(pos * key_neg[None, :], 1) + tl.sum(neg * key_pos[None, :], 1) + eps_row
    return tl.where(same_stream[None, :], same[:, None], opposite[:, None])


@triton.jit
def _power_map_backward(x, p, grad_s_times_s):
    """(grad_x, grad_p) through ``s = sign(x)|x|ᵖ`` (times any constant) given ``dL/ds · s``: ``p/x`` and
    ``ln|x|`` times it, zero at ``x = 0`` (where both derivatives vanish for ``p > 1``)."""
    nonzero = x != 0
    grad_x = tl.where(nonzero, grad_s_times_s * p / tl.where(nonzero, x, 1.0), 0.0)
    grad_p = tl.where(nonzero, grad_s_times_s * tl.log(tl.where(nonzero, tl.abs(x), 1.0)), 0.0)
    return grad_x, grad_p


@triton.jit
def _epilogue(out, local_base, gate_base, t, valid, j, stride_lt, stride_lc, stride_gt, stride_gc, DV, PREFIX,
              HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, ACC: tl.constexpr):
    """``(out + local) · gate`` of rows ``t``: the local branch on the rows from ``PREFIX`` on (its row
    ``t − PREFIX``), the gate on every row, each where given."""
    channels = (j < DV)[None, :]
    if HAS_LOCAL:
        local_rows = valid & (t >= PREFIX)
        out += tl.load(local_base + (t - PREFIX)[:, None] * stride_lt + j[None, :] * stride_lc,
                       mask=local_rows[:, None] & channels, other=0.0).to(ACC)
    if HAS_GATE:
        out *= tl.load(gate_base + t[:, None] * stride_gt + j[None, :] * stride_gc, mask=valid[:, None] & channels,
                       other=0.0).to(ACC)
    return out


@triton.jit
def _store_param_grads(base, SLOT, part, grad_power, grad_scale, p_base, s_base, stride_pc, stride_sc, alpha, D,
                       DP: tl.constexpr, POWER_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, ACC: tl.constexpr):
    """One part's per-channel gradients of the exponent (of its raw weight with ``POWER_WEIGHT``:
    ``dp/dw = α·σ(w)(1 − σ(w))``) and of the raw scale weight, from the sums of ``dL/dp`` and of ``dL/dx · x``
    over the part's (scaled) inputs x: ``dL/dw = −Σ dL/dx·x / softplus(w) · σ(w)``. The second parameter's
    parts lie ``SLOT`` entries after the first's."""
    c = tl.arange(0, DP)
    ok = c < D
    if POWER_WEIGHT:
        weight = sigmoid(tl.load(p_base + c * stride_pc, mask=ok, other=0.0).to(ACC))
        grad_power = grad_power * (alpha * weight * (1.0 - weight))
    tl.store(base + part * D + c, grad_power, mask=ok)
    if HAS_SCALE:
        weight = tl.load(s_base + c * stride_sc, mask=ok, other=0.0).to(ACC)
        tl.store(base + SLOT + part * D + c, -grad_scale * sigmoid(weight) / softplus(weight), mask=ok)


@triton.jit(do_not_specialize=["K_LEN"])
def _state_kernel(
    k_ptr, v_ptr, p_ptr, s_ptr, pos_ptr, mask_ptr, cu_k_ptr, part_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc, stride_vb, stride_vh, stride_vt, stride_vc,
    stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc, stride_xb, stride_xh, stride_xt, stride_xc,
    stride_mb, stride_mt,
    K_LEN, D, DV, HALF, alpha,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr, POWER_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_POS: tl.constexpr,
    DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """Partial state of one split of one sequence's keys. Grid: (splits, heads, sequences)."""
    split, head, seq, heads = program()
    batch, first, end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
    lo, hi = share(first, end, split, SPLITS, BLOCK)
    p, inv_scale = _channel_params(p_ptr + batch * stride_pb + head * stride_ph,
                                   s_ptr + batch * stride_sb + head * stride_sh, stride_pc, stride_sc, alpha, D, DP,
                                   POWER_WEIGHT, HAS_SCALE, ACC)
    state = _key_state(k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
                       pos_ptr + batch * stride_xb + head * stride_xh, mask_ptr + batch * stride_mb, p, inv_scale,
                       lo, hi, stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, D, DV,
                       HALF, BLOCK, DP, DVP, HAS_MASK, HAS_POS, DOT, PRECISION, ACC)
    width: tl.constexpr = 2 * DP * DVP + 3 * DP + 1
    _store_state(part_ptr + ((seq * heads + head) * SPLITS + split) * width, *state, DP, DVP)


@triton.jit(do_not_specialize=["Q_LEN", "K_LEN", "PREFIX"])
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, p_ptr, s_ptr, pos_ptr, local_ptr, gate_ptr, mask_ptr, cu_q_ptr, cu_k_ptr, part_ptr,
    state_ptr, out_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc, stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc, stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc,
    stride_xb, stride_xh, stride_xt, stride_xc, stride_lb, stride_lh, stride_lt, stride_lc,
    stride_gb, stride_gh, stride_gt, stride_gc, stride_mb, stride_mt, stride_ob, stride_oh, stride_ot, stride_oc,
    Q_LEN, K_LEN, D, DV, HALF, PREFIX, eps, alpha,
    SPANS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, SAVE_STATE: tl.constexpr, POWER_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_POS: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr,
    DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """The output of one span of one sequence's queries: the key state built here (``SPLITS == 0``) or merged
    from the state launch's partials; the first span saves it for the backward. Grid: (spans, heads, sequences)."""
    span, head, seq, heads = program()
    batch, q_first, q_end = sequence_tokens(seq, cu_q_ptr, Q_LEN, PACKED)
    p, inv_scale = _channel_params(p_ptr + batch * stride_pb + head * stride_ph,
                                   s_ptr + batch * stride_sb + head * stride_sh, stride_pc, stride_sc, alpha, D, DP,
                                   POWER_WEIGHT, HAS_SCALE, ACC)
    width: tl.constexpr = 2 * DP * DVP + 3 * DP + 1
    if SPLITS == 0:
        _, k_first, k_end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
        top, bottom, key_pos, key_neg, shift, count = _key_state(
            k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
            pos_ptr + batch * stride_xb + head * stride_xh, mask_ptr + batch * stride_mb, p, inv_scale, k_first,
            k_end, stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, D, DV, HALF, BLOCK,
            DP, DVP, HAS_MASK, HAS_POS, DOT, PRECISION, ACC)
    else:
        top, bottom, key_pos, key_neg, shift, count = _merge_partials(
            part_ptr + (seq * heads + head) * SPLITS * width, SPLITS, DP, DVP, ACC)
    inv_m = 1.0 / tl.maximum(count, 1.0)
    top, bottom, key_pos, key_neg = top * inv_m, bottom * inv_m, key_pos * inv_m, key_neg * inv_m
    if SAVE_STATE:
        if span == 0:
            _store_state(state_ptr + (seq * heads + head) * width, top, bottom, key_pos, key_neg, shift, count,
                         DP, DVP)
    c = tl.arange(0, DP)
    j = tl.arange(0, DVP)
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    o_base = out_ptr + batch * stride_ob + head * stride_oh
    local_base = local_ptr + batch * stride_lb + head * stride_lh
    gate_base = gate_ptr + batch * stride_gb + head * stride_gh
    lo, hi = share(q_first, q_end, span, SPANS, BLOCK)
    for t0 in range(lo, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        valid = t < hi
        x = _rows(q_base, t, valid, c, stride_qt, stride_qc, D, ACC) * inv_scale[None, :]
        pos, neg, row_shift = _query_features(x, p[None, :], shift)
        numerator = dot(pos, top, DOT, PRECISION, ACC)
        numerator += dot(neg, bottom, DOT, PRECISION, ACC)
        denominator = _normalisers(pos, neg, key_pos, key_neg, eps * tl.exp2(-row_shift), j < HALF)
        out = _epilogue(numerator / denominator, local_base, gate_base, t, valid, j, stride_lt, stride_lc,
                        stride_gt, stride_gc, DV, PREFIX, HAS_LOCAL, HAS_GATE, ACC)
        tl.store(o_base + t[:, None] * stride_ot + j[None, :] * stride_oc, out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (j < DV)[None, :])


@triton.jit
def _query_grads(q_base, g_base, dq_base, local_base, gate_base, dl_base, dg_base, p, inv_scale, lo, hi,
                 top, bottom, key_pos, key_neg, shift, stride_qt, stride_qc, stride_gt, stride_gc, stride_dqt,
                 stride_dqc, stride_lt, stride_lc, stride_at, stride_ac, stride_dlt, stride_dlc, stride_dgt,
                 stride_dgc, D, DV, HALF, PREFIX, eps,
                 BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, HAS_LOCAL: tl.constexpr,
                 HAS_GATE: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr,
                 ACC: tl.constexpr):
    """``grad_q`` of queries ``[lo, hi)`` (written; with a gate also its gradient and the local branch's), and
    their sums of the gradients of the state (top, bottom, key_pos, key_neg, as divided by m), of the exponent
    and of ``dL/dx · x`` for the scale. The output is recomputed from the state."""
    c = tl.arange(0, DP)
    j = tl.arange(0, DVP)
    same_stream = j < HALF
    grad_top = tl.zeros([DP, DVP], dtype=ACC)
    grad_bottom = tl.zeros([DP, DVP], dtype=ACC)
    grad_key_pos = tl.zeros([DP], dtype=ACC)
    grad_key_neg = tl.zeros([DP], dtype=ACC)
    grad_power = tl.zeros([DP], dtype=ACC)
    grad_scale = tl.zeros([DP], dtype=ACC)
    for t0 in range(lo, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        valid = t < hi
        channels = valid[:, None] & (c < D)[None, :]
        out_rows = valid[:, None] & (j < DV)[None, :]
        x = _rows(q_base, t, valid, c, stride_qt, stride_qc, D, ACC) * inv_scale[None, :]
        pos, neg, row_shift = _query_features(x, p[None, :], shift)
        numerator = dot(pos, top, DOT, PRECISION, ACC)
        numerator += dot(neg, bottom, DOT, PRECISION, ACC)
        denominator = _normalisers(pos, neg, key_pos, key_neg, eps * tl.exp2(-row_shift), same_stream)
        grad_out = tl.load(g_base + t[:, None] * stride_gt + j[None, :] * stride_gc, mask=out_rows,
                           other=0.0).to(ACC)
        if HAS_GATE:  # out = (attention + local) · gate
            gate = tl.load(gate_base + t[:, None] * stride_at + j[None, :] * stride_ac, mask=out_rows,
                           other=0.0).to(ACC)
            attended = _epilogue(numerator / denominator, local_base, gate_base, t, valid, j, stride_lt, stride_lc,
                                 stride_at, stride_ac, DV, PREFIX, HAS_LOCAL, False, ACC)
            tl.store(dg_base + t[:, None] * stride_dgt + j[None, :] * stride_dgc,
                     (grad_out * attended).to(dg_base.dtype.element_ty), mask=out_rows)
            grad_out = grad_out * gate
            if HAS_LOCAL:
                tl.store(dl_base + (t - PREFIX)[:, None] * stride_dlt + j[None, :] * stride_dlc,
                         grad_out.to(dl_base.dtype.element_ty), mask=out_rows & (t >= PREFIX)[:, None])
        # d(numerator) = dO / z; d(z) = -Σ dO·O / z over each stream's channels. The shifts are constants:
        # the output does not depend on them.
        grad_num = grad_out / denominator
        grad_den = grad_num * (numerator / denominator)
        grad_same = -tl.sum(tl.where(same_stream[None, :], grad_den, 0.0), 1)
        grad_opposite = -tl.sum(tl.where(same_stream[None, :], 0.0, grad_den), 1)
        grad_pos = dot(grad_num, tl.trans(top), GRAD_DOT, PRECISION, ACC)
        grad_pos += grad_same[:, None] * key_pos[None, :] + grad_opposite[:, None] * key_neg[None, :]
        grad_neg = dot(grad_num, tl.trans(bottom), GRAD_DOT, PRECISION, ACC)
        grad_neg += grad_same[:, None] * key_neg[None, :] + grad_opposite[:, None] * key_pos[None, :]
        grad_x, grad_p = _power_map_backward(x, p[None, :], grad_pos * pos + grad_neg * neg)
        tl.store(dq_base + t[:, None] * stride_dqt + c[None, :] * stride_dqc,
                 (grad_x * inv_scale[None, :]).to(dq_base.dtype.element_ty), mask=channels)
        grad_power += tl.sum(grad_p, 0)
        grad_scale += tl.sum(grad_x * x, 0)
        grad_top += dot(tl.trans(pos), grad_num, GRAD_DOT, PRECISION, ACC)
        grad_bottom += dot(tl.trans(neg), grad_num, GRAD_DOT, PRECISION, ACC)
        grad_key_pos += tl.sum(pos * grad_same[:, None] + neg * grad_opposite[:, None], 0)
        grad_key_neg += tl.sum(neg * grad_same[:, None] + pos * grad_opposite[:, None], 0)
    return grad_top, grad_bottom, grad_key_pos, grad_key_neg, grad_power, grad_scale


@triton.jit
def _key_grads(k_base, v_base, pos_base, mask_base, dk_base, dv_base, p, inv_scale, lo, hi, shift, inv_m,
               grad_top, grad_bottom, grad_key_pos, grad_key_neg,
               stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, stride_dkt, stride_dkc,
               stride_dvt, stride_dvc, D, DV, HALF, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
               HAS_MASK: tl.constexpr, HAS_POS: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr,
               ACC: tl.constexpr):
    """``grad_k`` (also the positions' per row) and ``grad_v`` of keys ``[lo, hi)`` (written; zero at padded
    keys) from the state's gradient, and their sums of the exponent's gradient and of ``dL/dx · x``. Features
    are recomputed with the state's shift."""
    c = tl.arange(0, DP)
    j = tl.arange(0, DVP)
    same_stream = (j < HALF)[None, :]
    # Route the gradient back to the unrouted sums Σ aᵀv and Σ bᵀv, through the division by m.
    grad_state_pos = tl.where(same_stream, grad_top, grad_bottom) * inv_m
    grad_state_neg = tl.where(same_stream, grad_bottom, grad_top) * inv_m
    grad_key_pos = grad_key_pos * inv_m
    grad_key_neg = grad_key_neg * inv_m
    grad_power = tl.zeros([DP], dtype=ACC)
    grad_scale = tl.zeros([DP], dtype=ACC)
    for t0 in range(lo, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        valid = t < hi
        keep = unpadded_keys(mask_base, t, valid, stride_mt, HAS_MASK)
        x = _keys(k_base, pos_base, t, keep, c, stride_kt, stride_kc, stride_xt, stride_xc, inv_scale, D, HAS_POS,
                  ACC)
        values = tl.load(v_base + t[:, None] * stride_vt + j[None, :] * stride_vc,
                         mask=keep[:, None] & (j < DV)[None, :], other=0.0).to(ACC)
        exponent, used = _log_magnitude(x, p[None, :])
        pos, neg = _halves(x, tl.exp2(exponent - shift[None, :]), used)
        grad_values = dot(pos, grad_state_pos, GRAD_DOT, PRECISION, ACC)
        grad_values += dot(neg, grad_state_neg, GRAD_DOT, PRECISION, ACC)
        tl.store(dv_base + t[:, None] * stride_dvt + j[None, :] * stride_dvc,
                 grad_values.to(dv_base.dtype.element_ty), mask=valid[:, None] & (j < DV)[None, :])
        grad_pos = dot(values, tl.trans(grad_state_pos), GRAD_DOT, PRECISION, ACC)
        grad_pos += grad_key_pos[None, :]
        grad_neg = dot(values, tl.trans(grad_state_neg), GRAD_DOT, PRECISION, ACC)
        grad_neg += grad_key_neg[None, :]
        grad_x, grad_p = _power_map_backward(x, p[None, :], grad_pos * pos + grad_neg * neg)
        tl.store(dk_base + t[:, None] * stride_dkt + c[None, :] * stride_dkc,
                 (grad_x * inv_scale[None, :]).to(dk_base.dtype.element_ty), mask=valid[:, None] & (c < D)[None, :])
        grad_power += tl.sum(grad_p, 0)
        grad_scale += tl.sum(grad_x * x, 0)
    return grad_power, grad_scale


@triton.jit(do_not_specialize=["Q_LEN", "K_LEN", "PREFIX", "SLOT"])
def _backward_kernel(
    q_ptr, k_ptr, v_ptr, p_ptr, s_ptr, pos_ptr, local_ptr, gate_ptr, mask_ptr, cu_q_ptr, cu_k_ptr, state_ptr,
    grad_out_ptr, grad_q_ptr, grad_k_ptr, grad_v_ptr, grad_local_ptr, grad_gate_ptr, grad_part_ptr, grad_param_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc, stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc, stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc,
    stride_xb, stride_xh, stride_xt, stride_xc, stride_lb, stride_lh, stride_lt, stride_lc,
    stride_ab, stride_ah, stride_at, stride_ac, stride_mb, stride_mt, stride_gb, stride_gh, stride_gt, stride_gc,
    stride_dqb, stride_dqh, stride_dqt, stride_dqc, stride_dkb, stride_dkh, stride_dkt, stride_dkc,
    stride_dvb, stride_dvh, stride_dvt, stride_dvc, stride_dlb, stride_dlh, stride_dlt, stride_dlc,
    stride_dgb, stride_dgh, stride_dgt, stride_dgc,
    Q_LEN, K_LEN, D, DV, HALF, PREFIX, SLOT, eps, alpha,
    SPANS: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, POWER_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, DOT: tl.constexpr,
    GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """The query side of the backward for one span of one sequence's queries; with one span (``SPANS == 1``)
    the key side too, from the state's gradient held in registers. Otherwise the span's partial gradient of
    the state is stored for :func:`_key_grad_kernel`. Grid: (spans, heads, sequences)."""
    span, head, seq, heads = program()
    batch, q_first, q_end = sequence_tokens(seq, cu_q_ptr, Q_LEN, PACKED)
    p_base = p_ptr + batch * stride_pb + head * stride_ph
    s_base = s_ptr + batch * stride_sb + head * stride_sh
    p, inv_scale = _channel_params(p_base, s_base, stride_pc, stride_sc, alpha, D, DP, POWER_WEIGHT, HAS_SCALE, ACC)
    width: tl.constexpr = 2 * DP * DVP + 3 * DP + 1
    top, bottom, key_pos, key_neg, shift, inv_m = _load_state(state_ptr + (seq * heads + head) * width, DP, DVP)
    lo, hi = share(q_first, q_end, span, SPANS, BLOCK)
    grad_top, grad_bottom, grad_key_pos, grad_key_neg, grad_power, grad_scale = _query_grads(
        q_ptr + batch * stride_qb + head * stride_qh, grad_out_ptr + batch * stride_gb + head * stride_gh,
        grad_q_ptr + batch * stride_dqb + head * stride_dqh, local_ptr + batch * stride_lb + head * stride_lh,
        gate_ptr + batch * stride_ab + head * stride_ah, grad_local_ptr + batch * stride_dlb + head * stride_dlh,
        grad_gate_ptr + batch * stride_dgb + head * stride_dgh, p, inv_scale, lo, hi, top, bottom, key_pos,
        key_neg, shift, stride_qt, stride_qc, stride_gt, stride_gc, stride_dqt, stride_dqc, stride_lt, stride_lc,
        stride_at, stride_ac, stride_dlt, stride_dlc, stride_dgt, stride_dgc, D, DV, HALF, PREFIX, eps,
        BLOCK, DP, DVP, HAS_LOCAL, HAS_GATE, DOT, GRAD_DOT, PRECISION, ACC)
    c = tl.arange(0, DP)
    if SPANS == 1:
        _, k_first, k_end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
        grad_power_k, grad_scale_k = _key_grads(
            k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
            pos_ptr + batch * stride_xb + head * stride_xh, mask_ptr + batch * stride_mb,
            grad_k_ptr + batch * stride_dkb + head * stride_dkh, grad_v_ptr + batch * stride_dvb + head * stride_dvh,
            p, inv_scale, k_first, k_end, shift, inv_m, grad_top, grad_bottom, grad_key_pos, grad_key_neg,
            stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, stride_dkt, stride_dkc,
            stride_dvt, stride_dvc, D, DV, HALF, BLOCK, DP, DVP, HAS_MASK, HAS_POS, GRAD_DOT, PRECISION, ACC)
        grad_power += grad_power_k
        grad_scale += grad_scale_k
    else:
        grad_width: tl.constexpr = 2 * DP * DVP + 2 * DP
        base = grad_part_ptr + ((seq * heads + head) * SPANS + span) * grad_width
        cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
        tl.store(base + cell, grad_top)
        tl.store(base + DP * DVP + cell, grad_bottom)
        tl.store(base + 2 * DP * DVP + c, grad_key_pos)
        tl.store(base + 2 * DP * DVP + DP + c, grad_key_neg)
    _store_param_grads(grad_param_ptr + (seq * heads + head) * PARTS * D, SLOT, span, grad_power, grad_scale, p_base,
                       s_base, stride_pc, stride_sc, alpha, D, DP, POWER_WEIGHT, HAS_SCALE, ACC)


@triton.jit(do_not_specialize=["K_LEN", "SLOT"])
def _key_grad_kernel(
    k_ptr, v_ptr, p_ptr, s_ptr, pos_ptr, mask_ptr, cu_k_ptr, state_ptr, grad_part_ptr, grad_k_ptr, grad_v_ptr,
    grad_param_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc, stride_vb, stride_vh, stride_vt, stride_vc,
    stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc, stride_xb, stride_xh, stride_xt, stride_xc,
    stride_mb, stride_mt, stride_dkb, stride_dkh, stride_dkt, stride_dkc, stride_dvb, stride_dvh, stride_dvt,
    stride_dvc,
    K_LEN, D, DV, HALF, SLOT, alpha,
    SPANS: tl.constexpr, SPLITS: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    DP: tl.constexpr, DVP: tl.constexpr, PACKED: tl.constexpr, HAS_MASK: tl.constexpr, POWER_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_POS: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr,
    PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """The key side of the backward for one split of one sequence's keys, from the query spans' partial
    gradients of the state (added in span order). Grid: (splits, heads, sequences)."""
    split, head, seq, heads = program()
    batch, first, end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
    p_base = p_ptr + batch * stride_pb + head * stride_ph
    s_base = s_ptr + batch * stride_sb + head * stride_sh
    p, inv_scale = _channel_params(p_base, s_base, stride_pc, stride_sc, alpha, D, DP, POWER_WEIGHT, HAS_SCALE, ACC)
    width: tl.constexpr = 2 * DP * DVP + 3 * DP + 1
    _, _, _, _, shift, inv_m = _load_state(state_ptr + (seq * heads + head) * width, DP, DVP)
    c = tl.arange(0, DP)
    cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
    grad_width: tl.constexpr = 2 * DP * DVP + 2 * DP
    grad_top = tl.zeros([DP, DVP], dtype=ACC)
    grad_bottom = tl.zeros([DP, DVP], dtype=ACC)
    grad_key_pos = tl.zeros([DP], dtype=ACC)
    grad_key_neg = tl.zeros([DP], dtype=ACC)
    for span in range(SPANS):
        base = grad_part_ptr + ((seq * heads + head) * SPANS + span) * grad_width
        grad_top += tl.load(base + cell)
        grad_bottom += tl.load(base + DP * DVP + cell)
        grad_key_pos += tl.load(base + 2 * DP * DVP + c)
        grad_key_neg += tl.load(base + 2 * DP * DVP + DP + c)
    lo, hi = share(first, end, split, SPLITS, BLOCK)
    grad_power, grad_scale = _key_grads(
        k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
        pos_ptr + batch * stride_xb + head * stride_xh, mask_ptr + batch * stride_mb,
        grad_k_ptr + batch * stride_dkb + head * stride_dkh, grad_v_ptr + batch * stride_dvb + head * stride_dvh,
        p, inv_scale, lo, hi, shift, inv_m, grad_top, grad_bottom, grad_key_pos, grad_key_neg,
        stride_kt, stride_kc, stride_vt, stride_vc, stride_xt, stride_xc, stride_mt, stride_dkt, stride_dkc,
        stride_dvt, stride_dvc, D, DV, HALF, BLOCK, DP, DVP, HAS_MASK, HAS_POS, GRAD_DOT, PRECISION, ACC)
    _store_param_grads(grad_param_ptr + (seq * heads + head) * PARTS * D, SLOT, SPANS + split, grad_power,
                       grad_scale, p_base, s_base, stride_pc, stride_sc, alpha, D, DP, POWER_WEIGHT, HAS_SCALE, ACC)


def _as_is(kernel):
    return kernel


def _strides(t: torch.Tensor | None, dims: int = 4) -> tuple[int, ...]:
    return (0,) * dims if t is None else tuple(t.stride())


class _Call:
    """Sizes, compile-time switches and the launch plan of one call, shared by its forward and backward, and
    the per-channel parameters as (B, H, d) views with their own strides (no copy per call)."""

    def __init__(self, q, k, v, power, key_padding_mask, cu_seqlens, cu_seqlens_k, alpha=None, scale=None,
                 key_positions=None, local=None, gate=None):
        self.packed = cu_seqlens is not None
        batch, self.heads, self.q_len, self.d = q.shape
        self.k_len, self.dv = k.shape[-2], v.shape[-1]
        self.half = (self.dv + 1) // 2
        self.sequences = cu_seqlens.shape[0] - 1 if self.packed else batch
        self.dp, self.dvp = padded_width(self.d), padded_width(self.dv)
        self.width = 2 * self.dp * self.dvp + 3 * self.dp + 1
        self.acc = accumulator_dtype(q, k, v, power)
        self.tl_acc = tl.float64 if self.acc == torch.float64 else tl.float32
        self.dots = dots(q, k, v)
        block, self.warps = pola_tile(self.dp, self.dvp, q.is_cuda)
        per_sequence = max(self.sequences, 1)
        self.plan = plan(self.sequences, self.heads, -(-self.q_len // per_sequence) if self.packed else self.q_len,
                         -(-self.k_len // per_sequence) if self.packed else self.k_len, block, q.device)
        self.alpha = 0.0 if alpha is None else float(alpha)  # given: ``power`` is the exponent's raw weight
        self.power_weight = alpha is not None
        self.shapes = tuple(None if t is None else t.shape for t in (power, scale, key_positions))
        self.power = power.expand(batch, self.heads, 1, self.d)[:, :, 0]
        self.scale = None if scale is None else scale.expand(batch, self.heads, 1, self.d)[:, :, 0]
        self.positions = None if key_positions is None else key_positions.expand(batch, self.heads, self.k_len,
                                                                                 self.d)
        self.local, self.gate = local, gate
        self.prefix = 0 if local is None else self.q_len - local.shape[-2]  # queries without a local term
        self.mask = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
        self.cu_q = cu_seqlens
        self.cu_k = (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k) if self.packed else None

    def grid(self, programs: int):
        return programs, self.heads, self.sequences

    def constants(self):
        return dict(BLOCK=self.plan.block, DP=self.dp, DVP=self.dvp, PACKED=self.packed,
                    HAS_MASK=self.mask is not None, POWER_WEIGHT=self.power_weight, HAS_SCALE=self.scale is not None,
                    HAS_POS=self.positions is not None, ACC=self.tl_acc, num_warps=self.warps,
                    **self.dots.constants())

    def epilogue(self):
        return dict(HAS_LOCAL=self.local is not None, HAS_GATE=self.gate is not None)

    def parameters(self, like):
        """The exponent, scale and key positions, a stand-in (never read) for the absent, and their strides."""
        stand_in = lambda t: like if t is None else t  # noqa: E731
        return ((self.power, stand_in(self.scale), stand_in(self.positions)),
                (*self.power.stride(), *_strides(self.scale, 3), *_strides(self.positions)))

    def pointers(self, like):
        """Stand-ins for the absent mask and offsets: never read, one dummy pointer each."""
        return (like if self.mask is None else self.mask, like if self.cu_q is None else self.cu_q,
                like if self.cu_k is None else self.cu_k)


def pola_forward(q, k, v, power, eps, key_padding_mask=None, cu_seqlens=None, cu_seqlens_k=None, out=None,
                 save_state=True, *, alpha=None, scale=None, key_positions=None, local=None, gate=None, traced=False):
    """Run the forward kernel(s); returns ``(out, state, call)``, ``state`` (sequences, heads, width) holding
    each sequence's state for the backward when ``save_state``. ``out`` (B, H, N, dv), any strides, is written
    in place when given. ``traced``: launched as a registered op's body
    (:func:`polaformer.backends.triton.common.traceable`). Arguments are assumed checked by the op
    (:func:`pola_attention`'s)."""
    launch = traceable if traced else _as_is
    call = _Call(q, k, v, power, key_padding_mask, cu_seqlens, cu_seqlens_k, alpha, scale, key_positions, local,
                 gate)
    if out is None:  # (B, H, N, dv) over (B, N, H, dv) memory, as the torch formulation returns it
        out = v.new_empty(v.shape[0], call.q_len, call.heads, call.dv).transpose(1, 2)
    state = q.new_empty((call.sequences, call.heads, call.width) if save_state else (0,), dtype=call.acc)
    mask, cu_q, cu_k = call.pointers(q)
    params, param_strides = call.parameters(q)
    splits = call.plan.key_splits
    partials = q.new_empty(0, dtype=call.acc)
    if splits:
        partials = q.new_empty(call.sequences, call.heads, splits, call.width, dtype=call.acc)
        launch(_state_kernel)[call.grid(splits)](
            k, v, *params, mask, cu_k, partials, *k.stride(), *v.stride(), *param_strides, *_strides(call.mask, 2),
            call.k_len, call.d, call.dv, call.half, call.alpha, SPLITS=splits, **call.constants())
    launch(_forward_kernel)[call.grid(call.plan.query_spans)](
        q, k, v, *params, q if local is None else local, q if gate is None else gate, mask, cu_q, cu_k, partials,
        state, out, *q.stride(), *k.stride(), *v.stride(), *param_strides, *_strides(local), *_strides(gate),
        *_strides(call.mask, 2), *out.stride(), call.q_len, call.k_len, call.d, call.dv, call.half, call.prefix, eps,
        call.alpha, SPANS=call.plan.query_spans, SPLITS=splits, SAVE_STATE=save_state, **call.epilogue(),
        **call.constants())
    return out, state, call


def pola_backward(call, q, k, v, power, state, eps, grad_out, grad_q=None, grad_k=None, grad_v=None, *,
                  traced=False):
    """Run the backward kernel(s); returns the gradients of ``(q, k, v, power, scale, key_positions, local,
    gate)``, None for the parameters the call did not have, writing into the given gradient buffers (any
    strides) where passed. The exponent's and scale's gradients have their shapes, in fp32 (fp64); with
    ``alpha`` the exponent's is that of its raw weight. ``traced`` as :func:`pola_forward`'s."""
    launch = traceable if traced else _as_is
    grad_q = torch.empty_like(q) if grad_q is None else grad_q
    grad_k = torch.empty_like(k) if grad_k is None else grad_k
    grad_v = torch.empty_like(v) if grad_v is None else grad_v
    local, gate = call.local, call.gate
    grad_local = grad_gate = None
    if gate is not None:  # as the attention's output: (B, H, N, dv) over (B, N, H, dv) memory
        grad_gate = gate.new_empty(gate.shape[0], call.q_len, call.heads, call.dv).transpose(1, 2)
        if local is not None:
            grad_local = torch.empty_like(local)
    elif local is not None:  # (out + local)'s gradient is the output's
        grad_local = grad_out[:, :, call.prefix:]
    spans, splits = call.plan.backward_spans, call.plan.backward_key_splits
    parts = spans + splits
    grad_param = q.new_empty(1 if call.scale is None else 2, call.sequences, call.heads, parts, call.d, dtype=call.acc)
    mask, cu_q, cu_k = call.pointers(q)
    params, param_strides = call.parameters(q)
    grad_partials = q.new_empty(0, dtype=call.acc)
    if spans > 1:
        grad_partials = q.new_empty(call.sequences, call.heads, spans, 2 * call.dp * call.dvp + 2 * call.dp,
                                    dtype=call.acc)
    slot = grad_param[0].numel()
    launch(_backward_kernel)[call.grid(spans)](
        q, k, v, *params, q if local is None else local, q if gate is None else gate, mask, cu_q, cu_k, state,
        grad_out, grad_q, grad_k, grad_v, q if grad_local is None else grad_local,
        q if grad_gate is None else grad_gate, grad_partials, grad_param, *q.stride(), *k.stride(), *v.stride(),
        *param_strides, *_strides(local), *_strides(gate), *_strides(call.mask, 2), *grad_out.stride(),
        *grad_q.stride(), *grad_k.stride(), *grad_v.stride(), *_strides(grad_local), *_strides(grad_gate),
        call.q_len, call.k_len, call.d, call.dv, call.half, call.prefix, slot, eps, call.alpha, SPANS=spans,
        PARTS=parts, **call.epilogue(), **call.constants())
    if spans > 1:
        launch(_key_grad_kernel)[call.grid(splits)](
            k, v, *params, mask, cu_k, state, grad_partials, grad_k, grad_v, grad_param, *k.stride(), *v.stride(),
            *param_strides, *_strides(call.mask, 2), *grad_k.stride(), *grad_v.stride(), call.k_len, call.d,
            call.dv, call.half, slot, call.alpha, SPANS=spans, SPLITS=splits, PARTS=parts, **call.constants())
    grad_power, grad_scale = _parameter_grads(grad_param, call.shapes[:2])
    grad_positions = None if call.positions is None else _summed_to(grad_k, call.shapes[2])
    return grad_q, grad_k, grad_v, grad_power, grad_scale, grad_positions, grad_local, grad_gate


def _broadcast_dims(shape, full) -> list[int]:
    """The dimensions of ``full`` along which a tensor of ``shape`` (as many dimensions or fewer) broadcasts."""
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    return [axis for axis, (n, m) in enumerate(zip(shape, full)) if n == 1 and m > 1]


def _summed_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """``grad`` summed over the dimensions a tensor of ``shape`` broadcasts along (the key positions')."""
    dims = _broadcast_dims(shape, grad.shape)
    return (grad.sum(dims, keepdim=True) if dims else grad.clone()).reshape(shape)


def _parameter_grads(parts: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(parameters, sequences, heads, parts, d) partial gradients of the exponent (and the scale) → each
    parameter's shape (broadcastable to (B, H, 1, d)), summed over the parts and the axes it broadcasts along:
    one reduction for both where their shapes match, none where the work was whole and nothing is broadcast."""
    full = (parts.shape[1], parts.shape[2], parts.shape[3], parts.shape[4])  # (B, H, parts in place of 1, d)
    dims = [[axis + 1 for axis in _broadcast_dims(shape, full)] for shape in shapes if shape is not None]
    if len(dims) == 2 and dims[0] == dims[1]:
        summed = parts.sum(dims[0], keepdim=True) if dims[0] else parts
        return summed[0].reshape(shapes[0]), summed[1].reshape(shapes[1])
    grads = [(parts[i].sum([d - 1 for d in dims[i]], keepdim=True) if dims[i] else parts[i]).reshape(shape)
             for i, shape in enumerate(s for s in shapes if s is not None)]
    return grads[0], (grads[1] if len(grads) > 1 else None)


class PolaAttention(torch.autograd.Function):
    """The fused op with the backward kernels, for eager calls; inputs already checked by the ops
    (:func:`polaformer.ops.pola_linear_attention`, :func:`polaformer.ops.pola_layer_attention`). Differentiable
    once: a second differentiation (a gradient penalty through ``create_graph=True``) raises instead of returning
    gradients that ignore the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, power, scale, key_positions, local, gate, eps, alpha, key_padding_mask, cu_seqlens,
                cu_seqlens_k):
        out, state, call = pola_forward(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k,
                                        alpha=alpha, scale=scale, key_positions=key_positions, local=local, gate=gate)
        ctx.save_for_backward(q, k, v, power, scale, key_positions, local, gate, state)
        ctx.call, ctx.eps = call, eps
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, power, scale, key_positions, local, gate, state = ctx.saved_tensors
        grads = pola_backward(ctx.call, q, k, v, power, state, ctx.eps, grad_out)
        inputs = (q, k, v, power, scale, key_positions, local, gate)
        grads = [None if grad is None or not needed else grad.to(leaf.dtype)
                 for grad, needed, leaf in zip(grads, ctx.needs_input_grad, inputs)]
        return (*grads, None, None, None, None, None)


# The op as torch.compile sees it: an operator whose body launches the kernels through ``wrap_triton`` (its
# shapes come from tracing that body with fake tensors) and its backward a second one, so the compiled graph
# holds the kernels themselves: inductor plans their buffers, fuses the ops around them, and CUDA graphs capture
# them. Eager calls skip the operator's dispatch, which costs several times a small launch.
@torch.library.triton_op("polaformer::pola_attention", mutates_args=())
def _pola_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor, scale: torch.Tensor | None,
             key_positions: torch.Tensor | None, local: torch.Tensor | None, gate: torch.Tensor | None, eps: float,
             alpha: float | None, key_padding_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
             cu_seqlens_k: torch.Tensor | None, save_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, state, _ = pola_forward(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k,
                                 save_state=save_state, alpha=alpha, scale=scale, key_positions=key_positions,
                                 local=local, gate=gate, traced=True)
    return out, state


@torch.library.triton_op("polaformer::pola_attention_backward", mutates_args=())
def _pola_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor,
                      scale: torch.Tensor | None, key_positions: torch.Tensor | None, local: torch.Tensor | None,
                      gate: torch.Tensor | None, state: torch.Tensor, eps: float, alpha: float | None,
                      key_padding_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                      cu_seqlens_k: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients of q, k, v and the exponent, then those of the scale, the key positions, the local branch
    and the gate where given (without a gate, the caller takes the local branch's from the output's)."""
    call = _Call(q, k, v, power, key_padding_mask, cu_seqlens, cu_seqlens_k, alpha, scale, key_positions, local,
                 gate)
    grads = pola_backward(call, q, k, v, power, state, eps, grad_out, traced=True)
    grad_q, grad_k, grad_v, grad_power, grad_scale, grad_positions, grad_local, grad_gate = grads
    # an operator's outputs own their memory (the parameters' gradients may be views of a partial-sum buffer)
    present = [grad_q, grad_k, grad_v, grad_power.to(power.dtype, copy=True)]
    if scale is not None:
        present.append(grad_scale.to(scale.dtype, copy=True))
    if key_positions is not None:
        present.append(grad_positions.to(key_positions.dtype))
    if gate is not None:
        present += ([grad_local] if local is not None else []) + [grad_gate]
    return present


def _pola_op_setup(ctx, inputs, output):
    q, k, v, power, scale, key_positions, local, gate, eps, alpha, key_padding_mask, cu_seqlens, cu_seqlens_k, _ = \
        inputs
    ctx.save_for_backward(q, k, v, power, scale, key_positions, local, gate, output[1], key_padding_mask, cu_seqlens,
                          cu_seqlens_k)
    ctx.eps, ctx.alpha = eps, alpha


def _pola_op_backward(ctx, grad_out, _grad_state):
    q, k, v, power, scale, key_positions, local, gate, state, key_padding_mask, cu_seqlens, cu_seqlens_k = \
        ctx.saved_tensors
    present = iter(_pola_backward_op(grad_out, q, k, v, power, scale, key_positions, local, gate, state, ctx.eps,
                                     ctx.alpha, key_padding_mask, cu_seqlens, cu_seqlens_k))
    grad_q, grad_k, grad_v, grad_power = (next(present) for _ in range(4))
    grad_scale = None if scale is None else next(present)
    grad_positions = None if key_positions is None else next(present)
    grad_local = grad_gate = None
    if gate is not None:
        grad_local = None if local is None else next(present)
        grad_gate = next(present)
    elif local is not None:
        grad_local = grad_out[:, :, q.shape[2] - local.shape[-2]:]
    grads = (grad_q, grad_k, grad_v, grad_power, grad_scale, grad_positions, grad_local, grad_gate)
    return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)),
            None, None, None, None, None, None)


_pola_op.register_autograd(_pola_op_backward, setup_context=_pola_op_setup)


def pola_attention(q, k, v, power, eps, key_padding_mask=None, cu_seqlens=None, cu_seqlens_k=None, *, alpha=None,
                   scale=None, key_positions=None, local=None, gate=None):
    """The Triton path of :func:`polaformer.ops.pola_linear_attention` and, with the layer's raw parameters, of
    :func:`polaformer.ops.pola_layer_attention` (arguments checked there): ``alpha`` given, ``power`` is the
    exponent's raw weight (``p = 1 + α·sigmoid(power)``); ``scale`` the raw scale weight (q and k divided by its
    softplus); ``key_positions`` added to the keys first; the output ``(attention + local) · gate``, ``local``
    covering the last queries. Output in ``v``'s dtype, gradients for every tensor that requires them."""
    tensors = (q, k, v, power, scale, key_positions, local, gate)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if torch.compiler.is_compiling():
        return _pola_op(*tensors, eps, alpha, key_padding_mask, cu_seqlens, cu_seqlens_k, needs_grad)[0]
    if needs_grad:
        return PolaAttention.apply(*tensors, eps, alpha, key_padding_mask, cu_seqlens, cu_seqlens_k)
    return pola_forward(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k, save_state=False,
                        alpha=alpha, scale=scale, key_positions=key_positions, local=local, gate=gate)[0]
