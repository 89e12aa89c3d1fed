"""Fused Triton kernels of :func:`polaformer.ops.pola_linear_attention` (the power map ``|x|ᵖ``).

Per (sequence, head), with ``a = x⁺ᵖ`` and ``b = x⁻ᵖ`` the two halves of a token's features and ``m`` the
number of valid keys, the forward pass keeps one routed state in fp32 (never rounded to the inputs' dtype)::

    top[:, j]    = Σ_keys (a if j < half else b)ᵀ v[:, j] / m      (d × dv)
    bottom[:, j] = Σ_keys (b if j < half else a)ᵀ v[:, j] / m      (d × dv)
    key_pos = Σ_keys a / m,  key_neg = Σ_keys b / m                 (d)

so both streams' numerators are ``a·top + b·bottom`` (the opposite-sign query is routed through the state's
columns instead of being written), and the normalisers are ``a·key_pos + b·key_neg`` (same sign) and
``a·key_neg + b·key_pos`` (opposite sign). Features are recomputed in registers wherever they are needed and
never written to memory.

Kernels (grid ``(work items, heads)``, items from :mod:`.common`):

- ``_state_kernel``: per chunk of keys, partial sums of the state; :func:`.common.sum_item_partials` adds
  the chunks of each sequence in order (deterministic, no atomics).
- ``_output_kernel``: per block of queries, the output.
- ``_query_grad_kernel``: per chunk of queries, ``grad_q`` and partial sums of the state's gradient and of
  the exponent's gradient (reduced like the state).
- ``_key_grad_kernel``: per chunk of keys, ``grad_k``, ``grad_v`` and partial sums of the exponent's gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    Items,
    accumulator_dtype,
    dot_precision,
    items_for,
    locate_item,
    padded_width,
    power_map,
    reduction_chunk,
    row_power_of_two_scale,
    sum_item_partials,
    token_block,
)

__all__ = ["PolaAttention", "pola_attention", "pola_backward", "pola_forward"]


@triton.jit
def _load_state(state_ptr, seq, head, HEADS, DP: tl.constexpr, DVP: tl.constexpr):
    """(top, bottom, key_pos, key_neg) of one (sequence, head), divided by its number of valid keys (at least
    1, so a sequence without keys has a zero state)."""
    width: tl.constexpr = 2 * DP * DVP + 2 * DP + 1
    base = state_ptr + (seq.to(tl.int64) * HEADS + head) * width
    c = tl.arange(0, DP)
    cell = c[:, None] * DVP + tl.arange(0, DVP)[None, :]
    inv_m = 1.0 / tl.maximum(tl.load(base + 2 * DP * DVP + 2 * DP), 1.0)
    top = tl.load(base + cell) * inv_m
    bottom = tl.load(base + DP * DVP + cell) * inv_m
    key_pos = tl.load(base + 2 * DP * DVP + c) * inv_m
    key_neg = tl.load(base + 2 * DP * DVP + DP + c) * inv_m
    return top, bottom, key_pos, key_neg, inv_m


@triton.jit
def _scaled_query_features(x, p):
    """Query features divided by their row's power-of-two scale (see ``row_power_of_two_scale``), and the
    reciprocal scale (``eps`` is multiplied by it, so the output is unchanged)."""
    pos, neg = power_map(x, p)
    inv_scale = 1.0 / row_power_of_two_scale(tl.max(pos + neg, 1))
    return pos * inv_scale[:, None], neg * inv_scale[:, None], inv_scale


@triton.jit
def _normalisers(pos, neg, key_pos, key_neg, eps_row, same_stream):
    """Each output channel's normaliser: ``a·key_pos + b·key_neg + eps`` for the same-sign channels,
    ``a·key_neg + b·key_pos + eps`` for the opposite-sign ones."""
    same = tl.sum(pos * key_pos[None, :], 1) + tl.sum(neg * key_neg[None, :], 1) + eps_row
    opposite = tl.sum(pos * key_neg[None, :], 1) + tl.sum(neg * key_pos[None, :], 1) + eps_row
    return tl.where(same_stream[None, :], same[:, None], opposite[:, None])


@triton.jit
def _power_map_backward(x, p, grad_s_times_s):
    """(grad_x, grad_p) through ``s = sign(x)|x|ᵖ`` given ``dL/ds · s``: ``p/x`` and ``log|x|`` times it,
    zero at ``x = 0`` (where both derivatives vanish for ``p > 1``)."""
    nonzero = x != 0
    grad_x = tl.where(nonzero, grad_s_times_s * p / tl.where(nonzero, x, 1.0), 0.0)
    grad_p = tl.where(nonzero, grad_s_times_s * tl.log(tl.where(nonzero, tl.abs(x), 1.0)), 0.0)
    return grad_x, grad_p


@triton.jit
def _state_kernel(
    k_ptr, v_ptr, p_ptr, mask_ptr, cu_ptr, item_seq_ptr, item_first_ptr, part_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_pb, stride_mb, stride_mt,
    HEADS, LENGTH, D, DV, HALF,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Partial routed state (top, bottom, key sums, valid-key count) of one chunk of keys of one head.
    Grid: (key items, heads)."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq, batch, start, length, chunk_start = locate_item(item, item_seq_ptr, item_first_ptr, cu_ptr, LENGTH,
                                                         CHUNK, PACKED)
    if chunk_start < length:
        acc_t = part_ptr.dtype.element_ty
        c = tl.arange(0, DP)
        j = tl.arange(0, DVP)
        p = tl.load(p_ptr + batch * stride_pb + head * DP + c)
        k_base = k_ptr + batch.to(tl.int64) * stride_kb + head * stride_kh
        v_base = v_ptr + batch.to(tl.int64) * stride_vb + head * stride_vh
        state_pos = tl.zeros([DP, DVP], dtype=acc_t)
        state_neg = tl.zeros([DP, DVP], dtype=acc_t)
        sum_pos = tl.zeros([DP], dtype=acc_t)
        sum_neg = tl.zeros([DP], dtype=acc_t)
        count = tl.zeros([BLOCK], dtype=acc_t)
        for t0 in range(chunk_start, tl.minimum(chunk_start + CHUNK, length), BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            keep = t < length
            if HAS_MASK:
                keep = keep & (tl.load(mask_ptr + batch * stride_mb + t * stride_mt, mask=keep, other=1) == 0)
            rows = (start + t).to(tl.int64)
            x = tl.load(k_base + rows[:, None] * stride_kt + c[None, :] * stride_kc,
                        mask=keep[:, None] & (c < D)[None, :], other=0.0).to(acc_t)
            values = tl.load(v_base + rows[:, None] * stride_vt + j[None, :] * stride_vc,
                             mask=keep[:, None] & (j < DV)[None, :], other=0.0).to(acc_t)
            pos, neg = power_map(x, p[None, :])
            state_pos += tl.dot(tl.trans(pos), values, input_precision=PRECISION, out_dtype=acc_t)
            state_neg += tl.dot(tl.trans(neg), values, input_precision=PRECISION, out_dtype=acc_t)
            sum_pos += tl.sum(pos, 0)
            sum_neg += tl.sum(neg, 0)
            count += keep.to(acc_t)
        same_stream = (j < HALF)[None, :]
        width: tl.constexpr = 2 * DP * DVP + 2 * DP + 1
        out = part_ptr + (item.to(tl.int64) * HEADS + head) * width
        cell = c[:, None] * DVP + j[None, :]
        tl.store(out + cell, tl.where(same_stream, state_pos, state_neg))
        tl.store(out + DP * DVP + cell, tl.where(same_stream, state_neg, state_pos))
        tl.store(out + 2 * DP * DVP + c, sum_pos)
        tl.store(out + 2 * DP * DVP + DP + c, sum_neg)
        tl.store(out + 2 * DP * DVP + 2 * DP, tl.sum(count, 0))


@triton.jit
def _output_kernel(
    q_ptr, p_ptr, state_ptr, out_ptr, cu_ptr, item_seq_ptr, item_first_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_ob, stride_oh, stride_ot, stride_oc,
    stride_pb, HEADS, LENGTH, D, DV, HALF, eps,
    BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, PACKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """The output of one block of queries of one head from the reduced state. Grid: (query blocks, heads)."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq, batch, start, length, t0 = locate_item(item, item_seq_ptr, item_first_ptr, cu_ptr, LENGTH, BLOCK, PACKED)
    if t0 < length:
        acc_t = state_ptr.dtype.element_ty
        c = tl.arange(0, DP)
        j = tl.arange(0, DVP)
        top, bottom, key_pos, key_neg, inv_m = _load_state(state_ptr, seq, head, HEADS, DP, DVP)
        p = tl.load(p_ptr + batch * stride_pb + head * DP + c)
        t = t0 + tl.arange(0, BLOCK)
        valid = t < length
        rows = (start + t).to(tl.int64)
        x = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + rows[:, None] * stride_qt
                    + c[None, :] * stride_qc, mask=valid[:, None] & (c < D)[None, :], other=0.0).to(acc_t)
        pos, neg, inv_scale = _scaled_query_features(x, p[None, :])
        numerator = tl.dot(pos, top, input_precision=PRECISION, out_dtype=acc_t)
        numerator += tl.dot(neg, bottom, input_precision=PRECISION, out_dtype=acc_t)
        denominator = _normalisers(pos, neg, key_pos, key_neg, eps * inv_scale, j < HALF)
        out = numerator / denominator
        tl.store(out_ptr + batch.to(tl.int64) * stride_ob + head * stride_oh + rows[:, None] * stride_ot
                 + j[None, :] * stride_oc, out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (j < DV)[None, :])


