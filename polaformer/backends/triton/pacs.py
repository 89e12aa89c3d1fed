"""Triton kernels of PolaFormer++'s PaCS attention (:func:`polaformer.ops.pacs_linear_attention`), forward and
backward, for padded batches (with an optional key padding mask) and packed variable-length batches.

The math per (sequence, head), for the same-sign stream ``s`` (value half 0) and the opposite-sign stream ``o``
(value half 1), with ``a = relu(q)``, ``b = relu(-q)`` and the key features ``φk = exp([k⁺ ; k⁻]) − 1``::

    φ_s = exp([a ; b] ⊙ T_same) − 1        φ_o = exp([b ; a] ⊙ T_opp) − 1
    kv  = R(φk)ᵀ v / M                     k̄ = Σ φk / M          (the state, M = number of valid keys)
    out = R(φ)·kv[:, half] / (φ·k̄ + eps)   per stream

``R`` is RoPE on the numerator (identity without tables). The opposite stream is formed by routing ``b``
and ``a`` to the halves in registers; no feature or swapped copy is written to memory.

Layout. A 2d-wide feature vector is held as four blocks of ``P = ⌈d/2⌉`` channels, block ``(h, e)`` holding
channel ``h·d + 2c + e`` (h: positive|negative half, e: even|odd channel). RoPE pairs are (2c, 2c+1), so the
rotation is elementwise between the even and odd blocks. Blocks are padded to powers of two (at least 16, the
smallest ``tl.dot`` operand) with masks. The state (``kv``: value half × block × P × dv/2, ``k̄``: block × P)
lives in padded fp32 buffers (fp64 for fp64 inputs), never rounded to the input dtype.

Numerics. Each query row of each stream is divided by ``2^⌊log2 max(1, max φ)⌋`` (``eps`` with it): exact in
floating point, as in the op's torch formulation, and it bounds the products by ``2·2d·max|kv|``. Features are
computed in the accumulation dtype with an ``exp(x) − 1`` that keeps its relative accuracy near 0.

Determinism. The reductions over tokens (the state and the gradients of the state and the temperatures) run
in a fixed number of programs per sequence over a fixed share of its tiles, and the partial results are
summed by torch in a fixed order: no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import padded_width

__all__ = ["pacs_attention"]

# Tokens per tile of every kernel; the most programs that share one sequence's reduction, and the number of
# programs past which more splits only add partial results to store and sum.
_BLOCK_TOKENS = 32
_MAX_SPLITS = 16
_ENOUGH_PROGRAMS = 1024


@triton.jit
def _find_sequence(cu_seqlens, num_seqs, token):
    """The sequence that holds packed token ``token``: the last ``s`` with ``cu_seqlens[s] <= token``."""
    lo = token * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens + mid) <= token
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _sequence_span(cu_seqlens, s, length, VARLEN: tl.constexpr):
    """Token range ``[lo, hi)`` of sequence ``s`` and the batch index its tensors are addressed with."""
    if VARLEN:
        return tl.load(cu_seqlens + s), tl.load(cu_seqlens + s + 1), s * 0
    else:
        return 0, length, s


@triton.jit
def _load_pairs(base, rows, row_ok, row_stride, c, d, ACC: tl.constexpr):
    """Channels 2c and 2c+1 of the given rows (zeros outside), in the accumulation dtype."""
    ptr = base + rows[:, None].to(tl.int64) * row_stride + 2 * c[None, :]
    even = tl.load(ptr, mask=row_ok[:, None] & (2 * c < d)[None, :], other=0.0)
    odd = tl.load(ptr + 1, mask=row_ok[:, None] & (2 * c + 1 < d)[None, :], other=0.0)
    return even.to(ACC), odd.to(ACC)


@triton.jit
def _store_pairs(base, rows, row_ok, row_stride, c, d, even, odd):
    ptr = base + rows[:, None].to(tl.int64) * row_stride + 2 * c[None, :]
    tl.store(ptr, even, mask=row_ok[:, None] & (2 * c < d)[None, :])
    tl.store(ptr + 1, odd, mask=row_ok[:, None] & (2 * c + 1 < d)[None, :])


@triton.jit
def _load_blocks(base, rows, row_ok, row_stride, c, d, ACC: tl.constexpr):
    """The four blocks (h, e) of a 2d-wide row vector: (pos even, pos odd, neg even, neg odd)."""
    pe, po = _load_pairs(base, rows, row_ok, row_stride, c, d, ACC)
    ne, no = _load_pairs(base + d, rows, row_ok, row_stride, c, d, ACC)
    return pe, po, ne, no


@triton.jit
def _load_temperatures(base, c, d, ACC: tl.constexpr):
    """The four blocks of one (2d,) temperature vector, as (1, P) rows."""
    ch = 2 * c
    pe = tl.load(base + ch, mask=ch < d, other=0.0).to(ACC)
    po = tl.load(base + ch + 1, mask=ch + 1 < d, other=0.0).to(ACC)
    ne = tl.load(base + d + ch, mask=ch < d, other=0.0).to(ACC)
    no = tl.load(base + d + ch + 1, mask=ch + 1 < d, other=0.0).to(ACC)
    return pe[None, :], po[None, :], ne[None, :], no[None, :]


@triton.jit
def _rotate(x_even, x_odd, cos_even, cos_odd, sin_even, sin_odd):
    """RoPE on one half: pairs (E, O) -> (E·cos − O·sin, O·cos + E·sin)."""
    return x_even * cos_even - x_odd * sin_even, x_odd * cos_odd + x_even * sin_odd


@triton.jit
def _rotate_transposed(y_even, y_odd, cos_even, cos_odd, sin_even, sin_odd):
    """The transpose of :func:`_rotate` (the gradient's way back)."""
    return y_even * cos_even + y_odd * sin_odd, y_odd * cos_odd - y_even * sin_even


@triton.jit
def _expm1(x):
    """``exp(x) − 1`` without the cancellation near 0 (Kahan's ``(u − 1)·x / log u``, with ``u = exp(x)``)."""
    u = tl.exp(x)
    log_u = tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, (u - 1.0) * (x / log_u)))


