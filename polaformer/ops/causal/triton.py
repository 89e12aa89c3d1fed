"""Fused Triton kernels of the causal ops (:mod:`polaformer.ops.causal`): feature maps, running key sums,
normaliser and both polarity streams in one chunked pass, forward and backward.

Per sequence and head, with key features ``φk`` (2d channels: ``[k⁺ ; k⁻]`` mapped), numerator features
``k̃ = RoPE(φk)`` (PaCS with tables, else ``φk``), and for each stream ``s`` query features ``φq_s`` and its value
channels ``v_s`` (same-sign: the first ``ceil(dv/2)``; opposite-sign: the rest, its queries with the halves
swapped), the ops' definition is, for query ``t``::

    out_t = (q̃_t · S_t) / (φq_t · K_t + eps · max(n_t, 1))      S_t = Σ_{i≤t} k̃_iᵀ v_i,  K_t = Σ_{i≤t} φk_i

over the valid keys (``n_t`` counts them). Feature maps: Pola ``relu(±x)ᵖ``, PaCS ``exp(relu(±x)·T) − 1`` (the
keys without temperature), or the identity (``causal_linear_attention``, one stream). A stream's query row is
divided by a power of two (``eps`` with it; no value changes) so that ``exp`` features do not overflow the
products.

The tokens go in chunks of C; ``S``, ``K`` and ``n`` entering each chunk are the only state between chunks:

- ``_walk_kernel`` (grid: (sequences·H, feature tiles, streams·value tiles)) walks a sequence's chunks in
  order, storing the state entering each (kept for the backward pass) and the final state;
- ``_output_kernel`` (grid: (chunks, H)), per chunk and both streams:
  ``q̃ S_c + tril(q̃ k̃ᵀ) v`` over ``φq K_c + rowsum(tril(φq φkᵀ)) + eps·n``, and per row the normaliser's
  reciprocal and the row scale (the backward's only saved rows);
- ``_walk_back_kernel`` walks the chunks backwards for the gradient of the state (and key sum) leaving each;
- ``_grads_kernel``, per chunk: gradients of q, k, v and per-chunk partial sums of the exponent's or
  temperatures' gradients, summed by one torch reduction.

Packed batches (``cu_seqlens``, batch 1) read the offsets on the device: sequence ``s`` owns the work items
from ``cu[s] // C + s`` on, a bound that needs no prefix sum of chunk counts (``T // C + S`` items at most),
and a chunk's program finds its sequence by bisection over the offsets. Products and states are fp32 (fp64 for
fp64 inputs; TF32 dots where q, k and v are all half precision); offsets are int64 wherever sizes multiply.

The eager entry point is an autograd.Function; under ``torch.compile`` the same forward and backward run as the
``torch.library`` ops ``polaformer::causal_attention`` and ``polaformer::causal_attention_backward``, so a
compiled graph holds them. Gradients are once-differentiable.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ...backends.triton.common import accumulator_dtype, dot, dots, expm1, padded_width, traceable, unpadded_keys

__all__ = ["FEATURES", "causal_attention", "kernel_chunk"]

FEATURES = {"linear": 0, "pola": 1, "pacs": 2}
_TILE_ELEMENTS = 1024  # a chunk's (C × 2d) feature tiles: the backward kernel holds about ten of them at once
_CHUNK_WARPS = 8


def kernel_chunk(chunk_size: int, features: int) -> int:
    """The kernels' tokens per chunk for the op's ``chunk_size`` and ``features`` channels (2d, or d for given
    features): rounded up to a power of two, at least 16 (``tl.dot``'s smallest operand), at most 64 and at
    most ``1024 / padded features`` (so 16 from d = 32 on). The results do not depend on it beyond rounding."""
    largest = max(16, min(64, _TILE_ELEMENTS // padded_width(features)))
    return min(largest, max(16, triton.next_power_of_2(chunk_size)))


# ---------------------------------------------------------------------------------------------------- helpers


@triton.jit
def _features(x, channel, D, param, flip, FEATURE: tl.constexpr):
    """Features of a (rows × channels) block whose entry at feature ``channel`` is input channel
    ``channel % D``: the identity (FEATURE 0), Pola ``relu(±x)ᵖ`` (1) or PaCS ``exp(relu(±x)·T) − 1`` (2), the
    sign ``+`` in the first half of the channels (the second with ``flip`` = 1, the opposite-sign queries).
    PaCS's ``exp(y) − 1`` keeps its accuracy near 0 (:func:`~.common.expm1`)."""
    if FEATURE == 0:
        return x
    positive = ((channel < D).to(tl.int32) ^ flip) != 0
    u = tl.maximum(tl.where(positive[None, :], x, -x), 0.0)
    if FEATURE == 1:
        return tl.where(u > 0, tl.exp2(param * tl.log2(tl.where(u > 0, u, 1.0))), 0.0)
    return expm1(u * param)


@triton.jit
def _feature_grads(x, phi, channel, D, param, grad_phi, flip, FEATURE: tl.constexpr):
    """``(dL/dx, dL/dparam)`` per entry of :func:`_features` from ``dL/dφ``: Pola ``φ = uᵖ`` gives
    ``p·φ/u`` and ``φ·log u``, PaCS ``φ = exp(u·T) − 1`` gives ``T·(φ + 1)`` and ``u·(φ + 1)`` (``u = relu(±x)``,
    zero where ``u = 0``)."""
    if FEATURE == 0:
        return grad_phi, grad_phi * 0.0
    sign = tl.where(((channel < D).to(tl.int32) ^ flip) != 0, 1.0, -1.0)[None, :]
    u = tl.maximum(x * sign, 0.0)
    active = u > 0
    if FEATURE == 1:
        safe = tl.where(active, u, 1.0)
        grad_x = tl.where(active, grad_phi * param * phi / safe, 0.0) * sign
        return grad_x, tl.where(active, grad_phi * phi * tl.log(safe), 0.0)
    grad_x = tl.where(active, grad_phi * param * (phi + 1.0), 0.0) * sign
    return grad_x, grad_phi * u * (phi + 1.0)


@triton.jit
def _rotate(x, sin, cos, WIDTH: tl.constexpr):
    """RoPE on a (rows × WIDTH) block starting at an even channel: pair ``(2i, 2i+1)`` turns by its angle."""
    local = tl.arange(0, WIDTH)
    partner = tl.gather(x, tl.broadcast_to((local ^ 1)[None, :], x.shape), 1)
    return x * cos + tl.where((local % 2 == 0)[None, :], -partner, partner) * sin


@triton.jit
def _rotate_back(grad, sin, cos, WIDTH: tl.constexpr):
    """The transpose of :func:`_rotate`: the gradient of its input from its output's."""
    local = tl.arange(0, WIDTH)
    signed = tl.where((local % 2 == 0)[None, :], -grad, grad) * sin
    return grad * cos + tl.gather(signed, tl.broadcast_to((local ^ 1)[None, :], grad.shape), 1)


@triton.jit
def _fold(x, D, WIDTH: tl.constexpr):
    """Columns ``m < D`` of ``x[:, m] + x[:, m + D]``: both features of input channel ``m``."""
    upper = tl.minimum(tl.arange(0, WIDTH) + D, WIDTH - 1)
    return x + tl.gather(x, tl.broadcast_to(upper[None, :], x.shape), 1)


@triton.jit
def _row_scale(row_max):
    """The largest power of two not above each row's maximum, and at least 1."""
    return tl.exp2(tl.floor(tl.log2(tl.maximum(row_max, 1.0))))


@triton.jit
def _param_row(ptr, batch, head, channel, D, F, stride_b, stride_h, stride_c, FEATURE: tl.constexpr):
    """The exponent (Pola, per input channel) or temperature (PaCS, per feature channel) of each channel."""
    source = channel % D if FEATURE == 1 else channel
    return tl.load(ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + source * stride_c,
                   mask=channel < F, other=1.0)


@triton.jit
def _temperature(p0_ptr, p1_ptr, S: tl.constexpr, batch, head, channel, D, F, stride_pb, stride_ph, stride_pc,
                 stride_sb, stride_sh, stride_sc):
    """PaCS: stream ``S``'s temperature of each feature channel, as a row."""
    if S == 0:
        row = _param_row(p0_ptr, batch, head, channel, D, F, stride_pb, stride_ph, stride_pc, 2)
    else:
        row = _param_row(p1_ptr, batch, head, channel, D, F, stride_sb, stride_sh, stride_sc, 2)
    return row[None, :]


@triton.jit
def _chunk_keys(k_ptr, sin_ptr, cos_ptr, mask_ptr, key_param, batch, head, t, valid, rows, channel, D, F,
                stride_kb, stride_kh, stride_kt, stride_kc, stride_rt, stride_rc, stride_mb, stride_mt,
                dtype: tl.constexpr, FP: tl.constexpr, FEATURE: tl.constexpr, ROPE: tl.constexpr,
                HAS_MASK: tl.constexpr):
    """A chunk's keys as the output and backward kernels read them: ``(keep, x_k, φk, k_num, sin, cos)``, the
    unpadded valid rows, the inputs, their features (zero on padded rows), the numerator's (RoPE-rotated) and the
    RoPE tables' rows (without RoPE ``φk`` stands in for them, unread)."""
    keep = _keep(mask_ptr, batch, t, valid, stride_mb, stride_mt, HAS_MASK)
    x_k = _tile(k_ptr + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh, rows, channel % D, stride_kt,
                stride_kc, valid, channel < F, dtype)
    phi_k = tl.where(keep[:, None], _features(x_k, channel, D, key_param, 0, FEATURE), 0.0)
    k_num = phi_k
    sin = phi_k
    cos = phi_k
    if ROPE:
        sin = _tile(sin_ptr, rows, channel, stride_rt, stride_rc, valid, channel < F, dtype)
        cos = _tile(cos_ptr, rows, channel, stride_rt, stride_rc, valid, channel < F, dtype)
        k_num = _rotate(phi_k, sin, cos, FP)
    return keep, x_k, phi_k, k_num, sin, cos


@triton.jit
def _sequence(seq, cu_ptr, LENGTH, CHUNKS, CHUNK: tl.constexpr, PACKED: tl.constexpr):
    """(batch, first row, length, first work item, chunks) of sequence ``seq``."""
    if PACKED:
        batch = seq * 0
        start = tl.load(cu_ptr + seq).to(tl.int64)
        length = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
        first_item = start // CHUNK + seq
        chunks = tl.cdiv(length, CHUNK)
    else:
        batch = seq
        start = seq.to(tl.int64) * 0
        length = start + LENGTH
        first_item = seq.to(tl.int64) * CHUNKS
        chunks = start + CHUNKS
    return batch, start, length, first_item, chunks


@triton.jit
def _locate(item, cu_ptr, SEQS, SEARCH_STEPS, LENGTH, CHUNKS, CHUNK: tl.constexpr, PACKED: tl.constexpr):
    """(batch, first row of the sequence, its length, the chunk's first token in it) of work item ``item``; an
    item past its sequence's chunks gets a first token at or past the length. Packed: the last sequence ``s``
    with ``cu[s] // CHUNK + s <= item``, by bisection."""
    if PACKED:
        lo = item * 0
        hi = lo + SEQS
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            owns = tl.load(cu_ptr + mid).to(tl.int64) // CHUNK + mid <= item
            lo = tl.where(owns, mid, lo)
            hi = tl.where(owns, hi, mid)
        batch = lo * 0
        start = tl.load(cu_ptr + lo).to(tl.int64)
        length = tl.load(cu_ptr + lo + 1).to(tl.int64) - start
        first = (item - start // CHUNK - lo) * CHUNK
    else:
        batch = item // CHUNKS
        start = item.to(tl.int64) * 0
        length = start + LENGTH
        first = start + (item % CHUNKS) * CHUNK
    return batch, start, length, first


@triton.jit
def _tile(ptr, rows, cols, stride_row, stride_col, row_ok, col_ok, dtype: tl.constexpr):
    """A (rows × cols) block, zero outside the valid rows and columns."""
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(dtype)


@triton.jit
def _keep(mask_ptr, batch, t, valid, stride_mb, stride_mt, HAS_MASK: tl.constexpr):
    """The valid, unpadded keys among tokens ``t`` of the sequence."""
    return unpadded_keys(mask_ptr + batch.to(tl.int64) * stride_mb, t.to(tl.int64), valid, stride_mt, HAS_MASK)


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _walk_kernel(
    k_ptr, v_ptr, p_ptr, sin_ptr, cos_ptr, mask_ptr, cu_ptr,
    kv0_ptr, kv1_ptr, key0_ptr, count0_ptr,
    states_ptr, keys_ptr, counts_ptr, final0_ptr, final1_ptr, final_key_ptr, final_count_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_pb, stride_ph, stride_pc, stride_rt, stride_rc, stride_mb, stride_mt,
    stride_ab, stride_ah, stride_af, stride_av,
    stride_bb, stride_bh, stride_bf, stride_bv,
    stride_eb, stride_eh, stride_ef, stride_nb,
    HEADS, LENGTH, D, F, W0, W1, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, WP: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
    STREAMS: tl.constexpr, FEATURE: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr,
    PACKED: tl.constexpr, HAS_INITIAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """The state entering every chunk of one (sequence, head): one (BF × BV) tile of a stream's ``S``, the
    key sum ``K`` over those BF channels (value tile 0 of stream 0) and the count (also head 0, feature tile
    0); then the final state. Grid: (sequences·H, FP / BF, streams·WP / BV)."""
    seq, head = tl.program_id(0) // HEADS, tl.program_id(0) % HEADS
    batch, start, length, first_item, chunks = _sequence(seq, cu_ptr, LENGTH, CHUNKS, CHUNK, PACKED)
    acc_t = states_ptr.dtype.element_ty
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    stream = tl.program_id(2) // (WP // BV)
    j = (tl.program_id(2) % (WP // BV)) * BV + tl.arange(0, BV)
    width = tl.where(stream == 0, W0, W1)
    col0 = stream * W0
    writes_keys = tl.program_id(2) == 0
    writes_count = writes_keys & (tl.program_id(1) == 0) & (head == 0)
    inside = (f < F)[:, None] & (j < width)[None, :]
    b64, h64 = batch.to(tl.int64), head.to(tl.int64)
    state = tl.zeros([BF, BV], dtype=acc_t)
    key_sum = tl.zeros([BF], dtype=acc_t)
    count = tl.zeros([1], dtype=acc_t)
    if HAS_INITIAL:  # each program loads its stream's tile: one of the two loads is masked off
        state += tl.load(kv0_ptr + b64 * stride_ab + h64 * stride_ah + f[:, None] * stride_af + j[None, :] * stride_av,
                         mask=inside & (stream == 0), other=0.0).to(acc_t)
        state += tl.load(kv1_ptr + b64 * stride_bb + h64 * stride_bh + f[:, None] * stride_bf + j[None, :] * stride_bv,
                         mask=inside & (stream == 1), other=0.0).to(acc_t)
        key_sum += tl.load(key0_ptr + b64 * stride_eb + h64 * stride_eh + f * stride_ef, mask=f < F,
                           other=0.0).to(acc_t)
        count += tl.load(count0_ptr + b64 * stride_nb + tl.arange(0, 1)).to(acc_t)
    param = 1.0
    if FEATURE == 1:
        param = _param_row(p_ptr, batch, head, f, D, F, stride_pb, stride_ph, stride_pc, FEATURE)[None, :]
    k_base = k_ptr + b64 * stride_kb + h64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + h64 * stride_vh
    cell = f[:, None] * WP + j[None, :]
    for chunk in range(chunks):
        item = first_item + chunk
        slot = (item * HEADS + head) * STREAMS + stream
        tl.store(states_ptr + slot * (FP * WP) + cell, state)
        if writes_keys:
            tl.store(keys_ptr + (item * HEADS + head) * FP + f, key_sum)
        if writes_count:
            tl.store(counts_ptr + item + tl.arange(0, 1), count)
        t = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = t < length
        rows = start + t
        keep = _keep(mask_ptr, batch, t, valid, stride_mb, stride_mt, HAS_MASK)
        x = _tile(k_base, rows, f % D, stride_kt, stride_kc, valid, f < F, acc_t)
        phi = tl.where(keep[:, None], _features(x, f, D, param, 0, FEATURE), 0.0)
        k_num = phi
        if ROPE:
            sin = _tile(sin_ptr, rows, f, stride_rt, stride_rc, valid, f < F, acc_t)
            cos = _tile(cos_ptr, rows, f, stride_rt, stride_rc, valid, f < F, acc_t)
            k_num = _rotate(phi, sin, cos, BF)
        values = _tile(v_base, rows, col0 + j, stride_vt, stride_vc, valid, j < width, acc_t)
        state += dot(tl.trans(k_num), values, DOT, PRECISION, acc_t)
        key_sum += tl.sum(phi, 0)
        count += tl.sum(keep.to(acc_t), 0)
    final = ((seq.to(tl.int64) * HEADS + head) * F + f[:, None]) * width + j[None, :]
    tl.store(final0_ptr + final, state, mask=inside & (stream == 0))
    tl.store(final1_ptr + final, state, mask=inside & (stream == 1))
    if writes_keys:
        tl.store(final_key_ptr + (seq.to(tl.int64) * HEADS + head) * F + f, key_sum, mask=f < F)
    if writes_count:
        tl.store(final_count_ptr + seq + tl.arange(0, 1), count)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, v_ptr, p0_ptr, p1_ptr, sin_ptr, cos_ptr, mask_ptr, cu_ptr,
    states_ptr, keys_ptr, counts_ptr, out_ptr, stats_ptr, eps,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_ob, stride_oh, stride_ot, stride_oc,
    stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc,
    stride_rt, stride_rc, stride_mb, stride_mt,
    HEADS, LENGTH, D, F, W0, W1, CHUNKS, SEQS, SEARCH_STEPS,
    CHUNK: tl.constexpr, FP: tl.constexpr, WP: tl.constexpr, STREAMS: tl.constexpr, FEATURE: tl.constexpr,
    ROPE: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Both streams' outputs of one chunk of one head, and per row and stream the normaliser's reciprocal and
    the row scale's (``stats`` (B, H, N, 4): [1/den_0, 1/den_1, 1/scale_0, 1/scale_1]). Grid: (items, H)."""
    item, head = tl.program_id(0), tl.program_id(1)
    batch, start, length, t0 = _locate(item, cu_ptr, SEQS, SEARCH_STEPS, LENGTH, CHUNKS, CHUNK, PACKED)
    if t0 < length:
        acc_t = states_ptr.dtype.element_ty
        b64, h64 = batch.to(tl.int64), head.to(tl.int64)
        t = t0 + tl.arange(0, CHUNK)
        valid = t < length
        rows = start + t
        c = tl.arange(0, FP)
        j = tl.arange(0, WP)
        key_param = 1.0
        if FEATURE == 1:
            key_param = _param_row(p0_ptr, batch, head, c, D, F, stride_pb, stride_ph, stride_pc, FEATURE)[None, :]
        keep, x_k, phi_k, k_num, sin, cos = _chunk_keys(
            k_ptr, sin_ptr, cos_ptr, mask_ptr, key_param, batch, head, t, valid, rows, c, D, F, stride_kb, stride_kh,
            stride_kt, stride_kc, stride_rt, stride_rc, stride_mb, stride_mt, acc_t, FP, FEATURE, ROPE, HAS_MASK)
        count = tl.maximum(tl.load(counts_ptr + item) + tl.cumsum(keep.to(acc_t), 0), 1.0)
        slot = item.to(tl.int64) * HEADS + head
        key_sum = tl.load(keys_ptr + slot * FP + c)
        x_q = _tile(q_ptr + b64 * stride_qb + h64 * stride_qh, rows, c % D, stride_qt, stride_qc, valid, c < F,
                    acc_t)
        seen = t[:, None] >= t[None, :]
        stats = stats_ptr + ((b64 * HEADS + head) * LENGTH + rows) * 4
        for s in tl.static_range(STREAMS):
            param = key_param
            if FEATURE == 2:
                param = _temperature(p0_ptr, p1_ptr, s, batch, head, c, D, F, stride_pb, stride_ph, stride_pc,
                                     stride_sb, stride_sh, stride_sc)
            phi_q = _features(x_q, c, D, param, s, FEATURE)
            inv_scale = 1.0 / _row_scale(tl.max(phi_q, 1))
            phi_q = phi_q * inv_scale[:, None]
            q_num = phi_q
            if ROPE:
                q_num = _rotate(phi_q, sin, cos, FP)
            state = tl.load(states_ptr + (slot * STREAMS + s) * (FP * WP) + c[:, None] * WP + j[None, :])
            col_ok = j < (W0 if s == 0 else W1)
            values = _tile(v_ptr + b64 * stride_vb + h64 * stride_vh, rows, s * W0 + j, stride_vt, stride_vc, valid,
                           col_ok, acc_t)
            scores = tl.where(seen, dot(q_num, tl.trans(k_num), DOT, PRECISION, acc_t), 0.0)
            num = dot(q_num, state, DOT, PRECISION, acc_t)
            num += dot(scores, values, DOT, PRECISION, acc_t)
            if ROPE:  # the normaliser pairs the features without rotation
                scores = tl.where(seen, dot(phi_q, tl.trans(phi_k), DOT, PRECISION, acc_t), 0.0)
            den = tl.sum(scores, 1) + tl.sum(phi_q * key_sum[None, :], 1) + eps * inv_scale * count
            inv_den = 1.0 / den
            out = num * inv_den[:, None]
            tl.store(out_ptr + b64 * stride_ob + h64 * stride_oh + rows[:, None] * stride_ot
                     + (s * W0 + j)[None, :] * stride_oc, out.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None] & col_ok[None, :])
            tl.store(stats + s, inv_den, mask=valid)
            tl.store(stats + 2 + s, inv_scale, mask=valid)


@triton.jit
def _walk_back_kernel(
    q_ptr, p0_ptr, p1_ptr, sin_ptr, cos_ptr, cu_ptr, out_ptr, grad_out_ptr, stats_ptr,
    grad_final0_ptr, grad_final1_ptr, grad_final_key_ptr,
    grad_states_ptr, grad_keys_ptr, grad_initial0_ptr, grad_initial1_ptr, grad_initial_key_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_ob, stride_oh, stride_ot, stride_oc,
    stride_gb, stride_gh, stride_gt, stride_gc,
    stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc, stride_rt, stride_rc,
    stride_ab, stride_ah, stride_af, stride_av,
    stride_bb, stride_bh, stride_bf, stride_bv,
    stride_eb, stride_eh, stride_ef,
    HEADS, LENGTH, D, F, W0, W1, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, WP: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
    STREAMS: tl.constexpr, FEATURE: tl.constexpr, ROPE: tl.constexpr, PACKED: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, HAS_FINAL_KEY_GRAD: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """The gradients of a stream's state tile and key sum leaving every chunk (``dS += q̃ᵀ dnum`` and
    ``dK += φqᵀ dden`` over the later chunks, ``dnum = dO / den``, ``dden = −rowsum(dO ∘ O) / den``), walking
    the chunks backwards, and those of the initial state. Grid as :func:`_walk_kernel`'s."""
    seq, head = tl.program_id(0) // HEADS, tl.program_id(0) % HEADS
    batch, start, length, first_item, chunks = _sequence(seq, cu_ptr, LENGTH, CHUNKS, CHUNK, PACKED)
    acc_t = grad_states_ptr.dtype.element_ty
    b64, h64 = batch.to(tl.int64), head.to(tl.int64)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    stream = tl.program_id(2) // (WP // BV)
    j = (tl.program_id(2) % (WP // BV)) * BV + tl.arange(0, BV)
    width = tl.where(stream == 0, W0, W1)
    col0 = stream * W0
    writes_keys = tl.program_id(2) % (WP // BV) == 0
    inside = (f < F)[:, None] & (j < width)[None, :]
    grad_state = tl.zeros([BF, BV], dtype=acc_t)
    if HAS_FINAL_GRAD:
        grad_state += tl.load(grad_final0_ptr + b64 * stride_ab + h64 * stride_ah + f[:, None] * stride_af
                              + j[None, :] * stride_av, mask=inside & (stream == 0), other=0.0).to(acc_t)
        grad_state += tl.load(grad_final1_ptr + b64 * stride_bb + h64 * stride_bh + f[:, None] * stride_bf
                              + j[None, :] * stride_bv, mask=inside & (stream == 1), other=0.0).to(acc_t)
    grad_key = tl.zeros([BF], dtype=acc_t)
    if HAS_FINAL_KEY_GRAD:  # the key sum is shared: its gradient enters through stream 0 only
        grad_key += tl.load(grad_final_key_ptr + b64 * stride_eb + h64 * stride_eh + f * stride_ef,
                            mask=(f < F) & (stream == 0), other=0.0).to(acc_t)
    param = 1.0
    if FEATURE == 1:
        param = _param_row(p0_ptr, batch, head, f, D, F, stride_pb, stride_ph, stride_pc, FEATURE)[None, :]
    if FEATURE == 2:
        param = tl.where(stream == 0,
                         _param_row(p0_ptr, batch, head, f, D, F, stride_pb, stride_ph, stride_pc, FEATURE),
                         _param_row(p1_ptr, batch, head, f, D, F, stride_sb, stride_sh, stride_sc, FEATURE))[None, :]
    q_base = q_ptr + b64 * stride_qb + h64 * stride_qh
    g_base = grad_out_ptr + b64 * stride_gb + h64 * stride_gh
    o_base = out_ptr + b64 * stride_ob + h64 * stride_oh
    w = tl.arange(0, WP)
    cell = f[:, None] * WP + j[None, :]
    for step in range(chunks):
        chunk = chunks - 1 - step
        item = first_item + chunk
        slot = (item * HEADS + head) * STREAMS + stream
        tl.store(grad_states_ptr + slot * (FP * WP) + cell, grad_state)
        if writes_keys:
            tl.store(grad_keys_ptr + slot * FP + f, grad_key)
        t = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = t < length
        rows = start + t
        stats = stats_ptr + ((b64 * HEADS + head) * LENGTH + rows) * 4
        inv_den = tl.load(stats + stream, mask=valid, other=0.0)
        inv_scale = tl.load(stats + 2 + stream, mask=valid, other=0.0)
        x = _tile(q_base, rows, f % D, stride_qt, stride_qc, valid, f < F, acc_t)
        phi = _features(x, f, D, param, stream, FEATURE) * inv_scale[:, None]
        q_num = phi
        if ROPE:
            sin = _tile(sin_ptr, rows, f, stride_rt, stride_rc, valid, f < F, acc_t)
            cos = _tile(cos_ptr, rows, f, stride_rt, stride_rc, valid, f < F, acc_t)
            q_num = _rotate(phi, sin, cos, BF)
        grad_num = _tile(g_base, rows, col0 + j, stride_gt, stride_gc, valid, j < width, acc_t) * inv_den[:, None]
        grad_state += dot(tl.trans(q_num), grad_num, DOT, PRECISION, acc_t)
        if writes_keys:
            grad_out = _tile(g_base, rows, col0 + w, stride_gt, stride_gc, valid, w < width, acc_t)
            out = _tile(o_base, rows, col0 + w, stride_ot, stride_oc, valid, w < width, acc_t)
            grad_den = -tl.sum(grad_out * out, 1) * inv_den
            grad_key += tl.sum(phi * grad_den[:, None], 0)
    initial = ((seq.to(tl.int64) * HEADS + head) * F + f[:, None]) * width + j[None, :]
    tl.store(grad_initial0_ptr + initial, grad_state, mask=inside & (stream == 0))
    tl.store(grad_initial1_ptr + initial, grad_state, mask=inside & (stream == 1))
    if writes_keys:
        tl.store(grad_initial_key_ptr + ((seq.to(tl.int64) * HEADS + head) * STREAMS + stream) * F + f, grad_key,
                 mask=f < F)


@triton.jit
def _grads_kernel(
    q_ptr, k_ptr, v_ptr, p0_ptr, p1_ptr, sin_ptr, cos_ptr, mask_ptr, cu_ptr,
    states_ptr, keys_ptr, out_ptr, grad_out_ptr, stats_ptr, grad_states_ptr, grad_keys_ptr,
    grad_q_ptr, grad_k_ptr, grad_v_ptr, grad_param_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_ob, stride_oh, stride_ot, stride_oc,
    stride_gb, stride_gh, stride_gt, stride_gc,
    stride_dqb, stride_dqh, stride_dqt, stride_dqc,
    stride_dkb, stride_dkh, stride_dkt, stride_dkc,
    stride_dvb, stride_dvh, stride_dvt, stride_dvc,
    stride_pb, stride_ph, stride_pc, stride_sb, stride_sh, stride_sc,
    stride_rt, stride_rc, stride_mb, stride_mt,
    HEADS, LENGTH, D, F, W0, W1, CHUNKS, SEQS, SEARCH_STEPS,
    CHUNK: tl.constexpr, FP: tl.constexpr, WP: tl.constexpr, STREAMS: tl.constexpr, FEATURE: tl.constexpr,
    ROPE: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Gradients of q, k and v over one chunk of one head, from the states entering it, the gradients leaving
    it and the saved rows; and the chunk's share of the exponent's (Pola, in ``grad_param[item, head, 0]``) or
    the temperatures' gradients (PaCS, one row per stream), zero for items without tokens. Per stream, with
    ``A = tril(q̃ k̃ᵀ)``, ``dA = tril(dnum vᵀ)``::

        dq̃ = dnum Sᵀ + dA k̃      dk̃ += dAᵀ q̃ + v dS'ᵀ      dv = Aᵀ dnum + k̃ dS'
        dφq = dden·(K + cumsum φk)      dφk += reverse cumsum(dden·φq) + dK'

    Grid: (items, H)."""
    item, head = tl.program_id(0), tl.program_id(1)
    batch, start, length, t0 = _locate(item, cu_ptr, SEQS, SEARCH_STEPS, LENGTH, CHUNKS, CHUNK, PACKED)
    acc_t = states_ptr.dtype.element_ty
    c = tl.arange(0, FP)
    slot = item.to(tl.int64) * HEADS + head
    grad_param0 = tl.zeros([FP], dtype=acc_t)
    grad_param1 = tl.zeros([FP], dtype=acc_t)
    if t0 < length:
        b64, h64 = batch.to(tl.int64), head.to(tl.int64)
        t = t0 + tl.arange(0, CHUNK)
        valid = t < length
        rows = start + t
        j = tl.arange(0, WP)
        key_param = 1.0
        if FEATURE == 1:
            key_param = _param_row(p0_ptr, batch, head, c, D, F, stride_pb, stride_ph, stride_pc, FEATURE)[None, :]
        keep, x_k, phi_k, k_num, sin, cos = _chunk_keys(
            k_ptr, sin_ptr, cos_ptr, mask_ptr, key_param, batch, head, t, valid, rows, c, D, F, stride_kb, stride_kh,
            stride_kt, stride_kc, stride_rt, stride_rc, stride_mb, stride_mt, acc_t, FP, FEATURE, ROPE, HAS_MASK)
        key_prefix = tl.load(keys_ptr + slot * FP + c)[None, :] + tl.cumsum(phi_k, 0)
        x_q = _tile(q_ptr + b64 * stride_qb + h64 * stride_qh, rows, c % D, stride_qt, stride_qc, valid, c < F,
                    acc_t)
        seen = t[:, None] >= t[None, :]
        stats = stats_ptr + ((b64 * HEADS + head) * LENGTH + rows) * 4
        grad_k_num = tl.zeros([CHUNK, FP], dtype=acc_t)
        grad_phi_k = tl.zeros([CHUNK, FP], dtype=acc_t)
        grad_x_q = tl.zeros([CHUNK, FP], dtype=acc_t)
        for s in tl.static_range(STREAMS):
            param = key_param
            if FEATURE == 2:
                param = _temperature(p0_ptr, p1_ptr, s, batch, head, c, D, F, stride_pb, stride_ph, stride_pc,
                                     stride_sb, stride_sh, stride_sc)
            inv_den = tl.load(stats + s, mask=valid, other=0.0)
            inv_scale = tl.load(stats + 2 + s, mask=valid, other=0.0)
            raw_q = _features(x_q, c, D, param, s, FEATURE)
            phi_q = raw_q * inv_scale[:, None]
            q_num = phi_q
            if ROPE:
                q_num = _rotate(phi_q, sin, cos, FP)
            cols = s * W0 + j
            col_ok = j < (W0 if s == 0 else W1)
            values = _tile(v_ptr + b64 * stride_vb + h64 * stride_vh, rows, cols, stride_vt, stride_vc, valid, col_ok,
                           acc_t)
            grad_out = _tile(grad_out_ptr + b64 * stride_gb + h64 * stride_gh, rows, cols, stride_gt, stride_gc,
                             valid, col_ok, acc_t)
            out = _tile(out_ptr + b64 * stride_ob + h64 * stride_oh, rows, cols, stride_ot, stride_oc, valid, col_ok,
                        acc_t)
            grad_num = grad_out * inv_den[:, None]
            grad_den = -tl.sum(grad_out * out, 1) * inv_den
            state_cell = (slot * STREAMS + s) * (FP * WP) + c[:, None] * WP + j[None, :]
            state = tl.load(states_ptr + state_cell)
            grad_state = tl.load(grad_states_ptr + state_cell)
            scores = tl.where(seen, dot(q_num, tl.trans(k_num), DOT, PRECISION, acc_t), 0.0)
            grad_scores = tl.where(seen, dot(grad_num, tl.trans(values), DOT, PRECISION, acc_t), 0.0)
            grad_v = dot(tl.trans(scores), grad_num, DOT, PRECISION, acc_t)
            grad_v += dot(k_num, grad_state, DOT, PRECISION, acc_t)
            tl.store(grad_v_ptr + b64 * stride_dvb + h64 * stride_dvh + rows[:, None] * stride_dvt
                     + cols[None, :] * stride_dvc, grad_v.to(grad_v_ptr.dtype.element_ty),
                     mask=valid[:, None] & col_ok[None, :])
            grad_q_num = dot(grad_num, tl.trans(state), DOT, PRECISION, acc_t)
            grad_q_num += dot(grad_scores, k_num, DOT, PRECISION, acc_t)
            grad_k_num += dot(tl.trans(grad_scores), q_num, DOT, PRECISION, acc_t)
            grad_k_num += dot(values, tl.trans(grad_state), DOT, PRECISION, acc_t)
            if ROPE:
                grad_q_num = _rotate_back(grad_q_num, sin, cos, FP)
            grad_phi_q = grad_q_num + grad_den[:, None] * key_prefix
            grad_phi_k += tl.cumsum(grad_den[:, None] * phi_q, 0, reverse=True)
            grad_x, grad_p = _feature_grads(x_q, raw_q, c, D, param, grad_phi_q * inv_scale[:, None], s, FEATURE)
            grad_x_q += grad_x
            if FEATURE == 1:
                grad_param0 += tl.sum(grad_p, 0)
            if FEATURE == 2:
                if s == 0:
                    grad_param0 += tl.sum(grad_p, 0)
                else:
                    grad_param1 += tl.sum(grad_p, 0)
        grad_keys = tl.load(grad_keys_ptr + slot * STREAMS * FP + c)
        if STREAMS == 2:
            grad_keys += tl.load(grad_keys_ptr + (slot * STREAMS + 1) * FP + c)
        if ROPE:
            grad_k_num = _rotate_back(grad_k_num, sin, cos, FP)
        grad_phi_k = tl.where(keep[:, None], grad_phi_k + grad_k_num + grad_keys[None, :], 0.0)
        grad_x_k, grad_p = _feature_grads(x_k, phi_k, c, D, key_param, grad_phi_k, 0, FEATURE)
        if FEATURE == 1:
            grad_param0 += tl.sum(grad_p, 0)
        if FEATURE != 0:
            grad_x_q = _fold(grad_x_q, D, FP)
            grad_x_k = _fold(grad_x_k, D, FP)
        input_ok = valid[:, None] & (c < D)[None, :]
        tl.store(grad_q_ptr + b64 * stride_dqb + h64 * stride_dqh + rows[:, None] * stride_dqt
                 + c[None, :] * stride_dqc, grad_x_q.to(grad_q_ptr.dtype.element_ty), mask=input_ok)
        tl.store(grad_k_ptr + b64 * stride_dkb + h64 * stride_dkh + rows[:, None] * stride_dkt
                 + c[None, :] * stride_dkc, grad_x_k.to(grad_k_ptr.dtype.element_ty), mask=input_ok)
    if FEATURE == 1:  # the exponent is per input channel: fold its two feature channels
        grad_param0 += tl.gather(grad_param0, tl.minimum(c + D, FP - 1), 0)
    tl.store(grad_param_ptr + slot * 2 * FP + c, grad_param0)
    tl.store(grad_param_ptr + (slot * 2 + 1) * FP + c, grad_param1)


# ---------------------------------------------------------------------------------------------------- launches


def _as_is(kernel):
    return kernel


def _strides(x: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return (0,) * n if x is None else tuple(x.stride())


class _Call:
    """Sizes, buffers, grids and flags of one call, from shapes alone (so the fake kernels share them)."""

    def __init__(self, feature, q, k, v, param0, param1, sin, key_padding_mask, cu_seqlens, chunk_size):
        self.feature = feature
        self.streams = 1 if feature == 0 else 2
        self.batch, self.heads, self.length, self.d = q.shape
        self.dv = v.shape[-1]
        self.w0 = self.dv if self.streams == 1 else (self.dv + 1) // 2
        self.w1 = self.dv - self.w0
        self.f = self.d if feature == 0 else 2 * self.d
        self.fp, self.wp = padded_width(self.f), padded_width(self.w0)
        self.chunk = kernel_chunk(chunk_size, self.f)
        self.packed = cu_seqlens is not None
        if self.packed:
            self.seqs = cu_seqlens.shape[0] - 1
            self.chunks = 1
            self.items = self.length // self.chunk + self.seqs
        else:
            self.seqs = self.batch
            self.chunks = triton.cdiv(max(self.length, 1), self.chunk)
            self.items = self.batch * self.chunks
        self.acc = accumulator_dtype(*(t for t in (q, k, v, param0, param1) if t is not None))
        # products of unbounded features and gradients: fp16 inputs multiply in TF32 (see common.dots)
        self.dots = dots(q, k, v, bounded=False)
        # State tiles: smaller on a GPU, so that more programs share the sequential walk over the chunks; 16
        # under the interpreter, whose small test widths then span several tiles.
        tile = 32 if q.is_cuda else 16
        self.bf, self.bv = min(self.fp, tile), min(self.wp, tile)
        self.walk_grid = (self.seqs * self.heads, self.fp // self.bf, self.streams * (self.wp // self.bv))
        self.item_grid = (self.items, self.heads)
        self.flags = dict(CHUNK=self.chunk, FP=self.fp, WP=self.wp, STREAMS=self.streams, FEATURE=feature,
                          ROPE=sin is not None, PACKED=self.packed, DOT=self.dots.operands,
                          PRECISION=self.dots.precision)
        self.sizes = dict(HEADS=self.heads, LENGTH=self.length, D=self.d, F=self.f, W0=self.w0, W1=self.w1,
                          CHUNKS=self.chunks)
        self.has_mask = key_padding_mask is not None

    def search(self) -> dict:
        """The per-chunk kernels' bisection over the offsets: the sequences and the steps it takes (a launch-time
        value: under torch.compile the number of sequences may be symbolic)."""
        return dict(SEQS=self.seqs, SEARCH_STEPS=max(self.seqs - 1, 0).bit_length())

    def forward_buffers(self, v):
        """(out, final kv₀, final kv₁, final key sum, final count, stats, states, keys, counts); ``out`` is
        (B, H, N, dv) over (B, N, H, dv) memory, which the layers' ``transpose(1, 2).reshape`` reads as is."""
        acc, h, f = self.acc, self.heads, self.f
        out = v.new_empty(self.batch, self.length, h, self.dv).transpose(1, 2)
        finals = (v.new_empty(self.seqs, h, f, self.w0, dtype=acc), v.new_empty(self.seqs, h, f, self.w1, dtype=acc),
                  v.new_empty(self.seqs, h, f, dtype=acc), v.new_empty(self.seqs, 1, 1, dtype=acc))
        saved = (v.new_empty(self.batch, h, self.length, 4, dtype=acc),
                 v.new_empty(self.items, h, self.streams, self.fp, self.wp, dtype=acc),
                 v.new_empty(self.items, h, self.fp, dtype=acc), v.new_empty(self.items, dtype=acc))
        return (out, *finals, *saved)

    def backward_buffers(self, q, k, v):
        """(grad_q, grad_k, grad_v, grad kv₀, grad kv₁, per-stream grad key sum, grad states, grad keys, per-chunk
        parameter gradients)."""
        acc, h, f = self.acc, self.heads, self.f
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                v.new_empty(self.seqs, h, f, self.w0, dtype=acc), v.new_empty(self.seqs, h, f, self.w1, dtype=acc),
                v.new_empty(self.seqs, h, self.streams, f, dtype=acc),
                v.new_empty(self.items, h, self.streams, self.fp, self.wp, dtype=acc),
                v.new_empty(self.items, h, self.streams, self.fp, dtype=acc),
                v.new_empty(self.items, h, 2, self.fp, dtype=acc))

    def shared_args(self, q, param0, param1, sin, cos, key_padding_mask, cu_seqlens) -> SimpleNamespace:
        """What both passes' kernels read besides q, k, v: the parameters as (B, H, channels) views (Pola's
        exponent per input channel, PaCS's temperatures per feature channel), the tables, the mask as bytes
        and the offsets, a dummy pointer where one is absent; and their strides."""
        dummy = q.new_empty(1)
        width = self.d if self.feature == 1 else self.f
        rows = [None if p is None else p.expand(self.batch, self.heads, 1, width)[:, :, 0] for p in (param0, param1)]
        return SimpleNamespace(
            dummy=dummy, p0=dummy if rows[0] is None else rows[0], p1=dummy if rows[1] is None else rows[1],
            sin=dummy if sin is None else sin, cos=dummy if cos is None else cos,
            mask=dummy if key_padding_mask is None else key_padding_mask.view(torch.uint8),
            cu=dummy if cu_seqlens is None else cu_seqlens,
            param_strides=(*_strides(rows[0], 3), *_strides(rows[1], 3)),
            table_strides=_strides(sin, 2), mask_strides=_strides(key_padding_mask, 2),
        )

    def reduce_params(self, partials, param0, param1, need0, need1):
        """Each parameter's gradient from the per-chunk partial sums (items, H, 2, FP): summed over the chunks
        and the dimensions the parameter broadcasts over, one reduction where both share a shape."""
        width = self.d if self.feature == 1 else self.f
        blocks = partials.view(1 if self.packed else self.batch, -1, self.heads, 2, 1, self.fp)[..., :width]
        params = (param0, param1)
        wanted = [r for r, need in enumerate((need0, need1)) if need]
        if len(wanted) == 2 and param0.shape == param1.shape:
            summed = _sum_to(blocks, param0.shape)
            grads = [summed[:, :, :, r] for r in (0, 1)]
        else:
            grads = [None, None]
            for r in wanted:
                grads[r] = _sum_to(blocks[:, :, :, r], params[r].shape)
        return [None if g is None else g.reshape(p.shape).to(p.dtype) for g, p in zip(grads, params)]


def _sum_to(blocks: torch.Tensor, shape) -> torch.Tensor:
    """``blocks`` (B, chunks, H, [rows,] 1, W) summed over the chunks and the dimensions along which a
    parameter of ``shape`` (broadcastable to (B, H, 1, W)) is broadcast, in one reduction (dimensions kept)."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = (0, 2, blocks.dim() - 2, blocks.dim() - 1)
    full = (blocks.shape[0], blocks.shape[2], 1, blocks.shape[-1])
    dims = [1] + [a for a, n, m in zip(axes, shape4, full) if n == 1 and m != 1]
    return blocks.sum(dims, keepdim=True)


def _forward(feature, eps, chunk_size, q, k, v, param0, param1, sin, cos, key_padding_mask, cu_seqlens, kv0, kv1,
             key_sum, count, traced=False):
    """The forward kernels; returns :meth:`_Call.forward_buffers` filled. ``traced``: launched as a registered op's
    body (:func:`polaformer.backends.triton.common.traceable`)."""
    launch = traceable if traced else _as_is
    call = _Call(feature, q, k, v, param0, param1, sin, key_padding_mask, cu_seqlens, chunk_size)
    buffers = call.forward_buffers(v)
    out, final0, final1, final_key, final_count, stats, states, keys, counts = buffers
    has_initial = kv0 is not None
    initial_strides = (*_strides(kv0, 4), *_strides(kv1, 4), *_strides(key_sum, 3), *_strides(count, 3)[:1])
    a = call.shared_args(q, param0, param1, sin, cos, key_padding_mask, cu_seqlens)
    kv0, kv1, key_sum, count = (a.dummy if t is None else t for t in (kv0, kv1, key_sum, count))
    launch(_walk_kernel)[call.walk_grid](
        k, v, a.p0, a.sin, a.cos, a.mask, a.cu, kv0, kv1, key_sum, count, states, keys, counts, final0, final1,
        final_key, final_count, *k.stride(), *v.stride(), *a.param_strides[:3], *a.table_strides, *a.mask_strides,
        *initial_strides, **call.sizes, BF=call.bf, BV=call.bv, HAS_MASK=call.has_mask, HAS_INITIAL=has_initial,
        **call.flags,
    )
    launch(_output_kernel)[call.item_grid](
        q, k, v, a.p0, a.p1, a.sin, a.cos, a.mask, a.cu, states, keys, counts, out, stats, eps,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *a.param_strides, *a.table_strides, *a.mask_strides,
        **call.sizes, **call.search(), HAS_MASK=call.has_mask, **call.flags, num_warps=_CHUNK_WARPS,
    )
    return buffers


def _backward(feature, eps, chunk_size, q, k, v, param0, param1, sin, cos, key_padding_mask, cu_seqlens, out, stats,
              states, keys, grad_out, grad_final0, grad_final1, grad_final_key, traced=False):
    """The backward kernels: (grad_q, grad_k, grad_v, grad kv₀, grad kv₁, the key sum's gradient per stream,
    the parameters' per-chunk partial gradients); :func:`_finish` reduces the last two. ``traced`` as
    :func:`_forward`'s."""
    launch = traceable if traced else _as_is
    call = _Call(feature, q, k, v, param0, param1, sin, key_padding_mask, cu_seqlens, chunk_size)
    grad_q, grad_k, grad_v, grad_kv0, grad_kv1, grad_key, grad_states, grad_keys, grad_param = \
        call.backward_buffers(q, k, v)
    if grad_out is None:  # only the final state was used
        grad_out = torch.zeros_like(out)
    if call.streams == 2 and (grad_final0 is None) != (grad_final1 is None):  # one stream's final state was used
        grad_final0 = torch.zeros_like(grad_final1) if grad_final0 is None else grad_final0
        grad_final1 = torch.zeros_like(grad_final0) if grad_final1 is None else grad_final1
    a = call.shared_args(q, param0, param1, sin, cos, key_padding_mask, cu_seqlens)
    final_strides = (*_strides(grad_final0, 4), *_strides(grad_final1, 4), *_strides(grad_final_key, 3))
    launch(_walk_back_kernel)[call.walk_grid](
        q, a.p0, a.p1, a.sin, a.cos, a.cu, out, grad_out, stats,
        *(a.dummy if t is None else t for t in (grad_final0, grad_final1, grad_final_key)),
        grad_states, grad_keys, grad_kv0, grad_kv1, grad_key,
        *q.stride(), *out.stride(), *grad_out.stride(), *a.param_strides, *a.table_strides, *final_strides,
        **call.sizes, BF=call.bf, BV=call.bv, HAS_FINAL_GRAD=grad_final0 is not None or grad_final1 is not None,
        HAS_FINAL_KEY_GRAD=grad_final_key is not None, **call.flags,
    )
    launch(_grads_kernel)[call.item_grid](
        q, k, v, a.p0, a.p1, a.sin, a.cos, a.mask, a.cu, states, keys, out, grad_out, stats, grad_states, grad_keys,
        grad_q, grad_k, grad_v, grad_param,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(), *grad_q.stride(),
        *grad_k.stride(), *grad_v.stride(), *a.param_strides, *a.table_strides, *a.mask_strides,
        **call.sizes, **call.search(), HAS_MASK=call.has_mask, **call.flags, num_warps=_CHUNK_WARPS,
    )
    return grad_q, grad_k, grad_v, grad_kv0, grad_kv1, grad_key, grad_param


def _finish(grads, feature, chunk_size, saved, needs):
    """The gradients of the op's inputs (``_INPUTS``, None where ``needs`` says none) from :func:`_backward`'s
    buffers and the op's first nine inputs ``saved``: the parameters' partial sums reduced (one torch reduction,
    in the compiled graph when compiled), the key sum's summed over the streams."""
    grad_q, grad_k, grad_v, grad_kv0, grad_kv1, grad_key, grad_param = grads
    q, k, v, param0, param1, sin, _, key_padding_mask, cu_seqlens = saved
    call = _Call(feature, q, k, v, param0, param1, sin, key_padding_mask, cu_seqlens, chunk_size)
    param_grads = call.reduce_params(grad_param, param0, param1, needs[3], needs[4])
    by_name = dict(q=grad_q, k=grad_k, v=grad_v, param0=param_grads[0], param1=param_grads[1], kv0=grad_kv0,
                   kv1=grad_kv1, key_sum=grad_key.sum(2) if needs[11] else None)
    return tuple(by_name.get(name) if need else None for name, need in zip(_INPUTS, needs))


# The op's tensor inputs, in order; gradients reach q, k, v, the two parameters and the initial kv and key sum.
_INPUTS = ("q", "k", "v", "param0", "param1", "sin", "cos", "key_padding_mask", "cu_seqlens", "kv0", "kv1",
           "key_sum", "count")


class _CausalAttention(torch.autograd.Function):
    """The eager entry: the forward kernels, and the backward kernels once (no double backward)."""

    @staticmethod
    def forward(ctx, feature, eps, chunk_size, *inputs):
        buffers = _forward(feature, eps, chunk_size, *inputs)
        out, final0, final1, final_key, final_count, stats, states, keys, _ = buffers
        ctx.save_for_backward(*inputs[:9], out, stats, states, keys)
        ctx.args = (feature, eps, chunk_size)
        ctx.mark_non_differentiable(final_count)
        ctx.set_materialize_grads(False)
        return out, final0, final1, final_key, final_count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_final0, grad_final1, grad_final_key, _):
        feature, _, chunk_size = ctx.args
        grads = _backward(*ctx.args, *ctx.saved_tensors, grad_out, grad_final0, grad_final1, grad_final_key)
        return None, None, None, *_finish(grads, feature, chunk_size, ctx.saved_tensors[:9], ctx.needs_input_grad[3:])


@torch.library.triton_op("polaformer::causal_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, param0: Optional[torch.Tensor],
    param1: Optional[torch.Tensor], sin: Optional[torch.Tensor], cos: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], kv0: Optional[torch.Tensor],
    kv1: Optional[torch.Tensor], key_sum: Optional[torch.Tensor], count: Optional[torch.Tensor],
    feature: int, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """:func:`_forward` as a graph op: (out, final kv₀, kv₁, key sum, count, and the rows and states saved for
    the backward)."""
    return _forward(feature, eps, chunk_size, q, k, v, param0, param1, sin, cos, key_padding_mask, cu_seqlens, kv0,
                    kv1, key_sum, count, traced=True)


@torch.library.triton_op("polaformer::causal_attention_backward", mutates_args=())
def _attention_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, param0: Optional[torch.Tensor],
    param1: Optional[torch.Tensor], sin: Optional[torch.Tensor], cos: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], out: torch.Tensor,
    stats: torch.Tensor, states: torch.Tensor, keys: torch.Tensor, grad_out: Optional[torch.Tensor],
    grad_final0: Optional[torch.Tensor], grad_final1: Optional[torch.Tensor], grad_final_key: Optional[torch.Tensor],
    feature: int, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_backward` as a graph op."""
    return _backward(feature, eps, chunk_size, q, k, v, param0, param1, sin, cos, key_padding_mask, cu_seqlens, out,
                     stats, states, keys, grad_out, grad_final0, grad_final1, grad_final_key, traced=True)


def _setup_context(ctx, inputs, output):
    out, _, _, _, _, stats, states, keys, _ = output
    ctx.save_for_backward(*inputs[:9], out, stats, states, keys)
    ctx.args = inputs[13:]


def _op_backward(ctx, grad_out, grad_final0, grad_final1, grad_final_key, *_):
    feature, _, chunk_size = ctx.args
    grads = torch.ops.polaformer.causal_attention_backward(*ctx.saved_tensors, grad_out, grad_final0, grad_final1,
                                                           grad_final_key, *ctx.args)
    return *_finish(grads, feature, chunk_size, ctx.saved_tensors[:9], ctx.needs_input_grad), None, None, None


torch.library.register_autograd("polaformer::causal_attention", _op_backward, setup_context=_setup_context)


def causal_attention(feature: str, q, k, v, params=(None, None), tables=(None, None), key_padding_mask=None,
                     cu_seqlens=None, initial_state=None, eps: float = 1e-6, chunk_size: int = 64):
    """The fused causal op (arguments checked by :mod:`polaformer.ops.causal`): ``feature`` ``"pola"`` (params:
    the exponent, broadcastable to (B, H, 1, d)), ``"pacs"`` (the two temperatures, broadcastable to
    (B, H, 1, 2d); ``tables``: (N, 2d) RoPE sin and cos, or None) or ``"linear"`` (q and k are the features; one
    stream). ``initial_state``: ``(kv₀, kv₁, key sum, count)`` (kv₁ None for ``"linear"``); ``cu_seqlens``: packed
    sequences (batch 1), offsets trusted. Returns ``(out, (kv₀, kv₁, key sum, count))``: ``out`` in v's dtype,
    the final state in the accumulator dtype (per packed sequence for a packed call). Gradients reach q, k, v,
    the parameters and the initial kv and key sum.

    Eager calls take the autograd.Function; under torch.compile the registered op, which the graph records."""
    state = (None,) * 4 if initial_state is None else tuple(initial_state)
    inputs = (q, k, v, *params, *tables, key_padding_mask, cu_seqlens, *state)
    if torch.compiler.is_compiling():
        out, *final = torch.ops.polaformer.causal_attention(*inputs, FEATURES[feature], float(eps), chunk_size)[:5]
    else:
        out, *final = _CausalAttention.apply(FEATURES[feature], eps, chunk_size, *inputs)
    return out, tuple(final)