@triton.jit
def _query_grad_kernel(
    q_ptr, p_ptr, state_ptr, grad_out_ptr, grad_q_ptr, part_ptr, cu_ptr, item_seq_ptr, item_first_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_gb, stride_gh, stride_gt, stride_gc,
    stride_dqb, stride_dqh, stride_dqt, stride_dqc,
    stride_pb, HEADS, LENGTH, D, DV, HALF, eps,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    PACKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """``grad_q`` of one chunk of queries of one head, and that chunk's partial sums of the gradients of the
    state (top, bottom, key_pos, key_neg, as divided by m) and of the exponent. The output and normalisers
    are recomputed from the state. Grid: (query items, heads)."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq, batch, start, length, chunk_start = locate_item(item, item_seq_ptr, item_first_ptr, cu_ptr, LENGTH,
                                                         CHUNK, PACKED)
    if chunk_start < length:
        acc_t = state_ptr.dtype.element_ty
        c = tl.arange(0, DP)
        j = tl.arange(0, DVP)
        same_stream = j < HALF
        top, bottom, key_pos, key_neg, inv_m = _load_state(state_ptr, seq, head, HEADS, DP, DVP)
        p = tl.load(p_ptr + batch * stride_pb + head * DP + c)
        q_base = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
        g_base = grad_out_ptr + batch.to(tl.int64) * stride_gb + head * stride_gh
        dq_base = grad_q_ptr + batch.to(tl.int64) * stride_dqb + head * stride_dqh
        grad_top = tl.zeros([DP, DVP], dtype=acc_t)
        grad_bottom = tl.zeros([DP, DVP], dtype=acc_t)
        grad_key_pos = tl.zeros([DP], dtype=acc_t)
        grad_key_neg = tl.zeros([DP], dtype=acc_t)
        grad_power = tl.zeros([DP], dtype=acc_t)
        for t0 in range(chunk_start, tl.minimum(chunk_start + CHUNK, length), BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            valid = t < length
            rows = (start + t).to(tl.int64)
            channels = valid[:, None] & (c < D)[None, :]
            x = tl.load(q_base + rows[:, None] * stride_qt + c[None, :] * stride_qc, mask=channels,
                        other=0.0).to(acc_t)
            pos, neg, inv_scale = _scaled_query_features(x, p[None, :])
            numerator = tl.dot(pos, top, input_precision=PRECISION, out_dtype=acc_t)
            numerator += tl.dot(neg, bottom, input_precision=PRECISION, out_dtype=acc_t)
            denominator = _normalisers(pos, neg, key_pos, key_neg, eps * inv_scale, same_stream)
            grad_out = tl.load(g_base + rows[:, None] * stride_gt + j[None, :] * stride_gc,
                               mask=valid[:, None] & (j < DV)[None, :], other=0.0).to(acc_t)
            # d(numerator) = dO / z; d(z) = -Σ dO·O / z over each stream's channels.
            grad_num = grad_out / denominator
            grad_den = grad_num * (numerator / denominator)
            grad_same = -tl.sum(tl.where(same_stream[None, :], grad_den, 0.0), 1)
            grad_opposite = -tl.sum(tl.where(same_stream[None, :], 0.0, grad_den), 1)
            grad_pos = tl.dot(grad_num, tl.trans(top), input_precision=PRECISION, out_dtype=acc_t)
            grad_pos += grad_same[:, None] * key_pos[None, :] + grad_opposite[:, None] * key_neg[None, :]
            grad_neg = tl.dot(grad_num, tl.trans(bottom), input_precision=PRECISION, out_dtype=acc_t)
            grad_neg += grad_same[:, None] * key_neg[None, :] + grad_opposite[:, None] * key_pos[None, :]
            # The row scale cancels: (grad · feature) is the same in scaled and unscaled terms.
            grad_x, grad_p = _power_map_backward(x, p[None, :], grad_pos * pos + grad_neg * neg)
            tl.store(dq_base + rows[:, None] * stride_dqt + c[None, :] * stride_dqc,
                     grad_x.to(grad_q_ptr.dtype.element_ty), mask=channels)
            grad_power += tl.sum(grad_p, 0)
            grad_top += tl.dot(tl.trans(pos), grad_num, input_precision=PRECISION, out_dtype=acc_t)
            grad_bottom += tl.dot(tl.trans(neg), grad_num, input_precision=PRECISION, out_dtype=acc_t)
            grad_key_pos += tl.sum(pos * grad_same[:, None] + neg * grad_opposite[:, None], 0)
            grad_key_neg += tl.sum(neg * grad_same[:, None] + pos * grad_opposite[:, None], 0)
        width: tl.constexpr = 2 * DP * DVP + 3 * DP
        out = part_ptr + (item.to(tl.int64) * HEADS + head) * width
        cell = c[:, None] * DVP + j[None, :]
        tl.store(out + cell, grad_top)
        tl.store(out + DP * DVP + cell, grad_bottom)
        tl.store(out + 2 * DP * DVP + c, grad_key_pos)
        tl.store(out + 2 * DP * DVP + DP + c, grad_key_neg)
        tl.store(out + 2 * DP * DVP + 2 * DP + c, grad_power)


@triton.jit
def _key_grad_kernel(
    k_ptr, v_ptr, p_ptr, mask_ptr, state_ptr, grad_state_ptr, grad_k_ptr, grad_v_ptr, part_ptr,
    cu_ptr, item_seq_ptr, item_first_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_dkb, stride_dkh, stride_dkt, stride_dkc,
    stride_dvb, stride_dvh, stride_dvt, stride_dvc,
    stride_pb, stride_mb, stride_mt,
    HEADS, LENGTH, D, DV, HALF,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """``grad_k`` and ``grad_v`` of one chunk of keys of one head from the reduced gradient of the state, and
    the chunk's partial sum of the exponent's gradient. Padded keys get zero gradients. Grid: (key items, heads)."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq, batch, start, length, chunk_start = locate_item(item, item_seq_ptr, item_first_ptr, cu_ptr, LENGTH,
                                                         CHUNK, PACKED)
    if chunk_start < length:
        acc_t = state_ptr.dtype.element_ty
        c = tl.arange(0, DP)
        j = tl.arange(0, DVP)
        same_stream = (j < HALF)[None, :]
        inv_m = _load_state(state_ptr, seq, head, HEADS, DP, DVP)[4]
        grad_width: tl.constexpr = 2 * DP * DVP + 3 * DP
        g = grad_state_ptr + (seq.to(tl.int64) * HEADS + head) * grad_width
        cell = c[:, None] * DVP + j[None, :]
        grad_top = tl.load(g + cell)
        grad_bottom = tl.load(g + DP * DVP + cell)
        # Route the gradient back to the unrouted sums Σ aᵀv and Σ bᵀv, through the division by m.
        grad_state_pos = tl.where(same_stream, grad_top, grad_bottom) * inv_m
        grad_state_neg = tl.where(same_stream, grad_bottom, grad_top) * inv_m
        grad_key_pos = tl.load(g + 2 * DP * DVP + c) * inv_m
        grad_key_neg = tl.load(g + 2 * DP * DVP + DP + c) * inv_m
        p = tl.load(p_ptr + batch * stride_pb + head * DP + c)
        k_base = k_ptr + batch.to(tl.int64) * stride_kb + head * stride_kh
        v_base = v_ptr + batch.to(tl.int64) * stride_vb + head * stride_vh
        dk_base = grad_k_ptr + batch.to(tl.int64) * stride_dkb + head * stride_dkh
        dv_base = grad_v_ptr + batch.to(tl.int64) * stride_dvb + head * stride_dvh
        grad_power = tl.zeros([DP], dtype=acc_t)
        for t0 in range(chunk_start, tl.minimum(chunk_start + CHUNK, length), BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            valid = t < length
            keep = valid
            if HAS_MASK:
                keep = keep & (tl.load(mask_ptr + batch * stride_mb + t * stride_mt, mask=valid, other=1) == 0)
            rows = (start + t).to(tl.int64)
            x = tl.load(k_base + rows[:, None] * stride_kt + c[None, :] * stride_kc,
                        mask=keep[:, None] & (c < D)[None, :], other=0.0).to(acc_t)
            values = tl.load(v_base + rows[:, None] * stride_vt + j[None, :] * stride_vc,
                             mask=keep[:, None] & (j < DV)[None, :], other=0.0).to(acc_t)
            pos, neg = power_map(x, p[None, :])
            grad_values = tl.dot(pos, grad_state_pos, input_precision=PRECISION, out_dtype=acc_t)
            grad_values += tl.dot(neg, grad_state_neg, input_precision=PRECISION, out_dtype=acc_t)
            tl.store(dv_base + rows[:, None] * stride_dvt + j[None, :] * stride_dvc,
                     grad_values.to(grad_v_ptr.dtype.element_ty), mask=valid[:, None] & (j < DV)[None, :])
            grad_pos = tl.dot(values, tl.trans(grad_state_pos), input_precision=PRECISION, out_dtype=acc_t)
            grad_pos += grad_key_pos[None, :]
            grad_neg = tl.dot(values, tl.trans(grad_state_neg), input_precision=PRECISION, out_dtype=acc_t)
            grad_neg += grad_key_neg[None, :]
            grad_x, grad_p = _power_map_backward(x, p[None, :], grad_pos * pos + grad_neg * neg)
            tl.store(dk_base + rows[:, None] * stride_dkt + c[None, :] * stride_dkc,
                     grad_x.to(grad_k_ptr.dtype.element_ty), mask=valid[:, None] & (c < D)[None, :])
            grad_power += tl.sum(grad_p, 0)
        tl.store(part_ptr + (item.to(tl.int64) * HEADS + head) * DP + c, grad_power)


class _Launch:
    """Everything about one call that the kernels share: sizes, paddings, work items, the exponent laid out
    per (batch, head) and padded with ones, and the key mask as bytes."""

    def __init__(self, q, k, v, power, key_padding_mask, cu_seqlens, cu_seqlens_k):
        self.packed = cu_seqlens is not None
        batch, self.heads, self.q_len, self.d = q.shape
        self.k_len, self.dv = k.shape[-2], v.shape[-1]
        self.half = (self.dv + 1) // 2
        self.sequences = cu_seqlens.numel() - 1 if self.packed else batch
        self.cu_q = cu_seqlens if self.packed else None
        self.cu_k = (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k) if self.packed else None
        self.dp, self.dvp = padded_width(self.d), padded_width(self.dv)
        self.acc = accumulator_dtype(q, k, v, power)
        self.precision = dot_precision(q, k, v)
        self.block = token_block(q)
        device = q.device
        exponent = power.detach().to(self.acc).expand(batch, self.heads, 1, self.d)[:, :, 0]
        self.power = torch.ones(batch, self.heads, self.dp, device=device, dtype=self.acc)
        self.power[..., :self.d] = exponent
        self.power_shape, self.power_dtype = power.shape, power.dtype
        self.mask = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
        self.mask_strides = (0, 0) if self.mask is None else self.mask.stride()
        self.dummy = torch.zeros(1, device=device, dtype=torch.int32)
        state_chunk = reduction_chunk(self.sequences, self.heads, self.k_len, self.block)
        query_chunk = reduction_chunk(self.sequences, self.heads, self.q_len, self.block)
        self.key_items = items_for(self.sequences, self.k_len, state_chunk, device, self.cu_k)
        self.query_blocks = items_for(self.sequences, self.q_len, self.block, device, self.cu_q)
        self.query_items = items_for(self.sequences, self.q_len, query_chunk, device, self.cu_q)

    def _common(self, items: Items, cu):
        return dict(cu_ptr=self.dummy if cu is None else cu, item_seq_ptr=items.item_seq,
                    item_first_ptr=items.item_first)

    def state(self, k, v) -> torch.Tensor:
        width = 2 * self.dp * self.dvp + 2 * self.dp + 1
        items = self.key_items
        partials = torch.empty(items.count, self.heads, width, device=k.device, dtype=self.acc)
        _state_kernel[(items.count, self.heads)](
            k, v, self.power, self.dummy if self.mask is None else self.mask, part_ptr=partials,
            **self._common(items, self.cu_k),
            stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kt=k.stride(2), stride_kc=k.stride(3),
            stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vt=v.stride(2), stride_vc=v.stride(3),
            stride_pb=self.power.stride(0), stride_mb=self.mask_strides[0], stride_mt=self.mask_strides[1],
            HEADS=self.heads, LENGTH=self.k_len, D=self.d, DV=self.dv, HALF=self.half,
            CHUNK=items.chunk, BLOCK=self.block, DP=self.dp, DVP=self.dvp,
            PACKED=self.packed, HAS_MASK=self.mask is not None, PRECISION=self.precision,
        )
        return sum_item_partials(partials, items)

    def output(self, q, state, eps, out) -> None:
        items = self.query_blocks
        _output_kernel[(items.count, self.heads)](
            q, self.power, state, out, **self._common(items, self.cu_q),
            stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qt=q.stride(2), stride_qc=q.stride(3),
            stride_ob=out.stride(0), stride_oh=out.stride(1), stride_ot=out.stride(2), stride_oc=out.stride(3),
            stride_pb=self.power.stride(0), HEADS=self.heads, LENGTH=self.q_len, D=self.d, DV=self.dv,
            HALF=self.half, eps=eps, BLOCK=self.block, DP=self.dp, DVP=self.dvp, PACKED=self.packed,
            PRECISION=self.precision,
        )

    def query_grads(self, q, state, eps, grad_out, grad_q) -> torch.Tensor:
        width = 2 * self.dp * self.dvp + 3 * self.dp
        items = self.query_items
        partials = torch.empty(items.count, self.heads, width, device=q.device, dtype=self.acc)
        _query_grad_kernel[(items.count, self.heads)](
            q, self.power, state, grad_out, grad_q, partials, **self._common(items, self.cu_q),
            stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qt=q.stride(2), stride_qc=q.stride(3),
            stride_gb=grad_out.stride(0), stride_gh=grad_out.stride(1), stride_gt=grad_out.stride(2),
            stride_gc=grad_out.stride(3),
            stride_dqb=grad_q.stride(0), stride_dqh=grad_q.stride(1), stride_dqt=grad_q.stride(2),
            stride_dqc=grad_q.stride(3),
            stride_pb=self.power.stride(0), HEADS=self.heads, LENGTH=self.q_len, D=self.d, DV=self.dv,
            HALF=self.half, eps=eps, CHUNK=items.chunk, BLOCK=self.block, DP=self.dp, DVP=self.dvp,
            PACKED=self.packed, PRECISION=self.precision,
        )
        return sum_item_partials(partials, items)

    def key_grads(self, k, v, state, grad_state, grad_k, grad_v) -> torch.Tensor:
        items = self.key_items
        partials = torch.empty(items.count, self.heads, self.dp, device=k.device, dtype=self.acc)
        _key_grad_kernel[(items.count, self.heads)](
            k, v, self.power, self.dummy if self.mask is None else self.mask, state, grad_state, grad_k, grad_v,
            partials, **self._common(items, self.cu_k),
            stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kt=k.stride(2), stride_kc=k.stride(3),
            stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vt=v.stride(2), stride_vc=v.stride(3),
            stride_dkb=grad_k.stride(0), stride_dkh=grad_k.stride(1), stride_dkt=grad_k.stride(2),
            stride_dkc=grad_k.stride(3),
            stride_dvb=grad_v.stride(0), stride_dvh=grad_v.stride(1), stride_dvt=grad_v.stride(2),
            stride_dvc=grad_v.stride(3),
            stride_pb=self.power.stride(0), stride_mb=self.mask_strides[0], stride_mt=self.mask_strides[1],
            HEADS=self.heads, LENGTH=self.k_len, D=self.d, DV=self.dv, HALF=self.half,
            CHUNK=items.chunk, BLOCK=self.block, DP=self.dp, DVP=self.dvp,
            PACKED=self.packed, HAS_MASK=self.mask is not None, PRECISION=self.precision,
        )
        return sum_item_partials(partials, items)

    def power_grad(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """(S, H, DP) per-sequence exponent gradients → ``power``'s shape (summed over what it broadcasts)."""
        grad = per_sequence[..., :self.d]
        if self.packed:
            grad = grad.sum(dim=0, keepdim=True)
        return grad.unsqueeze(2).sum_to_size(self.power_shape)

    def new_output(self, v: torch.Tensor) -> torch.Tensor:
        """(B, H, N, dv) over (B, N, H, dv) memory, as the torch formulation returns it."""
        return v.new_empty(v.shape[0], self.q_len, self.heads, self.dv).transpose(1, 2)


def pola_forward(q, k, v, power, eps, key_padding_mask=None, cu_seqlens=None, cu_seqlens_k=None, out=None):
    """Run the forward kernels; returns ``(out, state, launch)``. ``out`` (B, H, N, dv), any strides, is
    written in place when given. Arguments are assumed checked by the op."""
    launch = _Launch(q, k, v, power, key_padding_mask, cu_seqlens, cu_seqlens_k)
    if out is None:
        out = launch.new_output(v)
    state = launch.state(k, v)
    launch.output(q, state, eps, out)
    return out, state, launch


def pola_backward(launch, q, k, v, state, eps, grad_out, grad_q=None, grad_k=None, grad_v=None):
    """Run the backward kernels; returns ``(grad_q, grad_k, grad_v, grad_power)``, writing into the given
    gradient buffers (any strides) where passed."""
    grad_q = torch.empty_like(q) if grad_q is None else grad_q
    grad_k = torch.empty_like(k) if grad_k is None else grad_k
    grad_v = torch.empty_like(v) if grad_v is None else grad_v
    grad_state = launch.query_grads(q, state, eps, grad_out, grad_q)
    power_from_keys = launch.key_grads(k, v, state, grad_state, grad_k, grad_v)
    power_from_queries = grad_state[..., 2 * launch.dp * launch.dvp + 2 * launch.dp:]
    return grad_q, grad_k, grad_v, launch.power_grad(power_from_queries + power_from_keys)


class PolaAttention(torch.autograd.Function):
    """The fused op with the backward kernels; inputs already checked by :func:`pola_linear_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k):
        out, state, launch = pola_forward(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
        ctx.save_for_backward(q, k, v, state)
        ctx.launch, ctx.eps = launch, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, state = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_power = pola_backward(ctx.launch, q, k, v, state, ctx.eps, grad_out)
        needs = ctx.needs_input_grad
        return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None,
                grad_power.to(ctx.launch.power_dtype) if needs[3] else None, None, None, None, None)


def pola_attention(q, k, v, power, eps, key_padding_mask=None, cu_seqlens=None, cu_seqlens_k=None):
    """The Triton path of :func:`polaformer.ops.pola_linear_attention` (arguments checked there): output in
    ``v``'s dtype, gradients for q, k, v and ``power`` when they require them."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, power)):
        return PolaAttention.apply(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)
    return pola_forward(q, k, v, power, eps, key_padding_mask, cu_seqlens, cu_seqlens_k)[0]