@triton.jit
def _exp_features(x_pe, x_po, x_ne, x_no, t_pe, t_po, t_ne, t_no):
    """``exp(x ⊙ T) − 1`` on four blocks."""
    return (_expm1(x_pe * t_pe), _expm1(x_po * t_po),
            _expm1(x_ne * t_ne), _expm1(x_no * t_no))


@triton.jit
def _row_scale(f_pe, f_po, f_ne, f_no):
    """Per row ``2^-⌊log2 max(1, max φ)⌋``: a power of two, so scaling by it is exact."""
    top = tl.maximum(tl.maximum(tl.max(f_pe, 1), tl.max(f_po, 1)), tl.maximum(tl.max(f_ne, 1), tl.max(f_no, 1)))
    return tl.exp2(-tl.floor(tl.log2(tl.maximum(top, 1.0))))


@triton.jit
def _load_state_tile(base, block, c, j, P_PAD: tl.constexpr, DVH_PAD: tl.constexpr):
    return tl.load(base + (block * P_PAD + c[:, None]) * DVH_PAD + j[None, :])


@triton.jit
def _store_state_tile(base, block, c, j, value, P_PAD: tl.constexpr, DVH_PAD: tl.constexpr):
    tl.store(base + (block * P_PAD + c[:, None]) * DVH_PAD + j[None, :], value)


@triton.jit
def _state_kernel(
    k, v, key_mask, cu_k, cos, sin, kv_part, km_part,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mb, stride_table,
    heads, keys, d, dvh, splits,
    HAS_MASK: tl.constexpr, VARLEN: tl.constexpr, ROPE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    P_PAD: tl.constexpr, DVH_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Partial ``R(φk)ᵀv`` (8 tiles: value half × block) and ``Σφk`` (4 blocks) of one sequence and head over
    the key tiles ``split, split + splits, …``. Grid: (splits, heads, sequences)."""
    split, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi, batch = _sequence_span(cu_k, s, keys, VARLEN)
    k_base = k + batch.to(tl.int64) * stride_kb + h * stride_kh
    v_base = v + batch.to(tl.int64) * stride_vb + h * stride_vh
    c = tl.arange(0, P_PAD)
    j = tl.arange(0, DVH_PAD)
    t = tl.arange(0, BLOCK)
    zero_tile = tl.zeros((P_PAD, DVH_PAD), ACC)
    s_pe, s_po, s_ne, s_no = zero_tile, zero_tile, zero_tile, zero_tile
    o_pe, o_po, o_ne, o_no = zero_tile, zero_tile, zero_tile, zero_tile
    zero_vec = tl.zeros((P_PAD,), ACC)
    m_pe, m_po, m_ne, m_no = zero_vec, zero_vec, zero_vec, zero_vec
    for start in range(lo + split * BLOCK, hi, splits * BLOCK):
        rows = start + t
        ok = rows < hi
        if HAS_MASK:
            ok = ok & (tl.load(key_mask + batch * stride_mb + rows, mask=ok, other=1) == 0)
        k_even, k_odd = _load_pairs(k_base, rows, ok, stride_kn, c, d, ACC)
        f_pe = _expm1(tl.maximum(k_even, 0.0))
        f_po = _expm1(tl.maximum(k_odd, 0.0))
        f_ne = _expm1(tl.maximum(-k_even, 0.0))
        f_no = _expm1(tl.maximum(-k_odd, 0.0))
        m_pe += tl.sum(f_pe, 0)
        m_po += tl.sum(f_po, 0)
        m_ne += tl.sum(f_ne, 0)
        m_no += tl.sum(f_no, 0)
        if ROPE:
            c_pe, c_po, c_ne, c_no = _load_blocks(cos, rows, ok, stride_table, c, d, ACC)
            n_pe, n_po, n_ne, n_no = _load_blocks(sin, rows, ok, stride_table, c, d, ACC)
            f_pe, f_po = _rotate(f_pe, f_po, c_pe, c_po, n_pe, n_po)
            f_ne, f_no = _rotate(f_ne, f_no, c_ne, c_no, n_ne, n_no)
        v_ptr = v_base + rows[:, None].to(tl.int64) * stride_vn + j[None, :]
        v_ok = ok[:, None] & (j < dvh)[None, :]
        v_same = tl.load(v_ptr, mask=v_ok, other=0.0).to(ACC)
        v_opp = tl.load(v_ptr + dvh, mask=v_ok, other=0.0).to(ACC)
        s_pe += tl.dot(tl.trans(f_pe), v_same, input_precision=DOT, out_dtype=ACC)
        s_po += tl.dot(tl.trans(f_po), v_same, input_precision=DOT, out_dtype=ACC)
        s_ne += tl.dot(tl.trans(f_ne), v_same, input_precision=DOT, out_dtype=ACC)
        s_no += tl.dot(tl.trans(f_no), v_same, input_precision=DOT, out_dtype=ACC)
        o_pe += tl.dot(tl.trans(f_pe), v_opp, input_precision=DOT, out_dtype=ACC)
        o_po += tl.dot(tl.trans(f_po), v_opp, input_precision=DOT, out_dtype=ACC)
        o_ne += tl.dot(tl.trans(f_ne), v_opp, input_precision=DOT, out_dtype=ACC)
        o_no += tl.dot(tl.trans(f_no), v_opp, input_precision=DOT, out_dtype=ACC)
    part = (s * heads + h) * splits + split
    kv_base = kv_part + part.to(tl.int64) * (8 * P_PAD * DVH_PAD)
    _store_state_tile(kv_base, 0, c, j, s_pe, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 1, c, j, s_po, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 2, c, j, s_ne, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 3, c, j, s_no, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 4, c, j, o_pe, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 5, c, j, o_po, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 6, c, j, o_ne, P_PAD, DVH_PAD)
    _store_state_tile(kv_base, 7, c, j, o_no, P_PAD, DVH_PAD)
    km_base = km_part + part.to(tl.int64) * (4 * P_PAD)
    tl.store(km_base + c, m_pe)
    tl.store(km_base + P_PAD + c, m_po)
    tl.store(km_base + 2 * P_PAD + c, m_ne)
    tl.store(km_base + 3 * P_PAD + c, m_no)


@triton.jit
def _query_features(q_even, q_odd, ts_pe, ts_po, ts_ne, ts_no, to_pe, to_po, to_ne, to_no):
    """Both streams' row-scaled query features of a tile: per stream the four blocks of φ and the row scale."""
    a_even, a_odd = tl.maximum(q_even, 0.0), tl.maximum(q_odd, 0.0)
    b_even, b_odd = tl.maximum(-q_even, 0.0), tl.maximum(-q_odd, 0.0)
    s_pe, s_po, s_ne, s_no = _exp_features(a_even, a_odd, b_even, b_odd, ts_pe, ts_po, ts_ne, ts_no)
    o_pe, o_po, o_ne, o_no = _exp_features(b_even, b_odd, a_even, a_odd, to_pe, to_po, to_ne, to_no)
    s_scale = _row_scale(s_pe, s_po, s_ne, s_no)
    o_scale = _row_scale(o_pe, o_po, o_ne, o_no)
    s_pe, s_po = s_pe * s_scale[:, None], s_po * s_scale[:, None]
    s_ne, s_no = s_ne * s_scale[:, None], s_no * s_scale[:, None]
    o_pe, o_po = o_pe * o_scale[:, None], o_po * o_scale[:, None]
    o_ne, o_no = o_ne * o_scale[:, None], o_no * o_scale[:, None]
    return s_pe, s_po, s_ne, s_no, s_scale, o_pe, o_po, o_ne, o_no, o_scale


@triton.jit
def _stream_output(f_pe, f_po, f_ne, f_no, r_pe, r_po, r_ne, r_no, scale, kv_base, km_base, c, j, eps,
                   ACC: tl.constexpr, DOT: tl.constexpr, P_PAD: tl.constexpr, DVH_PAD: tl.constexpr):
    """One stream's ``(R(φ)·kv, φ·k̄ + eps)`` for a tile: numerator (BLOCK, DVH_PAD) and normaliser (BLOCK,)."""
    num = tl.dot(r_pe, _load_state_tile(kv_base, 0, c, j, P_PAD, DVH_PAD), input_precision=DOT, out_dtype=ACC)
    num += tl.dot(r_po, _load_state_tile(kv_base, 1, c, j, P_PAD, DVH_PAD), input_precision=DOT, out_dtype=ACC)
    num += tl.dot(r_ne, _load_state_tile(kv_base, 2, c, j, P_PAD, DVH_PAD), input_precision=DOT, out_dtype=ACC)
    num += tl.dot(r_no, _load_state_tile(kv_base, 3, c, j, P_PAD, DVH_PAD), input_precision=DOT, out_dtype=ACC)
    den = tl.sum(f_pe * tl.load(km_base + c)[None, :], 1) + tl.sum(f_po * tl.load(km_base + P_PAD + c)[None, :], 1)
    den += tl.sum(f_ne * tl.load(km_base + 2 * P_PAD + c)[None, :], 1)
    den += tl.sum(f_no * tl.load(km_base + 3 * P_PAD + c)[None, :], 1)
    return num, den + eps * scale


@triton.jit
def _output_kernel(
    q, temps, cu_q, cos, sin, kv, km, out,
    stride_qb, stride_qh, stride_qn, stride_tb, stride_th, stride_table,
    stride_ob, stride_oh, stride_on,
    heads, length, num_seqs, d, dvh, eps,
    VARLEN: tl.constexpr, ROPE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    P_PAD: tl.constexpr, DVH_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out = [R(φ_s)·kv_s / (φ_s·k̄ + eps) ; R(φ_o)·kv_o / (φ_o·k̄ + eps)]`` for one tile of query rows.
    Grid: (query tiles, heads, batch) — packed batches: (tiles of the packed axis, heads, 1), a tile
    running once per sequence it overlaps."""
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tile * BLOCK
    rows = first + tl.arange(0, BLOCK)
    ok = rows < length
    if VARLEN:
        s_first = _find_sequence(cu_q, num_seqs, first)
        s_last = _find_sequence(cu_q, num_seqs, tl.minimum(first + BLOCK, length) - 1)
        batch = b * 0
    else:
        s_first, s_last, batch = b, b, b
    c = tl.arange(0, P_PAD)
    j = tl.arange(0, DVH_PAD)
    t_same = temps + batch * stride_tb + h * stride_th
    ts_pe, ts_po, ts_ne, ts_no = _load_temperatures(t_same, c, d, ACC)
    to_pe, to_po, to_ne, to_no = _load_temperatures(t_same + 2 * d, c, d, ACC)
    q_even, q_odd = _load_pairs(q + batch.to(tl.int64) * stride_qb + h * stride_qh, rows, ok, stride_qn, c, d, ACC)
    s_pe, s_po, s_ne, s_no, s_scale, o_pe, o_po, o_ne, o_no, o_scale = _query_features(
        q_even, q_odd, ts_pe, ts_po, ts_ne, ts_no, to_pe, to_po, to_ne, to_no)
    rs_pe, rs_po, rs_ne, rs_no = s_pe, s_po, s_ne, s_no
    ro_pe, ro_po, ro_ne, ro_no = o_pe, o_po, o_ne, o_no
    if ROPE:
        c_pe, c_po, c_ne, c_no = _load_blocks(cos, rows, ok, stride_table, c, d, ACC)
        n_pe, n_po, n_ne, n_no = _load_blocks(sin, rows, ok, stride_table, c, d, ACC)
        rs_pe, rs_po = _rotate(s_pe, s_po, c_pe, c_po, n_pe, n_po)
        rs_ne, rs_no = _rotate(s_ne, s_no, c_ne, c_no, n_ne, n_no)
        ro_pe, ro_po = _rotate(o_pe, o_po, c_pe, c_po, n_pe, n_po)
        ro_ne, ro_no = _rotate(o_ne, o_no, c_ne, c_no, n_ne, n_no)
    out_same = tl.zeros((BLOCK, DVH_PAD), ACC)
    out_opp = tl.zeros((BLOCK, DVH_PAD), ACC)
    for s in range(s_first, s_last + 1):
        lo, hi, _ = _sequence_span(cu_q, s, length, VARLEN)
        inside = (rows >= lo) & (rows < hi)
        group = (s * heads + h).to(tl.int64)
        kv_base = kv + group * (8 * P_PAD * DVH_PAD)
        km_base = km + group * (4 * P_PAD)
        num, den = _stream_output(s_pe, s_po, s_ne, s_no, rs_pe, rs_po, rs_ne, rs_no, s_scale, kv_base,
                                  km_base, c, j, eps, ACC, DOT, P_PAD, DVH_PAD)
        out_same = tl.where(inside[:, None], num / den[:, None], out_same)
        num, den = _stream_output(o_pe, o_po, o_ne, o_no, ro_pe, ro_po, ro_ne, ro_no, o_scale,
                                  kv_base + 4 * P_PAD * DVH_PAD, km_base, c, j, eps, ACC, DOT, P_PAD, DVH_PAD)
        out_opp = tl.where(inside[:, None], num / den[:, None], out_opp)
    o_ptr = out + batch.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_on + j[None, :]
    o_ok = ok[:, None] & (j < dvh)[None, :]
    tl.store(o_ptr, out_same, mask=o_ok)
    tl.store(o_ptr + dvh, out_opp, mask=o_ok)


@triton.jit
def _stream_backward(f_pe, f_po, f_ne, f_no, r_pe, r_po, r_ne, r_no, scale, grad, kv_base, km_base,
                     c_pe, c_po, c_ne, c_no, n_pe, n_po, n_ne, n_no, c, j, eps,
                     ROPE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, P_PAD: tl.constexpr,
                     DVH_PAD: tl.constexpr):
    """One stream's backward through ``out = R(φ)·kv / (φ·k̄ + eps)`` for a tile of (row-scaled) features:
    the gradients of the exponents (four blocks), of the numerator ``g/den`` and of the normaliser."""
    num, den = _stream_output(f_pe, f_po, f_ne, f_no, r_pe, r_po, r_ne, r_no, scale, kv_base, km_base, c, j,
                              eps, ACC, DOT, P_PAD, DVH_PAD)
    g_num = grad / den[:, None]
    g_den = -tl.sum(g_num * (num / den[:, None]), 1)
    kv_pe = _load_state_tile(kv_base, 0, c, j, P_PAD, DVH_PAD)
    kv_po = _load_state_tile(kv_base, 1, c, j, P_PAD, DVH_PAD)
    kv_ne = _load_state_tile(kv_base, 2, c, j, P_PAD, DVH_PAD)
    kv_no = _load_state_tile(kv_base, 3, c, j, P_PAD, DVH_PAD)
    d_pe = tl.dot(g_num, tl.trans(kv_pe), input_precision=DOT, out_dtype=ACC)
    d_po = tl.dot(g_num, tl.trans(kv_po), input_precision=DOT, out_dtype=ACC)
    d_ne = tl.dot(g_num, tl.trans(kv_ne), input_precision=DOT, out_dtype=ACC)
    d_no = tl.dot(g_num, tl.trans(kv_no), input_precision=DOT, out_dtype=ACC)
    if ROPE:
        d_pe, d_po = _rotate_transposed(d_pe, d_po, c_pe, c_po, n_pe, n_po)
        d_ne, d_no = _rotate_transposed(d_ne, d_no, c_ne, c_no, n_ne, n_no)
    d_pe += g_den[:, None] * tl.load(km_base + c)[None, :]
    d_po += g_den[:, None] * tl.load(km_base + P_PAD + c)[None, :]
    d_ne += g_den[:, None] * tl.load(km_base + 2 * P_PAD + c)[None, :]
    d_no += g_den[:, None] * tl.load(km_base + 3 * P_PAD + c)[None, :]
    # φ' = σ·(exp(x) − 1) with the row scale σ: dL/dx = dL/dφ'·(φ' + σ)
    d_pe *= f_pe + scale[:, None]
    d_po *= f_po + scale[:, None]
    d_ne *= f_ne + scale[:, None]
    d_no *= f_no + scale[:, None]
    return d_pe, d_po, d_ne, d_no, g_num, g_den


@triton.jit
def _query_backward_kernel(
    q, temps, cu_q, cos, sin, kv, km, grad_out, grad_q, gkv_part, gkm_part, gt_part,
    stride_qb, stride_qh, stride_qn, stride_tb, stride_th, stride_table,
    stride_gb, stride_gh, stride_gn, stride_dqb, stride_dqh, stride_dqn,
    heads, length, d, dvh, splits, eps,
    VARLEN: tl.constexpr, ROPE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    P_PAD: tl.constexpr, DVH_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dq`` of the query tiles ``split, split + splits, …`` of one sequence and head, and over those tiles the
    partial gradients of the state (``R(φ)ᵀ·g/den``: 8 tiles; ``Σ g_den·φ``: 4 blocks) and of the two
    temperature vectors (8 blocks). Features are recomputed from ``q``. Grid: (splits, heads, sequences)."""
    split, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi, batch = _sequence_span(cu_q, s, length, VARLEN)
    c = tl.arange(0, P_PAD)
    j = tl.arange(0, DVH_PAD)
    t = tl.arange(0, BLOCK)
    t_same = temps + batch * stride_tb + h * stride_th
    ts_pe, ts_po, ts_ne, ts_no = _load_temperatures(t_same, c, d, ACC)
    to_pe, to_po, to_ne, to_no = _load_temperatures(t_same + 2 * d, c, d, ACC)
    group = (s * heads + h).to(tl.int64)
    kv_base = kv + group * (8 * P_PAD * DVH_PAD)
    km_base = km + group * (4 * P_PAD)
    q_base = q + batch.to(tl.int64) * stride_qb + h * stride_qh
    g_base = grad_out + batch.to(tl.int64) * stride_gb + h * stride_gh
    dq_base = grad_q + batch.to(tl.int64) * stride_dqb + h * stride_dqh
    zero_tile = tl.zeros((P_PAD, DVH_PAD), ACC)
    ks_pe, ks_po, ks_ne, ks_no = zero_tile, zero_tile, zero_tile, zero_tile
    ko_pe, ko_po, ko_ne, ko_no = zero_tile, zero_tile, zero_tile, zero_tile
    zero_vec = tl.zeros((P_PAD,), ACC)
    m_pe, m_po, m_ne, m_no = zero_vec, zero_vec, zero_vec, zero_vec
    ws_pe, ws_po, ws_ne, ws_no = zero_vec, zero_vec, zero_vec, zero_vec
    wo_pe, wo_po, wo_ne, wo_no = zero_vec, zero_vec, zero_vec, zero_vec
    for start in range(lo + split * BLOCK, hi, splits * BLOCK):
        rows = start + t
        ok = rows < hi
        q_even, q_odd = _load_pairs(q_base, rows, ok, stride_qn, c, d, ACC)
        s_pe, s_po, s_ne, s_no, s_scale, o_pe, o_po, o_ne, o_no, o_scale = _query_features(
            q_even, q_odd, ts_pe, ts_po, ts_ne, ts_no, to_pe, to_po, to_ne, to_no)
        rs_pe, rs_po, rs_ne, rs_no = s_pe, s_po, s_ne, s_no
        ro_pe, ro_po, ro_ne, ro_no = o_pe, o_po, o_ne, o_no
        c_pe, c_po, c_ne, c_no = s_pe, s_po, s_ne, s_no  # stand-ins, unused without tables
        n_pe, n_po, n_ne, n_no = s_pe, s_po, s_ne, s_no
        if ROPE:
            c_pe, c_po, c_ne, c_no = _load_blocks(cos, rows, ok, stride_table, c, d, ACC)
            n_pe, n_po, n_ne, n_no = _load_blocks(sin, rows, ok, stride_table, c, d, ACC)
            rs_pe, rs_po = _rotate(s_pe, s_po, c_pe, c_po, n_pe, n_po)
            rs_ne, rs_no = _rotate(s_ne, s_no, c_ne, c_no, n_ne, n_no)
            ro_pe, ro_po = _rotate(o_pe, o_po, c_pe, c_po, n_pe, n_po)
            ro_ne, ro_no = _rotate(o_ne, o_no, c_ne, c_no, n_ne, n_no)
        g_ptr = g_base + rows[:, None].to(tl.int64) * stride_gn + j[None, :]
        g_ok = ok[:, None] & (j < dvh)[None, :]
        g_same = tl.load(g_ptr, mask=g_ok, other=0.0).to(ACC)
        g_opp = tl.load(g_ptr + dvh, mask=g_ok, other=0.0).to(ACC)
        ds_pe, ds_po, ds_ne, ds_no, gs_num, gs_den = _stream_backward(
            s_pe, s_po, s_ne, s_no, rs_pe, rs_po, rs_ne, rs_no, s_scale, g_same, kv_base, km_base,
            c_pe, c_po, c_ne, c_no, n_pe, n_po, n_ne, n_no, c, j, eps, ROPE, ACC, DOT, P_PAD, DVH_PAD)
        do_pe, do_po, do_ne, do_no, go_num, go_den = _stream_backward(
            o_pe, o_po, o_ne, o_no, ro_pe, ro_po, ro_ne, ro_no, o_scale, g_opp, kv_base + 4 * P_PAD * DVH_PAD,
            km_base, c_pe, c_po, c_ne, c_no, n_pe, n_po, n_ne, n_no, c, j, eps, ROPE, ACC, DOT, P_PAD, DVH_PAD)
        # Exponents: same stream [a ; b] ⊙ T_same, opposite stream [b ; a] ⊙ T_opp, a = relu(q), b = relu(-q).
        a_even, a_odd = tl.maximum(q_even, 0.0), tl.maximum(q_odd, 0.0)
        b_even, b_odd = tl.maximum(-q_even, 0.0), tl.maximum(-q_odd, 0.0)
        ws_pe += tl.sum(ds_pe * a_even, 0)
        ws_po += tl.sum(ds_po * a_odd, 0)
        ws_ne += tl.sum(ds_ne * b_even, 0)
        ws_no += tl.sum(ds_no * b_odd, 0)
        wo_pe += tl.sum(do_pe * b_even, 0)
        wo_po += tl.sum(do_po * b_odd, 0)
        wo_ne += tl.sum(do_ne * a_even, 0)
        wo_no += tl.sum(do_no * a_odd, 0)
        grad_a_even = ds_pe * ts_pe + do_ne * to_ne
        grad_a_odd = ds_po * ts_po + do_no * to_no
        grad_b_even = ds_ne * ts_ne + do_pe * to_pe
        grad_b_odd = ds_no * ts_no + do_po * to_po
        dq_even = tl.where(q_even > 0, grad_a_even, tl.where(q_even < 0, -grad_b_even, 0.0))
        dq_odd = tl.where(q_odd > 0, grad_a_odd, tl.where(q_odd < 0, -grad_b_odd, 0.0))
        _store_pairs(dq_base, rows, ok, stride_dqn, c, d, dq_even, dq_odd)
        ks_pe += tl.dot(tl.trans(rs_pe), gs_num, input_precision=DOT, out_dtype=ACC)
        ks_po += tl.dot(tl.trans(rs_po), gs_num, input_precision=DOT, out_dtype=ACC)
        ks_ne += tl.dot(tl.trans(rs_ne), gs_num, input_precision=DOT, out_dtype=ACC)
        ks_no += tl.dot(tl.trans(rs_no), gs_num, input_precision=DOT, out_dtype=ACC)
        ko_pe += tl.dot(tl.trans(ro_pe), go_num, input_precision=DOT, out_dtype=ACC)
        ko_po += tl.dot(tl.trans(ro_po), go_num, input_precision=DOT, out_dtype=ACC)
        ko_ne += tl.dot(tl.trans(ro_ne), go_num, input_precision=DOT, out_dtype=ACC)
        ko_no += tl.dot(tl.trans(ro_no), go_num, input_precision=DOT, out_dtype=ACC)
        m_pe += tl.sum(gs_den[:, None] * s_pe + go_den[:, None] * o_pe, 0)
        m_po += tl.sum(gs_den[:, None] * s_po + go_den[:, None] * o_po, 0)
        m_ne += tl.sum(gs_den[:, None] * s_ne + go_den[:, None] * o_ne, 0)
        m_no += tl.sum(gs_den[:, None] * s_no + go_den[:, None] * o_no, 0)
    part = (group * splits + split).to(tl.int64)
    base = gkv_part + part * (8 * P_PAD * DVH_PAD)
    _store_state_tile(base, 0, c, j, ks_pe, P_PAD, DVH_PAD)
    _store_state_tile(base, 1, c, j, ks_po, P_PAD, DVH_PAD)
    _store_state_tile(base, 2, c, j, ks_ne, P_PAD, DVH_PAD)
    _store_state_tile(base, 3, c, j, ks_no, P_PAD, DVH_PAD)
    _store_state_tile(base, 4, c, j, ko_pe, P_PAD, DVH_PAD)
    _store_state_tile(base, 5, c, j, ko_po, P_PAD, DVH_PAD)
    _store_state_tile(base, 6, c, j, ko_ne, P_PAD, DVH_PAD)
    _store_state_tile(base, 7, c, j, ko_no, P_PAD, DVH_PAD)
    base = gkm_part + part * (4 * P_PAD)
    tl.store(base + c, m_pe)
    tl.store(base + P_PAD + c, m_po)
    tl.store(base + 2 * P_PAD + c, m_ne)
    tl.store(base + 3 * P_PAD + c, m_no)
    base = gt_part + part * (8 * P_PAD)
    tl.store(base + c, ws_pe)
    tl.store(base + P_PAD + c, ws_po)
    tl.store(base + 2 * P_PAD + c, ws_ne)
    tl.store(base + 3 * P_PAD + c, ws_no)
    tl.store(base + 4 * P_PAD + c, wo_pe)
    tl.store(base + 5 * P_PAD + c, wo_po)
    tl.store(base + 6 * P_PAD + c, wo_ne)
    tl.store(base + 7 * P_PAD + c, wo_no)


@triton.jit
def _key_backward_kernel(
    k, v, key_mask, cu_k, cos, sin, gkv, gkm, grad_k, grad_v,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mb, stride_table,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    heads, length, num_seqs, d, dvh,
    HAS_MASK: tl.constexpr, VARLEN: tl.constexpr, ROPE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    P_PAD: tl.constexpr, DVH_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dk`` and ``dv`` of one tile of key rows from the state's gradients (already divided by the key count):
    ``dv = R(φk)·G``, ``dφk = Rᵀ(G·v) + G_k̄``; padded keys get zeros. Features are recomputed from ``k``.
    Grid as :func:`_output_kernel`."""
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tile * BLOCK
    rows = first + tl.arange(0, BLOCK)
    ok = rows < length
    if VARLEN:
        s_first = _find_sequence(cu_k, num_seqs, first)
        s_last = _find_sequence(cu_k, num_seqs, tl.minimum(first + BLOCK, length) - 1)
        batch = b * 0
    else:
        s_first, s_last, batch = b, b, b
    keep = ok
    if HAS_MASK:
        keep = keep & (tl.load(key_mask + batch * stride_mb + rows, mask=ok, other=1) == 0)
    c = tl.arange(0, P_PAD)
    j = tl.arange(0, DVH_PAD)
    k_even, k_odd = _load_pairs(k + batch.to(tl.int64) * stride_kb + h * stride_kh, rows, keep, stride_kn, c, d, ACC)
    f_pe = _expm1(tl.maximum(k_even, 0.0))
    f_po = _expm1(tl.maximum(k_odd, 0.0))
    f_ne = _expm1(tl.maximum(-k_even, 0.0))
    f_no = _expm1(tl.maximum(-k_odd, 0.0))
    r_pe, r_po, r_ne, r_no = f_pe, f_po, f_ne, f_no
    if ROPE:
        c_pe, c_po, c_ne, c_no = _load_blocks(cos, rows, keep, stride_table, c, d, ACC)
        n_pe, n_po, n_ne, n_no = _load_blocks(sin, rows, keep, stride_table, c, d, ACC)
        r_pe, r_po = _rotate(f_pe, f_po, c_pe, c_po, n_pe, n_po)
        r_ne, r_no = _rotate(f_ne, f_no, c_ne, c_no, n_ne, n_no)
    v_ptr = v + batch.to(tl.int64) * stride_vb + h * stride_vh + rows[:, None].to(tl.int64) * stride_vn + j[None, :]
    v_ok = keep[:, None] & (j < dvh)[None, :]
    v_same = tl.load(v_ptr, mask=v_ok, other=0.0).to(ACC)
    v_opp = tl.load(v_ptr + dvh, mask=v_ok, other=0.0).to(ACC)
    dk_even = tl.zeros((BLOCK, P_PAD), ACC)
    dk_odd = tl.zeros((BLOCK, P_PAD), ACC)
    dv_same = tl.zeros((BLOCK, DVH_PAD), ACC)
    dv_opp = tl.zeros((BLOCK, DVH_PAD), ACC)
    for s in range(s_first, s_last + 1):
        lo, hi, _ = _sequence_span(cu_k, s, length, VARLEN)
        inside = ((rows >= lo) & (rows < hi))[:, None]
        group = (s * heads + h).to(tl.int64)
        g_base = gkv + group * (8 * P_PAD * DVH_PAD)
        gs_pe = _load_state_tile(g_base, 0, c, j, P_PAD, DVH_PAD)
        gs_po = _load_state_tile(g_base, 1, c, j, P_PAD, DVH_PAD)
        gs_ne = _load_state_tile(g_base, 2, c, j, P_PAD, DVH_PAD)
        gs_no = _load_state_tile(g_base, 3, c, j, P_PAD, DVH_PAD)
        go_pe = _load_state_tile(g_base, 4, c, j, P_PAD, DVH_PAD)
        go_po = _load_state_tile(g_base, 5, c, j, P_PAD, DVH_PAD)
        go_ne = _load_state_tile(g_base, 6, c, j, P_PAD, DVH_PAD)
        go_no = _load_state_tile(g_base, 7, c, j, P_PAD, DVH_PAD)
        part = tl.dot(r_pe, gs_pe, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_po, gs_po, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_ne, gs_ne, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_no, gs_no, input_precision=DOT, out_dtype=ACC)
        dv_same = tl.where(inside, part, dv_same)
        part = tl.dot(r_pe, go_pe, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_po, go_po, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_ne, go_ne, input_precision=DOT, out_dtype=ACC)
        part += tl.dot(r_no, go_no, input_precision=DOT, out_dtype=ACC)
        dv_opp = tl.where(inside, part, dv_opp)
        d_pe = tl.dot(v_same, tl.trans(gs_pe), input_precision=DOT, out_dtype=ACC)
        d_pe += tl.dot(v_opp, tl.trans(go_pe), input_precision=DOT, out_dtype=ACC)
        d_po = tl.dot(v_same, tl.trans(gs_po), input_precision=DOT, out_dtype=ACC)
        d_po += tl.dot(v_opp, tl.trans(go_po), input_precision=DOT, out_dtype=ACC)
        d_ne = tl.dot(v_same, tl.trans(gs_ne), input_precision=DOT, out_dtype=ACC)
        d_ne += tl.dot(v_opp, tl.trans(go_ne), input_precision=DOT, out_dtype=ACC)
        d_no = tl.dot(v_same, tl.trans(gs_no), input_precision=DOT, out_dtype=ACC)
        d_no += tl.dot(v_opp, tl.trans(go_no), input_precision=DOT, out_dtype=ACC)
        if ROPE:
            d_pe, d_po = _rotate_transposed(d_pe, d_po, c_pe, c_po, n_pe, n_po)
            d_ne, d_no = _rotate_transposed(d_ne, d_no, c_ne, c_no, n_ne, n_no)
        m_base = gkm + group * (4 * P_PAD)
        # φk = exp(|k|) − 1 on k's half: dL/dk = ±dL/dφk·(φk + 1)
        d_pe = (d_pe + tl.load(m_base + c)[None, :]) * (f_pe + 1.0)
        d_po = (d_po + tl.load(m_base + P_PAD + c)[None, :]) * (f_po + 1.0)
        d_ne = (d_ne + tl.load(m_base + 2 * P_PAD + c)[None, :]) * (f_ne + 1.0)
        d_no = (d_no + tl.load(m_base + 3 * P_PAD + c)[None, :]) * (f_no + 1.0)
        part = tl.where(k_even > 0, d_pe, tl.where(k_even < 0, -d_ne, 0.0))
        dk_even = tl.where(inside, part, dk_even)
        part = tl.where(k_odd > 0, d_po, tl.where(k_odd < 0, -d_no, 0.0))
        dk_odd = tl.where(inside, part, dk_odd)
    padded = (keep == 0)[:, None]
    dk_even = tl.where(padded, 0.0, dk_even)
    dk_odd = tl.where(padded, 0.0, dk_odd)
    _store_pairs(grad_k + batch.to(tl.int64) * stride_dkb + h * stride_dkh, rows, ok, stride_dkn, c, d, dk_even, dk_odd)
    dv_ptr = (grad_v + batch.to(tl.int64) * stride_dvb + h * stride_dvh + rows[:, None].to(tl.int64) * stride_dvn
              + j[None, :])
    dv_ok = ok[:, None] & (j < dvh)[None, :]
    tl.store(dv_ptr, tl.where(padded, 0.0, dv_same), mask=dv_ok)
    tl.store(dv_ptr + dvh, tl.where(padded, 0.0, dv_opp), mask=dv_ok)


def _row_major(x: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels address channels with unit stride."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


class _Problem:
    """Sizes and compile-time switches of one call, shared by its forward and backward launches."""

    def __init__(self, q, k, v, sin, key_padding_mask, cu_q, cu_k):
        self.varlen = cu_q is not None
        self.heads, self.d, self.dvh = q.shape[1], q.shape[-1], v.shape[-1] // 2
        self.q_len, self.k_len = q.shape[2], k.shape[2]
        self.batch = q.shape[0]
        self.seqs = cu_q.numel() - 1 if self.varlen else q.shape[0]
        self.groups = self.seqs * self.heads
        self.rope, self.has_mask = sin is not None, key_padding_mask is not None
        self.p_pad, self.dvh_pad = padded_width((self.d + 1) // 2), padded_width(self.dvh)
        wide = any(t.dtype == torch.float64 for t in (q, k, v))
        self.acc = torch.float64 if wide else torch.float32
        self.tl_acc = tl.float64 if wide else tl.float32
        # tf32 products only where the inputs are half precision anyway
        self.dot = "ieee" if wide or torch.float32 in (q.dtype, k.dtype, v.dtype) else "tf32"
        self.block = _BLOCK_TOKENS

    def splits(self, tokens: int) -> int:
        """Programs per sequence for a reduction over ``tokens`` packed tokens (a fixed count: deterministic)."""
        per_seq = triton.cdiv(tokens, max(self.seqs, 1)) if self.varlen else tokens
        by_length = triton.cdiv(per_seq, 2 * self.block)
        return max(1, min(_MAX_SPLITS, by_length, triton.cdiv(_ENOUGH_PROGRAMS, max(self.groups, 1))))

    def key_counts(self, key_padding_mask, cu_k, device) -> torch.Tensor:
        """Valid keys per (sequence, head) group, at least one (an all-padding sequence gives zeros)."""
        if self.varlen:
            counts = (cu_k[1:] - cu_k[:-1]).to(self.acc)
        elif key_padding_mask is not None:
            counts = (~key_padding_mask).sum(-1).to(self.acc)
        else:
            counts = torch.full((self.seqs,), float(self.k_len), dtype=self.acc, device=device)
        return counts.clamp_min(1.0).repeat_interleave(self.heads)

    def constants(self):
        return dict(ROPE=self.rope, VARLEN=self.varlen, ACC=self.tl_acc, DOT=self.dot, P_PAD=self.p_pad,
                    DVH_PAD=self.dvh_pad, BLOCK=self.block)


def _state(p: _Problem, k, v, key_mask, cu_k, sin, cos, counts):
    """``(kv, k̄)``: (groups, 8, P, dv/2) and (groups, 4, P) in the accumulation dtype."""
    splits = p.splits(p.k_len)
    kv = torch.empty(p.groups, splits, 8, p.p_pad, p.dvh_pad, dtype=p.acc, device=k.device)
    km = torch.empty(p.groups, splits, 4, p.p_pad, dtype=p.acc, device=k.device)
    mask = key_mask if key_mask is not None else k
    _state_kernel[(splits, p.heads, p.seqs)](
        k, v, mask, cu_k, cos, sin, kv, km,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), 0 if sin is None else sin.stride(0),
        p.heads, p.k_len, p.d, p.dvh, splits, HAS_MASK=p.has_mask, **p.constants())
    scale = counts.reciprocal()
    return kv.sum(1).mul_(scale[:, None, None, None]), km.sum(1).mul_(scale[:, None, None])


def _forward(p: _Problem, q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, eps, out):
    """Writes the attention into ``out`` (q's shape with v's width) and returns the state for the backward."""
    kv, km = _state(p, k, v, key_mask, cu_k, sin, cos, p.key_counts(key_mask, cu_k, q.device))
    grid = (triton.cdiv(p.q_len, p.block), p.heads, 1 if p.varlen else p.batch)
    _output_kernel[grid](
        q, temps, cu_q, cos, sin, kv, km, out,
        q.stride(0), q.stride(1), q.stride(2), temps.stride(0), temps.stride(1),
        0 if sin is None else sin.stride(0), out.stride(0), out.stride(1), out.stride(2),
        p.heads, p.q_len, p.seqs, p.d, p.dvh, eps, **p.constants())
    return kv, km


def _backward(p: _Problem, q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, eps, kv, km, grad_out,
              grad_q, grad_k, grad_v):
    """Writes the input gradients into ``grad_q``/``grad_k``/``grad_v`` (``grad_k``/``grad_v`` may be None
    together) and returns the temperatures' gradient, (batch or 1, heads, 2, 2d) in the accumulation dtype."""
    splits = p.splits(p.q_len)
    gkv = torch.empty(p.groups, splits, 8, p.p_pad, p.dvh_pad, dtype=p.acc, device=q.device)
    gkm = torch.empty(p.groups, splits, 4, p.p_pad, dtype=p.acc, device=q.device)
    gt = torch.empty(p.groups, splits, 8, p.p_pad, dtype=p.acc, device=q.device)
    _query_backward_kernel[(splits, p.heads, p.seqs)](
        q, temps, cu_q, cos, sin, kv, km, grad_out, grad_q, gkv, gkm, gt,
        q.stride(0), q.stride(1), q.stride(2), temps.stride(0), temps.stride(1),
        0 if sin is None else sin.stride(0), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        grad_q.stride(0), grad_q.stride(1), grad_q.stride(2),
        p.heads, p.q_len, p.d, p.dvh, splits, eps, **p.constants())
    if grad_k is not None:
        scale = p.key_counts(key_mask, cu_k, q.device).reciprocal()
        gkv_total = gkv.sum(1).mul_(scale[:, None, None, None])
        gkm_total = gkm.sum(1).mul_(scale[:, None, None])
        mask = key_mask if key_mask is not None else k
        grid = (triton.cdiv(p.k_len, p.block), p.heads, 1 if p.varlen else p.batch)
        _key_backward_kernel[grid](
            k, v, mask, cu_k, cos, sin, gkv_total, gkm_total, grad_k, grad_v,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            mask.stride(0), 0 if sin is None else sin.stride(0),
            grad_k.stride(0), grad_k.stride(1), grad_k.stride(2), grad_v.stride(0), grad_v.stride(1),
            grad_v.stride(2), p.heads, p.k_len, p.seqs, p.d, p.dvh, HAS_MASK=p.has_mask, **p.constants())
    # (groups, 2 streams, h, e, P) -> channel h·d + 2c + e
    grad_temps = gt.sum(1).view(p.groups, 2, 2, 2, p.p_pad).transpose(-1, -2).reshape(p.groups, 2, 2, 2 * p.p_pad)
    grad_temps = grad_temps[..., :p.d].reshape(p.groups, 2, 2 * p.d)
    return grad_temps.view(-1, p.heads, 2, 2 * p.d).sum(0, keepdim=True) if p.varlen else \
        grad_temps.view(p.batch, p.heads, 2, 2 * p.d)


class _PacsAttentionTriton(torch.autograd.Function):
    """The op on the Triton kernels; the backward recomputes the features from q and k."""

    @staticmethod
    def forward(ctx, q, k, v, temp_same, temp_opposite, sin, cos, eps, key_mask, cu_q, cu_k):
        p = _Problem(q, k, v, sin, key_mask, cu_q, cu_k)
        batch = 1 if p.varlen else p.batch
        target = (batch, p.heads, 1, 2 * p.d)
        temps = torch.cat([temp_same.expand(target), temp_opposite.expand(target)], dim=2)  # (B, H, 2, 2d)
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=q.device)
        kv, km = _forward(p, q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, eps, out)
        ctx.problem, ctx.eps = p, eps
        ctx.temp_shapes = (temp_same.shape, temp_opposite.shape)
        ctx.temp_dtypes = (temp_same.dtype, temp_opposite.dtype)
        ctx.save_for_backward(q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, kv, km)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, kv, km = ctx.saved_tensors
        p, needs = ctx.problem, ctx.needs_input_grad
        grad_q = torch.empty_like(q)
        grad_k = torch.empty_like(k) if needs[1] or needs[2] else None
        grad_v = torch.empty_like(v) if grad_k is not None else None
        grad_temps = _backward(p, q, k, v, temps, sin, cos, key_mask, cu_q, cu_k, ctx.eps, kv, km,
                               _row_major(grad_out), grad_q, grad_k, grad_v)
        grad_same = grad_opp = None
        if needs[3]:
            grad_same = grad_temps[:, :, :1].sum_to_size(ctx.temp_shapes[0]).to(ctx.temp_dtypes[0])
        if needs[4]:
            grad_opp = grad_temps[:, :, 1:].sum_to_size(ctx.temp_shapes[1]).to(ctx.temp_dtypes[1])
        return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None,
                grad_same, grad_opp, None, None, None, None, None, None)


def pacs_attention(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask=None, cu_seqlens=None,
                   cu_seqlens_k=None):
    """:func:`polaformer.ops.pacs_linear_attention` on the Triton kernels, for arguments the op has checked:
    (B, H, N, d) queries, (B, H, M, d) keys, (B, H, M, dv) values, or packed (1, H, T, ·) with ``cu_seqlens``
    (``cu_seqlens_k`` for the keys, default ``cu_seqlens``); RoPE tables (N or T, 2d). Returns v's dtype."""
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(q.device)
    if sin is not None:
        sin, cos = _row_major(sin), _row_major(cos)
        if sin.stride(0) != cos.stride(0):
            sin, cos = sin.contiguous(), cos.contiguous()
    return _PacsAttentionTriton.apply(_row_major(q), _row_major(k), _row_major(v), temp_same, temp_opposite,
                                      sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
