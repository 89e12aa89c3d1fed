"""Triton kernels of PolaFormer++'s PaCS attention (:func:`polaformer.ops.pacs_linear_attention`), forward and
backward, for padded batches (with an optional key padding mask) and packed variable-length batches.

The math per (sequence, head), for the same-sign stream ``s`` (value half 0) and the opposite-sign stream ``o``
(value half 1), with ``a = relu(q)``, ``b = relu(-q)`` and the key features ``φk = exp([k⁺ ; k⁻]) − 1``::

    φ_s = exp([a ; b] ⊙ T_same) − 1        φ_o = exp([b ; a] ⊙ T_opp) − 1
    kv  = R(φk)ᵀ v / M                     k̄ = Σ φk / M          (the state, M = number of valid keys)
    out = R(φ)·kv[:, half] / (φ·k̄ + eps)   per stream

``R`` is RoPE on the numerator (identity without tables). The opposite stream is formed by routing ``b`` and
``a`` to the halves in registers; no feature or swapped copy is written to memory.

Layout. RoPE rotates channel pairs (2i, 2i+1) of each half of the 2d features, so a token's features are held
as two (tokens, 2P) blocks, ``P = ⌈d/2⌉`` padded to a power of two: the even channels ``[x⁺₀ x⁺₂ … | x⁻₀ x⁻₂ …]``
and the odd ones ``[x⁺₁ x⁺₃ … | x⁻₁ x⁻₃ …]``; the rotation is then elementwise between the two blocks. The
state (``kv`` per stream and block, ``k̄``) lives in fp32 (fp64 for fp64 inputs), never rounded to the inputs'
dtype.

Numerics, in the log domain as the op's torch formulation (``pacs_attention_graph``): each key channel is
shifted by its largest pre-activation over the sequence (a running maximum, the state rescaled when it grows;
the two channels of a RoPE pair share theirs), each query row of each stream by its largest pre-activation plus
that shift, ``eps`` with it. A feature is formed as ``e^(x+s−c)·(1 − e^-x)``, exact near 0 too; every exponent
is ≤ 0, so the result is finite wherever the exact one is, with no host synchronisation.

Launches and determinism as in :mod:`.pola` (:func:`polaformer.backends.triton.common.plan`): one forward launch
and one backward launch at the models' shapes; long sequences with few (sequence, head) pairs split the keys
over a state launch and the backward over a query-side and a key-side launch, partial sums added in a fixed order,
no atomics.
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
    expm1,
    padded_width,
    plan,
    program,
    sequence_tokens,
    share,
    sigmoid,
    traceable,
    unpadded_keys,
    warps,
)

__all__ = ["pacs_attention", "pacs_backward", "pacs_forward"]


@triton.jit
def _columns(d, P: tl.constexpr):
    """For the 2P feature columns of a block: which are the positive half, the input channel of the even block
    (the odd block's is one more), whether each exists, and the column's channel in the 2d feature vector."""
    i = tl.arange(0, 2 * P)
    positive = i < P
    channel = 2 * (i % P)
    feature = tl.where(positive, 0, d) + channel
    return positive, channel, channel < d, channel + 1 < d, feature


@triton.jit
def _load_blocks(base, rows, row_ok, stride_t, stride_c, channel, even_ok, odd_ok, ACC: tl.constexpr):
    """The (rows, 2P) even and odd blocks of a (tokens, channels) tensor read at ``channel`` and ``channel + 1``
    (each input channel twice, once per half); zeros outside."""
    ptr = base + rows[:, None] * stride_t + channel[None, :] * stride_c
    even = tl.load(ptr, mask=row_ok[:, None] & even_ok[None, :], other=0.0).to(ACC)
    odd = tl.load(ptr + stride_c, mask=row_ok[:, None] & odd_ok[None, :], other=0.0).to(ACC)
    return even, odd


@triton.jit
def _halves(x, positive):
    """``[relu(x) | relu(-x)]`` in the block layout."""
    return tl.where(positive[None, :], tl.maximum(x, 0.0), tl.maximum(-x, 0.0))


@triton.jit
def _shifted_feature(x, shift, row):
    """``e^(x + shift − row)·(1 − e^-x) = (e^x − 1)·e^(shift − row)``, zero where x is 0. ``row`` bounds
    ``x + shift``, so the exponent is ≤ 0; it is clamped there because a GPU compiler may fuse ``x = q·t`` and
    ``+ shift`` into one rounding that ``row`` did not see, and at |x| ≈ 1e16 one float32 ulp is 2²⁹."""
    used = x != 0
    return tl.where(used, tl.exp(tl.minimum(tl.where(used, (x + shift) - row, 0.0), 0.0)) * -expm1(-x), 0.0)


@triton.jit
def _rotate(even, odd, cos_even, cos_odd, sin_even, sin_odd):
    """RoPE on the pairs: (E, O) -> (E·cos − O·sin, O·cos + E·sin)."""
    return even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd


@triton.jit
def _rotate_transposed(even, odd, cos_even, cos_odd, sin_even, sin_odd):
    """The transpose of :func:`_rotate` (the gradient's way back)."""
    return even * cos_even + odd * sin_odd, odd * cos_odd - even * sin_even


@triton.jit
def _key_state(k_base, v_base, mask_base, cos_ptr, sin_ptr, lo, hi,
               stride_kt, stride_kc, stride_vt, stride_vc, stride_mt, stride_rt, stride_rc, d, dvh,
               P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr,
               ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Sums over keys ``[lo, hi)`` (not yet divided by M): ``R(φk)ᵀv`` per stream and block (same even, same odd,
    opposite even, opposite odd), ``Σφk`` per block, the per-channel shifts and the valid-key count."""
    positive, channel, even_ok, odd_ok, feature = _columns(d, P)
    j = tl.arange(0, DVH)
    same_even = tl.zeros([2 * P, DVH], dtype=ACC)
    same_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    opp_even = tl.zeros([2 * P, DVH], dtype=ACC)
    opp_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    mean_even = tl.zeros([2 * P], dtype=ACC)
    mean_odd = tl.zeros([2 * P], dtype=ACC)
    # pre-activations are ≥ 0, so a shift starting at 0 is the largest one, as in the torch formulation
    shift_even = tl.zeros([2 * P], dtype=ACC)
    shift_odd = tl.zeros([2 * P], dtype=ACC)
    count = tl.zeros([BLOCK], dtype=ACC)
    for t0 in range(lo, hi, BLOCK):
        rows = t0 + tl.arange(0, BLOCK)
        ok = unpadded_keys(mask_base, rows, rows < hi, stride_mt, HAS_MASK)
        k_even, k_odd = _load_blocks(k_base, rows, ok, stride_kt, stride_kc, channel, even_ok, odd_ok, ACC)
        y_even, y_odd = _halves(k_even, positive), _halves(k_odd, positive)
        grown_even = tl.maximum(shift_even, tl.max(y_even, 0))
        grown_odd = tl.maximum(shift_odd, tl.max(y_odd, 0))
        if ROPE:  # a rotated pair mixes its two channels: they share one shift
            grown_even = tl.maximum(grown_even, grown_odd)
            grown_odd = grown_even
        rescale_even = tl.exp(shift_even - grown_even)
        rescale_odd = tl.exp(shift_odd - grown_odd)
        shift_even, shift_odd = grown_even, grown_odd
        f_even = _shifted_feature(y_even, 0.0, shift_even[None, :])
        f_odd = _shifted_feature(y_odd, 0.0, shift_odd[None, :])
        mean_even = mean_even * rescale_even + tl.sum(f_even, 0)
        mean_odd = mean_odd * rescale_odd + tl.sum(f_odd, 0)
        if ROPE:
            cos_even, cos_odd = _load_blocks(cos_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
            sin_even, sin_odd = _load_blocks(sin_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
            f_even, f_odd = _rotate(f_even, f_odd, cos_even, cos_odd, sin_even, sin_odd)
        v_ptr = v_base + rows[:, None] * stride_vt + j[None, :] * stride_vc
        v_ok = ok[:, None] & (j < dvh)[None, :]
        v_same = tl.load(v_ptr, mask=v_ok, other=0.0).to(ACC)
        v_opp = tl.load(v_ptr + dvh * stride_vc, mask=v_ok, other=0.0).to(ACC)
        same_even = same_even * rescale_even[:, None] + dot(tl.trans(f_even), v_same, DOT, PRECISION, ACC)
        same_odd = same_odd * rescale_odd[:, None] + dot(tl.trans(f_odd), v_same, DOT, PRECISION, ACC)
        opp_even = opp_even * rescale_even[:, None] + dot(tl.trans(f_even), v_opp, DOT, PRECISION, ACC)
        opp_odd = opp_odd * rescale_odd[:, None] + dot(tl.trans(f_odd), v_opp, DOT, PRECISION, ACC)
        count += ok.to(ACC)
    return (same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd,
            tl.sum(count, 0))


@triton.jit
def _state_offsets(P: tl.constexpr, DVH: tl.constexpr):
    """Cell indices of a (2P, DVH) tile and the offsets of the state's parts: the four tiles, then the means,
    the shifts (two blocks each) and the count."""
    cell = tl.arange(0, 2 * P)[:, None] * DVH + tl.arange(0, DVH)[None, :]
    tile: tl.constexpr = 2 * P * DVH
    return cell, tile, 4 * tile


@triton.jit
def _store_state(base, same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd, count,
                 P: tl.constexpr, DVH: tl.constexpr):
    cell, tile, vectors = _state_offsets(P, DVH)
    i = tl.arange(0, 2 * P)
    tl.store(base + cell, same_even)
    tl.store(base + tile + cell, same_odd)
    tl.store(base + 2 * tile + cell, opp_even)
    tl.store(base + 3 * tile + cell, opp_odd)
    tl.store(base + vectors + i, mean_even)
    tl.store(base + vectors + 2 * P + i, mean_odd)
    tl.store(base + vectors + 4 * P + i, shift_even)
    tl.store(base + vectors + 6 * P + i, shift_odd)
    tl.store(base + vectors + 8 * P, count)


@triton.jit
def _load_state(base, P: tl.constexpr, DVH: tl.constexpr):
    cell, tile, vectors = _state_offsets(P, DVH)
    i = tl.arange(0, 2 * P)
    return (tl.load(base + cell), tl.load(base + tile + cell), tl.load(base + 2 * tile + cell),
            tl.load(base + 3 * tile + cell), tl.load(base + vectors + i), tl.load(base + vectors + 2 * P + i),
            tl.load(base + vectors + 4 * P + i), tl.load(base + vectors + 6 * P + i),
            tl.load(base + vectors + 8 * P))


@triton.jit
def _merge_partials(part_base, SPLITS: tl.constexpr, P: tl.constexpr, DVH: tl.constexpr, ACC: tl.constexpr):
    """A sequence's state from its ``SPLITS`` partial states, rescaled to their largest shifts, added in order."""
    cell, tile, vectors = _state_offsets(P, DVH)
    width: tl.constexpr = 4 * tile + 8 * P + 1
    i = tl.arange(0, 2 * P)
    shift_even = tl.zeros([2 * P], dtype=ACC)
    shift_odd = tl.zeros([2 * P], dtype=ACC)
    for split in range(SPLITS):
        shift_even = tl.maximum(shift_even, tl.load(part_base + split * width + vectors + 4 * P + i))
        shift_odd = tl.maximum(shift_odd, tl.load(part_base + split * width + vectors + 6 * P + i))
    same_even = tl.zeros([2 * P, DVH], dtype=ACC)
    same_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    opp_even = tl.zeros([2 * P, DVH], dtype=ACC)
    opp_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    mean_even = tl.zeros([2 * P], dtype=ACC)
    mean_odd = tl.zeros([2 * P], dtype=ACC)
    count = tl.zeros((), dtype=ACC)
    for split in range(SPLITS):
        base = part_base + split * width
        rescale_even = tl.exp(tl.load(base + vectors + 4 * P + i) - shift_even)
        rescale_odd = tl.exp(tl.load(base + vectors + 6 * P + i) - shift_odd)
        same_even += tl.load(base + cell) * rescale_even[:, None]
        same_odd += tl.load(base + tile + cell) * rescale_odd[:, None]
        opp_even += tl.load(base + 2 * tile + cell) * rescale_even[:, None]
        opp_odd += tl.load(base + 3 * tile + cell) * rescale_odd[:, None]
        mean_even += tl.load(base + vectors + i) * rescale_even
        mean_odd += tl.load(base + vectors + 2 * P + i) * rescale_odd
        count += tl.load(base + vectors + 8 * P)
    return same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd, count


@triton.jit
def _load_temperatures(base, stride_c, feature, even_ok, odd_ok, RAW: tl.constexpr, ACC: tl.constexpr):
    """A (2d,) temperature vector in the block layout: even and odd (1, 2P) rows; ``sigmoid`` of the loaded
    raw weights with ``RAW``."""
    even = tl.load(base + feature * stride_c, mask=even_ok, other=0.0).to(ACC)
    odd = tl.load(base + (feature + 1) * stride_c, mask=odd_ok, other=0.0).to(ACC)
    if RAW:
        even, odd = tl.where(even_ok, sigmoid(even), 0.0), tl.where(odd_ok, sigmoid(odd), 0.0)
    return even[None, :], odd[None, :]


@triton.jit
def _stream_features(x_even, x_odd, shift_even, shift_odd):
    """One stream's query features from its pre-activations, shifted by the key channel's shift and the row's
    largest ``max(x, 0) + shift`` (channels with x = 0 count as 0), and that row shift."""
    row = tl.maximum(tl.max(tl.where(x_even != 0, tl.maximum(x_even, 0.0) + shift_even[None, :], 0.0), 1),
                     tl.max(tl.where(x_odd != 0, tl.maximum(x_odd, 0.0) + shift_odd[None, :], 0.0), 1))
    f_even = _shifted_feature(x_even, shift_even[None, :], row[:, None])
    f_odd = _shifted_feature(x_odd, shift_odd[None, :], row[:, None])
    return f_even, f_odd, row


@triton.jit
def _stream_output(f_even, f_odd, n_even, n_odd, row, kv_even, kv_odd, mean_even, mean_odd, eps,
                   ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One stream's ``(R(φ)·kv, φ·k̄ + eps)`` for a block of queries (the shifted ``eps``)."""
    num = dot(n_even, kv_even, DOT, PRECISION, ACC)
    num += dot(n_odd, kv_odd, DOT, PRECISION, ACC)
    den = tl.sum(f_even * mean_even[None, :], 1) + tl.sum(f_odd * mean_odd[None, :], 1) + eps * tl.exp(-row)
    return num, den


@triton.jit
def _epilogue(out, local_base, gate_base, rows, ok, j, dvh, stride_lt, stride_lc, stride_gt, stride_gc, PREFIX,
              HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, ACC: tl.constexpr):
    """``(out + local) · gate`` for one stream's value columns ``j`` of rows ``rows`` (the bases point at the
    stream's first column): the local branch on the rows from ``PREFIX`` on (its row ``rows − PREFIX``)."""
    columns = (j < dvh)[None, :]
    if HAS_LOCAL:
        local_rows = ok & (rows >= PREFIX)
        out += tl.load(local_base + (rows - PREFIX)[:, None] * stride_lt + j[None, :] * stride_lc,
                       mask=local_rows[:, None] & columns, other=0.0).to(ACC)
    if HAS_GATE:
        out *= tl.load(gate_base + rows[:, None] * stride_gt + j[None, :] * stride_gc, mask=ok[:, None] & columns,
                       other=0.0).to(ACC)
    return out


@triton.jit
def _queries(q_base, t_same, t_opp, rows, ok, stride_qt, stride_qc, stride_tsc, stride_toc, cos_ptr, sin_ptr,
             stride_rt, stride_rc, shift_even, shift_odd, d, P: tl.constexpr, ROPE: tl.constexpr, RAW: tl.constexpr,
             ACC: tl.constexpr):
    """A block of queries: both streams' features (plain and rotated), row shifts, pre-activation bases
    (``[a | b]`` and ``[b | a]``), the temperatures, the raw queries and the RoPE tables."""
    positive, channel, even_ok, odd_ok, feature = _columns(d, P)
    q_even, q_odd = _load_blocks(q_base, rows, ok, stride_qt, stride_qc, channel, even_ok, odd_ok, ACC)
    ts_even, ts_odd = _load_temperatures(t_same, stride_tsc, feature, even_ok, odd_ok, RAW, ACC)
    to_even, to_odd = _load_temperatures(t_opp, stride_toc, feature, even_ok, odd_ok, RAW, ACC)
    base_s_even, base_s_odd = _halves(q_even, positive), _halves(q_odd, positive)
    base_o_even, base_o_odd = _halves(-q_even, positive), _halves(-q_odd, positive)
    fs_even, fs_odd, row_s = _stream_features(base_s_even * ts_even, base_s_odd * ts_odd, shift_even, shift_odd)
    fo_even, fo_odd, row_o = _stream_features(base_o_even * to_even, base_o_odd * to_odd, shift_even, shift_odd)
    ns_even, ns_odd, no_even, no_odd = fs_even, fs_odd, fo_even, fo_odd
    cos_even, cos_odd, sin_even, sin_odd = fs_even, fs_odd, fs_even, fs_odd  # stand-ins without tables
    if ROPE:
        cos_even, cos_odd = _load_blocks(cos_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
        sin_even, sin_odd = _load_blocks(sin_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
        ns_even, ns_odd = _rotate(fs_even, fs_odd, cos_even, cos_odd, sin_even, sin_odd)
        no_even, no_odd = _rotate(fo_even, fo_odd, cos_even, cos_odd, sin_even, sin_odd)
    return (fs_even, fs_odd, ns_even, ns_odd, row_s, fo_even, fo_odd, no_even, no_odd, row_o,
            base_s_even, base_s_odd, base_o_even, base_o_odd, ts_even, ts_odd, to_even, to_odd,
            q_even, q_odd, cos_even, cos_odd, sin_even, sin_odd)


@triton.jit(do_not_specialize=["K_LEN"])
def _state_kernel(
    k_ptr, v_ptr, mask_ptr, cu_k_ptr, cos_ptr, sin_ptr, part_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc, stride_vb, stride_vh, stride_vt, stride_vc, stride_mb, stride_mt,
    stride_rt, stride_rc, K_LEN, d, dvh,
    SPLITS: tl.constexpr, P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr, PACKED: tl.constexpr,
    ROPE: tl.constexpr, HAS_MASK: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Partial state of one split of one sequence's keys. Grid: (splits, heads, sequences)."""
    split, head, seq, heads = program()
    batch, first, end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
    lo, hi = share(first, end, split, SPLITS, BLOCK)
    state = _key_state(k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
                       mask_ptr + batch * stride_mb, cos_ptr, sin_ptr, lo, hi, stride_kt, stride_kc, stride_vt,
                       stride_vc, stride_mt, stride_rt, stride_rc, d, dvh, P, DVH, BLOCK, ROPE, HAS_MASK, ACC, DOT,
                       GRAD_DOT, PRECISION)
    width: tl.constexpr = 8 * P * DVH + 8 * P + 1
    _store_state(part_ptr + ((seq * heads + head) * SPLITS + split) * width, *state, P, DVH)


@triton.jit(do_not_specialize=["Q_LEN", "K_LEN", "PREFIX"])
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, ts_ptr, to_ptr, local_ptr, gate_ptr, mask_ptr, cu_q_ptr, cu_k_ptr, cos_ptr, sin_ptr, part_ptr,
    state_ptr, out_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc, stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc, stride_tsb, stride_tsh, stride_tsc, stride_tob, stride_toh,
    stride_toc, stride_lb, stride_lh, stride_lt, stride_lc, stride_gb, stride_gh, stride_gt, stride_gc,
    stride_mb, stride_mt, stride_rt, stride_rc, stride_ob, stride_oh, stride_ot, stride_oc,
    Q_LEN, K_LEN, d, dvh, PREFIX, eps,
    SPANS: tl.constexpr, SPLITS: tl.constexpr, P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr,
    PACKED: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr, SAVE_STATE: tl.constexpr, RAW: tl.constexpr,
    HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Both streams' output for one span of one sequence's queries, the key state built here (``SPLITS == 0``) or
    merged from the state launch's partials; the first span saves it. Grid: (spans, heads, sequences)."""
    span, head, seq, heads = program()
    batch, q_first, q_end = sequence_tokens(seq, cu_q_ptr, Q_LEN, PACKED)
    width: tl.constexpr = 8 * P * DVH + 8 * P + 1
    if SPLITS == 0:
        _, k_first, k_end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
        state = _key_state(
            k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
            mask_ptr + batch * stride_mb, cos_ptr, sin_ptr, k_first, k_end, stride_kt, stride_kc, stride_vt,
            stride_vc, stride_mt, stride_rt, stride_rc, d, dvh, P, DVH, BLOCK, ROPE, HAS_MASK, ACC, DOT, GRAD_DOT,
            PRECISION)
    else:
        state = _merge_partials(part_ptr + (seq * heads + head) * SPLITS * width, SPLITS, P, DVH, ACC)
    same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd, count = state
    inv_m = 1.0 / tl.maximum(count, 1.0)
    same_even, same_odd, opp_even, opp_odd = same_even * inv_m, same_odd * inv_m, opp_even * inv_m, opp_odd * inv_m
    mean_even, mean_odd = mean_even * inv_m, mean_odd * inv_m
    if SAVE_STATE:
        if span == 0:
            _store_state(state_ptr + (seq * heads + head) * width, same_even, same_odd, opp_even, opp_odd,
                         mean_even, mean_odd, shift_even, shift_odd, count, P, DVH)
    j = tl.arange(0, DVH)
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    o_base = out_ptr + batch * stride_ob + head * stride_oh
    t_same = ts_ptr + batch * stride_tsb + head * stride_tsh
    t_opp = to_ptr + batch * stride_tob + head * stride_toh
    local_base = local_ptr + batch * stride_lb + head * stride_lh
    gate_base = gate_ptr + batch * stride_gb + head * stride_gh
    lo, hi = share(q_first, q_end, span, SPANS, BLOCK)
    for t0 in range(lo, hi, BLOCK):
        rows = t0 + tl.arange(0, BLOCK)
        ok = rows < hi
        block = _queries(q_base, t_same, t_opp, rows, ok, stride_qt, stride_qc, stride_tsc, stride_toc, cos_ptr,
                         sin_ptr, stride_rt, stride_rc, shift_even, shift_odd, d, P, ROPE, RAW, ACC)
        fs_even, fs_odd, ns_even, ns_odd, row_s, fo_even, fo_odd, no_even, no_odd, row_o = block[:10]
        num, den = _stream_output(fs_even, fs_odd, ns_even, ns_odd, row_s, same_even, same_odd, mean_even,
                                  mean_odd, eps, ACC, DOT, GRAD_DOT, PRECISION)
        o_ptr = o_base + rows[:, None] * stride_ot + j[None, :] * stride_oc
        o_ok = ok[:, None] & (j < dvh)[None, :]
        out = _epilogue(num / den[:, None], local_base, gate_base, rows, ok, j, dvh, stride_lt, stride_lc,
                        stride_gt, stride_gc, PREFIX, HAS_LOCAL, HAS_GATE, ACC)
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=o_ok)
        num, den = _stream_output(fo_even, fo_odd, no_even, no_odd, row_o, opp_even, opp_odd, mean_even,
                                  mean_odd, eps, ACC, DOT, GRAD_DOT, PRECISION)
        out = _epilogue(num / den[:, None], local_base + dvh * stride_lc, gate_base + dvh * stride_gc, rows, ok, j,
                        dvh, stride_lt, stride_lc, stride_gt, stride_gc, PREFIX, HAS_LOCAL, HAS_GATE, ACC)
        tl.store(o_ptr + dvh * stride_oc, out.to(out_ptr.dtype.element_ty), mask=o_ok)


@triton.jit
def _epilogue_backward(grad, attention, local_base, gate_base, dl_base, dg_base, rows, ok, j, dvh, stride_lt,
                       stride_lc, stride_gt, stride_gc, stride_dlt, stride_dlc, stride_dgt, stride_dgc, PREFIX,
                       HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, ACC: tl.constexpr):
    """One stream's attention gradient from its output's through ``(attention + local) · gate``; with a gate,
    the gate's gradient and the local branch's are written (without one, the local branch's is the output's)."""
    if HAS_GATE:
        columns = ok[:, None] & (j < dvh)[None, :]
        gate = tl.load(gate_base + rows[:, None] * stride_gt + j[None, :] * stride_gc, mask=columns,
                       other=0.0).to(ACC)
        attended = _epilogue(attention, local_base, gate_base, rows, ok, j, dvh, stride_lt, stride_lc, stride_gt,
                             stride_gc, PREFIX, HAS_LOCAL, False, ACC)
        tl.store(dg_base + rows[:, None] * stride_dgt + j[None, :] * stride_dgc,
                 (grad * attended).to(dg_base.dtype.element_ty), mask=columns)
        grad = grad * gate
        if HAS_LOCAL:
            tl.store(dl_base + (rows - PREFIX)[:, None] * stride_dlt + j[None, :] * stride_dlc,
                     grad.to(dl_base.dtype.element_ty), mask=columns & (rows >= PREFIX)[:, None])
    return grad


@triton.jit
def _stream_backward(f_even, f_odd, n_even, n_odd, row, num, den, grad, kv_even, kv_odd, mean_even, mean_odd,
                     shift_even, shift_odd, cos_even, cos_odd, sin_even, sin_odd,
                     ROPE: tl.constexpr, ACC: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One stream's backward through ``out = R(φ)·kv / (φ·k̄ + eps) = num / den`` for a block of queries: the
    gradients of its pre-activations (even, odd), of the numerator ``g/den`` and of the normaliser."""
    g_num = grad / den[:, None]
    g_den = -tl.sum(g_num * (num / den[:, None]), 1)
    d_even = dot(g_num, tl.trans(kv_even), GRAD_DOT, PRECISION, ACC)
    d_odd = dot(g_num, tl.trans(kv_odd), GRAD_DOT, PRECISION, ACC)
    if ROPE:
        d_even, d_odd = _rotate_transposed(d_even, d_odd, cos_even, cos_odd, sin_even, sin_odd)
    d_even += g_den[:, None] * mean_even[None, :]
    d_odd += g_den[:, None] * mean_odd[None, :]
    # φ = (e^x − 1)·σ with σ = e^(shift − row): dφ/dx = φ + σ (σ ≤ 1 wherever x ≠ 0; capped elsewhere)
    d_even *= f_even + tl.exp(tl.minimum(shift_even[None, :] - row[:, None], 0.0))
    d_odd *= f_odd + tl.exp(tl.minimum(shift_odd[None, :] - row[:, None], 0.0))
    return d_even, d_odd, g_num, g_den


@triton.jit
def _fold_halves(x, BLOCK: tl.constexpr, P: tl.constexpr):
    """(BLOCK, 2P) → (BLOCK, P): the two halves' entries of each input channel added."""
    return tl.sum(tl.reshape(x, (BLOCK, 2, P)), 1)


@triton.jit
def _input_grad(x, d_pos_or_neg, positive, BLOCK: tl.constexpr, P: tl.constexpr):
    """Gradient of x through ``[relu(x) | relu(-x)]`` given the gradients of both halves (block layout)."""
    part = tl.where(positive[None, :], tl.where(x > 0, d_pos_or_neg, 0.0), tl.where(x < 0, -d_pos_or_neg, 0.0))
    return _fold_halves(part, BLOCK, P)


@triton.jit
def _query_grads(q_base, g_base, dq_base, t_same, t_opp, local_base, gate_base, dl_base, dg_base, lo, hi, cos_ptr,
                 sin_ptr, stride_qt, stride_qc, stride_gt, stride_gc, stride_dqt, stride_dqc, stride_tsc, stride_toc,
                 stride_rt, stride_rc, stride_lt, stride_lc, stride_at, stride_ac, stride_dlt, stride_dlc, stride_dgt,
                 stride_dgc, same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd, d,
                 dvh, PREFIX, eps,
                 P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, RAW: tl.constexpr,
                 HAS_LOCAL: tl.constexpr, HAS_GATE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
                 GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """``grad_q`` of queries ``[lo, hi)`` (written; with a gate also its gradient and the local branch's) and
    their sums of the gradients of the state (as divided by M) and of the temperatures (same even, same odd,
    opposite even, opposite odd)."""
    positive, channel, even_ok, odd_ok, feature = _columns(d, P)
    pair = tl.arange(0, P)
    j = tl.arange(0, DVH)
    g_same_even = tl.zeros([2 * P, DVH], dtype=ACC)
    g_same_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    g_opp_even = tl.zeros([2 * P, DVH], dtype=ACC)
    g_opp_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    g_mean_even = tl.zeros([2 * P], dtype=ACC)
    g_mean_odd = tl.zeros([2 * P], dtype=ACC)
    g_ts_even = tl.zeros([2 * P], dtype=ACC)
    g_ts_odd = tl.zeros([2 * P], dtype=ACC)
    g_to_even = tl.zeros([2 * P], dtype=ACC)
    g_to_odd = tl.zeros([2 * P], dtype=ACC)
    for t0 in range(lo, hi, BLOCK):
        rows = t0 + tl.arange(0, BLOCK)
        ok = rows < hi
        (fs_even, fs_odd, ns_even, ns_odd, row_s, fo_even, fo_odd, no_even, no_odd, row_o,
         base_s_even, base_s_odd, base_o_even, base_o_odd, ts_even, ts_odd, to_even, to_odd,
         q_even, q_odd, cos_even, cos_odd, sin_even, sin_odd) = _queries(
            q_base, t_same, t_opp, rows, ok, stride_qt, stride_qc, stride_tsc, stride_toc, cos_ptr, sin_ptr, stride_rt,
            stride_rc, shift_even, shift_odd, d, P, ROPE, RAW, ACC)
        g_ptr = g_base + rows[:, None] * stride_gt + j[None, :] * stride_gc
        g_ok = ok[:, None] & (j < dvh)[None, :]
        grad_same = tl.load(g_ptr, mask=g_ok, other=0.0).to(ACC)
        grad_opp = tl.load(g_ptr + dvh * stride_gc, mask=g_ok, other=0.0).to(ACC)
        num_s, den_s = _stream_output(fs_even, fs_odd, ns_even, ns_odd, row_s, same_even, same_odd, mean_even,
                                      mean_odd, eps, ACC, DOT, GRAD_DOT, PRECISION)
        num_o, den_o = _stream_output(fo_even, fo_odd, no_even, no_odd, row_o, opp_even, opp_odd, mean_even,
                                      mean_odd, eps, ACC, DOT, GRAD_DOT, PRECISION)
        grad_same = _epilogue_backward(grad_same, num_s / den_s[:, None], local_base, gate_base, dl_base, dg_base,
                                       rows, ok, j, dvh, stride_lt, stride_lc, stride_at, stride_ac, stride_dlt,
                                       stride_dlc, stride_dgt, stride_dgc, PREFIX, HAS_LOCAL, HAS_GATE, ACC)
        grad_opp = _epilogue_backward(grad_opp, num_o / den_o[:, None], local_base + dvh * stride_lc,
                                      gate_base + dvh * stride_ac, dl_base + dvh * stride_dlc,
                                      dg_base + dvh * stride_dgc, rows, ok, j, dvh, stride_lt, stride_lc, stride_at,
                                      stride_ac, stride_dlt, stride_dlc, stride_dgt, stride_dgc, PREFIX, HAS_LOCAL,
                                      HAS_GATE, ACC)
        ds_even, ds_odd, gs_num, gs_den = _stream_backward(
            fs_even, fs_odd, ns_even, ns_odd, row_s, num_s, den_s, grad_same, same_even, same_odd, mean_even,
            mean_odd, shift_even, shift_odd, cos_even, cos_odd, sin_even, sin_odd, ROPE, ACC, GRAD_DOT, PRECISION)
        do_even, do_odd, go_num, go_den = _stream_backward(
            fo_even, fo_odd, no_even, no_odd, row_o, num_o, den_o, grad_opp, opp_even, opp_odd, mean_even,
            mean_odd, shift_even, shift_odd, cos_even, cos_odd, sin_even, sin_odd, ROPE, ACC, GRAD_DOT, PRECISION)
        # pre-activations: same stream [a | b]·T_same, opposite stream [b | a]·T_opp
        g_ts_even += tl.sum(ds_even * base_s_even, 0)
        g_ts_odd += tl.sum(ds_odd * base_s_odd, 0)
        g_to_even += tl.sum(do_even * base_o_even, 0)
        g_to_odd += tl.sum(do_odd * base_o_odd, 0)
        # through x = ±q into the halves: the opposite stream's halves hold the other sign
        dq_even = _input_grad(q_even, ds_even * ts_even, positive, BLOCK, P)
        dq_even += _input_grad(-q_even, do_even * to_even, positive, BLOCK, P) * -1.0
        dq_odd = _input_grad(q_odd, ds_odd * ts_odd, positive, BLOCK, P)
        dq_odd += _input_grad(-q_odd, do_odd * to_odd, positive, BLOCK, P) * -1.0
        dq_ptr = dq_base + rows[:, None] * stride_dqt + (2 * pair)[None, :] * stride_dqc
        tl.store(dq_ptr, dq_even.to(dq_base.dtype.element_ty), mask=ok[:, None] & (2 * pair < d)[None, :])
        tl.store(dq_ptr + stride_dqc, dq_odd.to(dq_base.dtype.element_ty),
                 mask=ok[:, None] & (2 * pair + 1 < d)[None, :])
        g_same_even += dot(tl.trans(ns_even), gs_num, GRAD_DOT, PRECISION, ACC)
        g_same_odd += dot(tl.trans(ns_odd), gs_num, GRAD_DOT, PRECISION, ACC)
        g_opp_even += dot(tl.trans(no_even), go_num, GRAD_DOT, PRECISION, ACC)
        g_opp_odd += dot(tl.trans(no_odd), go_num, GRAD_DOT, PRECISION, ACC)
        g_mean_even += tl.sum(gs_den[:, None] * fs_even + go_den[:, None] * fo_even, 0)
        g_mean_odd += tl.sum(gs_den[:, None] * fs_odd + go_den[:, None] * fo_odd, 0)
    return (g_same_even, g_same_odd, g_opp_even, g_opp_odd, g_mean_even, g_mean_odd,
            g_ts_even, g_ts_odd, g_to_even, g_to_odd)


@triton.jit
def _key_grads(k_base, v_base, mask_base, dk_base, dv_base, cos_ptr, sin_ptr, lo, hi,
               stride_kt, stride_kc, stride_vt, stride_vc, stride_mt, stride_dkt, stride_dkc, stride_dvt, stride_dvc,
               stride_rt, stride_rc, g_same_even, g_same_odd, g_opp_even, g_opp_odd, g_mean_even, g_mean_odd,
               shift_even, shift_odd, inv_m, d, dvh,
               P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr,
               ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr,
    PRECISION: tl.constexpr):
    """``grad_k`` and ``grad_v`` of keys ``[lo, hi)`` (written; zero at padded keys) from the state's gradient:
    ``dv = R(φk)·G``, ``dφk = Rᵀ(G·v) + G_k̄``. Features are recomputed with the state's shifts."""
    positive, channel, even_ok, odd_ok, feature = _columns(d, P)
    pair = tl.arange(0, P)
    j = tl.arange(0, DVH)
    g_same_even, g_same_odd = g_same_even * inv_m, g_same_odd * inv_m
    g_opp_even, g_opp_odd = g_opp_even * inv_m, g_opp_odd * inv_m
    g_mean_even, g_mean_odd = g_mean_even * inv_m, g_mean_odd * inv_m
    floor_even, floor_odd = tl.exp(-shift_even), tl.exp(-shift_odd)
    for t0 in range(lo, hi, BLOCK):
        rows = t0 + tl.arange(0, BLOCK)
        valid = rows < hi
        ok = unpadded_keys(mask_base, rows, valid, stride_mt, HAS_MASK)
        k_even, k_odd = _load_blocks(k_base, rows, ok, stride_kt, stride_kc, channel, even_ok, odd_ok, ACC)
        f_even = _shifted_feature(_halves(k_even, positive), 0.0, shift_even[None, :])
        f_odd = _shifted_feature(_halves(k_odd, positive), 0.0, shift_odd[None, :])
        n_even, n_odd = f_even, f_odd
        cos_even, cos_odd, sin_even, sin_odd = f_even, f_odd, f_even, f_odd  # stand-ins without tables
        if ROPE:
            cos_even, cos_odd = _load_blocks(cos_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
            sin_even, sin_odd = _load_blocks(sin_ptr, rows, ok, stride_rt, stride_rc, feature, even_ok, odd_ok, ACC)
            n_even, n_odd = _rotate(f_even, f_odd, cos_even, cos_odd, sin_even, sin_odd)
        v_ptr = v_base + rows[:, None] * stride_vt + j[None, :] * stride_vc
        v_ok = ok[:, None] & (j < dvh)[None, :]
        v_same = tl.load(v_ptr, mask=v_ok, other=0.0).to(ACC)
        v_opp = tl.load(v_ptr + dvh * stride_vc, mask=v_ok, other=0.0).to(ACC)
        dv_same = dot(n_even, g_same_even, GRAD_DOT, PRECISION, ACC)
        dv_same += dot(n_odd, g_same_odd, GRAD_DOT, PRECISION, ACC)
        dv_opp = dot(n_even, g_opp_even, GRAD_DOT, PRECISION, ACC)
        dv_opp += dot(n_odd, g_opp_odd, GRAD_DOT, PRECISION, ACC)
        dv_ptr = dv_base + rows[:, None] * stride_dvt + j[None, :] * stride_dvc
        dv_ok = valid[:, None] & (j < dvh)[None, :]
        tl.store(dv_ptr, dv_same.to(dv_base.dtype.element_ty), mask=dv_ok)
        tl.store(dv_ptr + dvh * stride_dvc, dv_opp.to(dv_base.dtype.element_ty), mask=dv_ok)
        d_even = dot(v_same, tl.trans(g_same_even), GRAD_DOT, PRECISION, ACC)
        d_even += dot(v_opp, tl.trans(g_opp_even), GRAD_DOT, PRECISION, ACC)
        d_odd = dot(v_same, tl.trans(g_same_odd), GRAD_DOT, PRECISION, ACC)
        d_odd += dot(v_opp, tl.trans(g_opp_odd), GRAD_DOT, PRECISION, ACC)
        if ROPE:
            d_even, d_odd = _rotate_transposed(d_even, d_odd, cos_even, cos_odd, sin_even, sin_odd)
        # φk = (e^y − 1)·e^-shift: dφk/dy = φk + e^-shift
        d_even = (d_even + g_mean_even[None, :]) * (f_even + floor_even[None, :])
        d_odd = (d_odd + g_mean_odd[None, :]) * (f_odd + floor_odd[None, :])
        dk_ptr = dk_base + rows[:, None] * stride_dkt + (2 * pair)[None, :] * stride_dkc
        tl.store(dk_ptr, _input_grad(k_even, d_even, positive, BLOCK, P).to(dk_base.dtype.element_ty),
                 mask=valid[:, None] & (2 * pair < d)[None, :])
        tl.store(dk_ptr + stride_dkc, _input_grad(k_odd, d_odd, positive, BLOCK, P).to(dk_base.dtype.element_ty),
                 mask=valid[:, None] & (2 * pair + 1 < d)[None, :])


@triton.jit
def _sigmoid_slope(base, index, stride_c, ok, ACC: tl.constexpr):
    """``σ'(w) = σ(w)(1 − σ(w))`` of the raw weights at ``index``."""
    weight = sigmoid(tl.load(base + index * stride_c, mask=ok, other=0.0).to(ACC))
    return weight * (1.0 - weight)


@triton.jit
def _store_temperature_grads(base, g_ts_even, g_ts_odd, g_to_even, g_to_odd, t_same, t_opp, stride_tsc, stride_toc,
                             d, P: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr):
    """The temperatures' gradient of one part (of their raw weights with ``RAW``), as (2 streams, 2d) in the
    inputs' channel order."""
    positive, channel, even_ok, odd_ok, feature = _columns(d, P)
    if RAW:
        g_ts_even *= _sigmoid_slope(t_same, feature, stride_tsc, even_ok, ACC)
        g_ts_odd *= _sigmoid_slope(t_same, feature + 1, stride_tsc, odd_ok, ACC)
        g_to_even *= _sigmoid_slope(t_opp, feature, stride_toc, even_ok, ACC)
        g_to_odd *= _sigmoid_slope(t_opp, feature + 1, stride_toc, odd_ok, ACC)
    tl.store(base + feature, g_ts_even, mask=even_ok)
    tl.store(base + feature + 1, g_ts_odd, mask=odd_ok)
    tl.store(base + 2 * d + feature, g_to_even, mask=even_ok)
    tl.store(base + 2 * d + feature + 1, g_to_odd, mask=odd_ok)


@triton.jit(do_not_specialize=["Q_LEN", "K_LEN", "PREFIX"])
def _backward_kernel(
    q_ptr, k_ptr, v_ptr, ts_ptr, to_ptr, local_ptr, gate_ptr, mask_ptr, cu_q_ptr, cu_k_ptr, cos_ptr, sin_ptr,
    state_ptr, grad_out_ptr, grad_q_ptr, grad_k_ptr, grad_v_ptr, grad_local_ptr, grad_gate_ptr, grad_part_ptr,
    grad_temp_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc, stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc, stride_tsb, stride_tsh, stride_tsc, stride_tob, stride_toh,
    stride_toc, stride_lb, stride_lh, stride_lt, stride_lc, stride_ab, stride_ah, stride_at, stride_ac,
    stride_mb, stride_mt, stride_rt, stride_rc, stride_gb, stride_gh, stride_gt, stride_gc,
    stride_dqb, stride_dqh, stride_dqt, stride_dqc, stride_dkb, stride_dkh, stride_dkt, stride_dkc,
    stride_dvb, stride_dvh, stride_dvt, stride_dvc, stride_dlb, stride_dlh, stride_dlt, stride_dlc,
    stride_dgb, stride_dgh, stride_dgt, stride_dgc,
    Q_LEN, K_LEN, d, dvh, PREFIX, eps,
    SPANS: tl.constexpr, TEMP_PARTS: tl.constexpr, P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr,
    PACKED: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr, RAW: tl.constexpr, HAS_LOCAL: tl.constexpr,
    HAS_GATE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """The query side of the backward for one span of one sequence's queries; with one span the key side too,
    from the state's gradient in registers, else the span's partial gradient of the state is stored for
    :func:`_key_grad_kernel`. Grid: (spans, heads, sequences)."""
    span, head, seq, heads = program()
    batch, q_first, q_end = sequence_tokens(seq, cu_q_ptr, Q_LEN, PACKED)
    width: tl.constexpr = 8 * P * DVH + 8 * P + 1
    # the saved state is already divided by its count
    (same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd,
     count) = _load_state(state_ptr + (seq * heads + head) * width, P, DVH)
    inv_m = 1.0 / tl.maximum(count, 1.0)
    lo, hi = share(q_first, q_end, span, SPANS, BLOCK)
    t_same = ts_ptr + batch * stride_tsb + head * stride_tsh
    t_opp = to_ptr + batch * stride_tob + head * stride_toh
    grads = _query_grads(
        q_ptr + batch * stride_qb + head * stride_qh, grad_out_ptr + batch * stride_gb + head * stride_gh,
        grad_q_ptr + batch * stride_dqb + head * stride_dqh, t_same, t_opp,
        local_ptr + batch * stride_lb + head * stride_lh, gate_ptr + batch * stride_ab + head * stride_ah,
        grad_local_ptr + batch * stride_dlb + head * stride_dlh, grad_gate_ptr + batch * stride_dgb + head * stride_dgh,
        lo, hi, cos_ptr, sin_ptr, stride_qt, stride_qc, stride_gt, stride_gc, stride_dqt, stride_dqc, stride_tsc,
        stride_toc, stride_rt, stride_rc, stride_lt, stride_lc, stride_at, stride_ac, stride_dlt, stride_dlc,
        stride_dgt, stride_dgc, same_even, same_odd, opp_even, opp_odd, mean_even, mean_odd, shift_even, shift_odd,
        d, dvh, PREFIX, eps, P, DVH, BLOCK, ROPE, RAW, HAS_LOCAL, HAS_GATE, ACC, DOT, GRAD_DOT, PRECISION)
    g_same_even, g_same_odd, g_opp_even, g_opp_odd, g_mean_even, g_mean_odd = grads[:6]
    _store_temperature_grads(grad_temp_ptr + ((seq * heads + head) * TEMP_PARTS + span) * 4 * d, *grads[6:], t_same,
                             t_opp, stride_tsc, stride_toc, d, P, RAW, ACC)
    if SPANS == 1:
        _, k_first, k_end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
        _key_grads(k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
                   mask_ptr + batch * stride_mb, grad_k_ptr + batch * stride_dkb + head * stride_dkh,
                   grad_v_ptr + batch * stride_dvb + head * stride_dvh, cos_ptr, sin_ptr, k_first, k_end,
                   stride_kt, stride_kc, stride_vt, stride_vc, stride_mt, stride_dkt, stride_dkc, stride_dvt,
                   stride_dvc, stride_rt, stride_rc, g_same_even, g_same_odd, g_opp_even, g_opp_odd, g_mean_even,
                   g_mean_odd, shift_even, shift_odd, inv_m, d, dvh, P, DVH, BLOCK, ROPE, HAS_MASK, ACC, DOT,
                   GRAD_DOT, PRECISION)
    else:
        grad_width: tl.constexpr = 8 * P * DVH + 4 * P
        _, tile, vectors = _state_offsets(P, DVH)
        cell = tl.arange(0, 2 * P)[:, None] * DVH + tl.arange(0, DVH)[None, :]
        i = tl.arange(0, 2 * P)
        base = grad_part_ptr + ((seq * heads + head) * SPANS + span) * grad_width
        tl.store(base + cell, g_same_even)
        tl.store(base + tile + cell, g_same_odd)
        tl.store(base + 2 * tile + cell, g_opp_even)
        tl.store(base + 3 * tile + cell, g_opp_odd)
        tl.store(base + vectors + i, g_mean_even)
        tl.store(base + vectors + 2 * P + i, g_mean_odd)


@triton.jit(do_not_specialize=["K_LEN"])
def _key_grad_kernel(
    k_ptr, v_ptr, mask_ptr, cu_k_ptr, cos_ptr, sin_ptr, state_ptr, grad_part_ptr, grad_k_ptr, grad_v_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc, stride_vb, stride_vh, stride_vt, stride_vc, stride_mb, stride_mt,
    stride_rt, stride_rc, stride_dkb, stride_dkh, stride_dkt, stride_dkc, stride_dvb, stride_dvh, stride_dvt,
    stride_dvc, K_LEN, d, dvh,
    SPANS: tl.constexpr, SPLITS: tl.constexpr, P: tl.constexpr, DVH: tl.constexpr, BLOCK: tl.constexpr,
    PACKED: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    GRAD_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """The key side of the backward for one split of one sequence's keys, from the query spans' partial gradients
    of the state (added in span order). Grid: (splits, heads, sequences)."""
    split, head, seq, heads = program()
    batch, first, end = sequence_tokens(seq, cu_k_ptr, K_LEN, PACKED)
    width: tl.constexpr = 8 * P * DVH + 8 * P + 1
    state = _load_state(state_ptr + (seq * heads + head) * width, P, DVH)
    shift_even, shift_odd, count = state[6], state[7], state[8]
    cell, tile, vectors = _state_offsets(P, DVH)
    i = tl.arange(0, 2 * P)
    grad_width: tl.constexpr = 8 * P * DVH + 4 * P
    g_same_even = tl.zeros([2 * P, DVH], dtype=ACC)
    g_same_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    g_opp_even = tl.zeros([2 * P, DVH], dtype=ACC)
    g_opp_odd = tl.zeros([2 * P, DVH], dtype=ACC)
    g_mean_even = tl.zeros([2 * P], dtype=ACC)
    g_mean_odd = tl.zeros([2 * P], dtype=ACC)
    for span in range(SPANS):
        base = grad_part_ptr + ((seq * heads + head) * SPANS + span) * grad_width
        g_same_even += tl.load(base + cell)
        g_same_odd += tl.load(base + tile + cell)
        g_opp_even += tl.load(base + 2 * tile + cell)
        g_opp_odd += tl.load(base + 3 * tile + cell)
        g_mean_even += tl.load(base + vectors + i)
        g_mean_odd += tl.load(base + vectors + 2 * P + i)
    lo, hi = share(first, end, split, SPLITS, BLOCK)
    _key_grads(k_ptr + batch * stride_kb + head * stride_kh, v_ptr + batch * stride_vb + head * stride_vh,
               mask_ptr + batch * stride_mb, grad_k_ptr + batch * stride_dkb + head * stride_dkh,
               grad_v_ptr + batch * stride_dvb + head * stride_dvh, cos_ptr, sin_ptr, lo, hi,
               stride_kt, stride_kc, stride_vt, stride_vc, stride_mt, stride_dkt, stride_dkc, stride_dvt, stride_dvc,
               stride_rt, stride_rc, g_same_even, g_same_odd, g_opp_even, g_opp_odd, g_mean_even, g_mean_odd,
               shift_even, shift_odd, 1.0 / tl.maximum(count, 1.0), d, dvh, P, DVH, BLOCK, ROPE, HAS_MASK, ACC, DOT,
               GRAD_DOT, PRECISION)


class _Call:
    """Sizes, compile-time switches and the launch plan of one call, shared by its forward and backward."""

    def __init__(self, q, k, v, temp_same, temp_opposite, sin, key_padding_mask, cu_seqlens, cu_seqlens_k,
                 raw=False, local=None, gate=None):
        self.packed = cu_seqlens is not None
        batch, self.heads, self.q_len, self.d = q.shape
        self.k_len, self.dvh = k.shape[-2], v.shape[-1] // 2
        self.sequences = cu_seqlens.shape[0] - 1 if self.packed else batch
        self.p, self.dvh_pad = padded_width((self.d + 1) // 2), padded_width(self.dvh)
        self.width = 8 * self.p * self.dvh_pad + 8 * self.p + 1
        self.acc = accumulator_dtype(q, k, v)
        self.dots = dots(q, k, v)
        block = 16  # the backward's tiles (both streams, both blocks) stay in registers on sm_90 with 16 tokens
        per_sequence = max(self.sequences, 1)
        self.plan = plan(self.sequences, self.heads, -(-self.q_len // per_sequence) if self.packed else self.q_len,
                         -(-self.k_len // per_sequence) if self.packed else self.k_len, block, q.device)
        # the temperatures (their raw weights with ``raw``: sigmoid in the kernels) as (B, H, 2d) views with their
        # own strides: no copy per call
        target = (batch, self.heads, 1, 2 * self.d)
        self.temp_same = temp_same.expand(target)[:, :, 0]
        self.temp_opposite = temp_opposite.expand(target)[:, :, 0]
        self.raw = raw
        self.rope = sin is not None
        self.local, self.gate = local, gate
        self.prefix = 0 if local is None else self.q_len - local.shape[-2]  # queries without a local term
        self.mask = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
        self.cu_q = cu_seqlens
        self.cu_k = (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k) if self.packed else None
        self.warps = warps(2 * self.p, 4 * self.dvh_pad)

    def grid(self, programs: int):
        return programs, self.heads, self.sequences

    def constants(self):
        return dict(P=self.p, DVH=self.dvh_pad, BLOCK=self.plan.block, PACKED=self.packed, ROPE=self.rope,
                    HAS_MASK=self.mask is not None, ACC=tl.float64 if self.acc == torch.float64 else tl.float32,
                    num_warps=self.warps, **self.dots.constants())

    def epilogue(self):
        return dict(RAW=self.raw, HAS_LOCAL=self.local is not None, HAS_GATE=self.gate is not None)

    def pointers(self, like, sin, cos):
        """Stand-ins for absent tensors (never read): mask, offsets, tables, and the tables' strides."""
        tables = (like, like, 0, 0) if sin is None else (cos, sin, *sin.stride())
        return (like if self.mask is None else self.mask, like if self.cu_q is None else self.cu_q,
                like if self.cu_k is None else self.cu_k, *tables)

    def mask_strides(self):
        return (0, 0) if self.mask is None else self.mask.stride()


def _check_tables(sin, cos):
    if sin is not None and sin.stride() != cos.stride():
        raise ValueError(f"sin and cos must be laid out alike; got strides {sin.stride()} and {cos.stride()}")


def _as_is(kernel):
    return kernel


def _strides(t: torch.Tensor | None) -> tuple[int, ...]:
    return (0,) * 4 if t is None else tuple(t.stride())


def pacs_forward(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask=None, cu_seqlens=None,
                 cu_seqlens_k=None, out=None, save_state=True, *, raw=False, local=None, gate=None, traced=False):
    """Run the forward kernel(s); returns ``(out, state, call)``. ``out`` (B, H, N, dv), any strides, is written
    in place when given. ``raw``: the temperatures are given as their raw weights (``sigmoid`` in the kernels);
    ``local`` (B, H, N', dv) and ``gate`` (B, H, N, dv): the output is ``(attention + local) · gate``, the local
    branch on the last N' queries. ``traced``: launched as a registered op's body
    (:func:`polaformer.backends.triton.common.traceable`). Arguments are assumed checked by the op."""
    launch = traceable if traced else _as_is
    _check_tables(sin, cos)
    call = _Call(q, k, v, temp_same, temp_opposite, sin, key_padding_mask, cu_seqlens, cu_seqlens_k, raw, local,
                 gate)
    if out is None:  # (B, H, N, dv) over (B, N, H, dv) memory, as the torch formulation returns it
        out = v.new_empty(v.shape[0], call.q_len, call.heads, v.shape[-1]).transpose(1, 2)
    state = q.new_empty((call.sequences, call.heads, call.width) if save_state else (0,), dtype=call.acc)
    mask, cu_q, cu_k, cos_t, sin_t, stride_rt, stride_rc = call.pointers(q, sin, cos)
    splits = call.plan.key_splits
    partials = q.new_empty(0, dtype=call.acc)
    if splits:
        partials = q.new_empty(call.sequences, call.heads, splits, call.width, dtype=call.acc)
        launch(_state_kernel)[call.grid(splits)](
            k, v, mask, cu_k, cos_t, sin_t, partials, *k.stride(), *v.stride(), *call.mask_strides(), stride_rt,
            stride_rc, call.k_len, call.d, call.dvh, SPLITS=splits, **call.constants())
    launch(_forward_kernel)[call.grid(call.plan.query_spans)](
        q, k, v, call.temp_same, call.temp_opposite, q if local is None else local, q if gate is None else gate,
        mask, cu_q, cu_k, cos_t, sin_t, partials, state, out, *q.stride(), *k.stride(), *v.stride(),
        *call.temp_same.stride(), *call.temp_opposite.stride(), *_strides(local), *_strides(gate),
        *call.mask_strides(), stride_rt, stride_rc, *out.stride(), call.q_len, call.k_len, call.d, call.dvh,
        call.prefix, eps, SPANS=call.plan.query_spans, SPLITS=splits, SAVE_STATE=save_state, **call.epilogue(),
        **call.constants())
    return out, state, call


def pacs_backward(call, q, k, v, sin, cos, state, eps, grad_out, temp_shapes, grad_q=None, grad_k=None,
                  grad_v=None, *, traced=False):
    """Run the backward kernel(s); returns ``(grad_q, grad_k, grad_v, grad_temp_same, grad_temp_opposite,
    grad_local, grad_gate)`` (the last two None without a local branch or gate), writing into the given
    gradient buffers (any strides) where passed; the temperatures' gradients (their raw weights' for a ``raw``
    call) have the shapes ``temp_shapes``, in fp32 (fp64). ``traced`` as :func:`pacs_forward`'s."""
    launch = traceable if traced else _as_is
    grad_q = torch.empty_like(q) if grad_q is None else grad_q
    grad_k = torch.empty_like(k) if grad_k is None else grad_k
    grad_v = torch.empty_like(v) if grad_v is None else grad_v
    local, gate = call.local, call.gate
    grad_local = grad_gate = None
    if gate is not None:  # as the attention's output: (B, H, N, dv) over (B, N, H, dv) memory
        grad_gate = gate.new_empty(gate.shape[0], call.q_len, call.heads, gate.shape[-1]).transpose(1, 2)
        if local is not None:
            grad_local = torch.empty_like(local)
    elif local is not None:  # (out + local)'s gradient is the output's
        grad_local = grad_out[:, :, call.prefix:]
    spans, splits = call.plan.backward_spans, call.plan.backward_key_splits
    grad_temps = q.new_empty(call.sequences, call.heads, spans, 2, 2 * call.d, dtype=call.acc)
    mask, cu_q, cu_k, cos_t, sin_t, stride_rt, stride_rc = call.pointers(q, sin, cos)
    grad_partials = q.new_empty(0, dtype=call.acc)
    if spans > 1:
        grad_partials = q.new_empty(call.sequences, call.heads, spans, 8 * call.p * call.dvh_pad + 4 * call.p,
                                    dtype=call.acc)
    launch(_backward_kernel)[call.grid(spans)](
        q, k, v, call.temp_same, call.temp_opposite, q if local is None else local, q if gate is None else gate,
        mask, cu_q, cu_k, cos_t, sin_t, state, grad_out, grad_q, grad_k, grad_v,
        q if grad_local is None else grad_local, q if grad_gate is None else grad_gate, grad_partials, grad_temps,
        *q.stride(), *k.stride(), *v.stride(), *call.temp_same.stride(), *call.temp_opposite.stride(),
        *_strides(local), *_strides(gate), *call.mask_strides(), stride_rt, stride_rc, *grad_out.stride(),
        *grad_q.stride(), *grad_k.stride(), *grad_v.stride(), *_strides(grad_local), *_strides(grad_gate),
        call.q_len, call.k_len, call.d, call.dvh, call.prefix, eps, SPANS=spans, TEMP_PARTS=spans,
        **call.epilogue(), **call.constants())
    if spans > 1:
        launch(_key_grad_kernel)[call.grid(splits)](
            k, v, mask, cu_k, cos_t, sin_t, state, grad_partials, grad_k, grad_v, *k.stride(), *v.stride(),
            *call.mask_strides(), stride_rt, stride_rc, *grad_k.stride(), *grad_v.stride(), call.k_len, call.d,
            call.dvh, SPANS=spans, SPLITS=splits, **call.constants())
    return (grad_q, grad_k, grad_v, *_temperature_grads(grad_temps, temp_shapes), grad_local, grad_gate)


def _temperature_grads(parts: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, heads, parts, 2 streams, 2d) partial gradients → each temperature's shape, summed over the
    axes it broadcasts and over the parts: one reduction for both when their shapes match, none when nothing
    is broadcast and the work was whole."""
    def axes(shape):
        target = (1,) * (4 - len(shape)) + tuple(shape)
        return [axis for axis in range(3) if target[axis] == 1 and parts.shape[axis] > 1]

    if shapes[0] == shapes[1]:
        dims = axes(shapes[0])
        both = parts.sum(dim=dims, keepdim=True) if dims else parts
        return tuple(stream.reshape(shapes[0]) for stream in both.unbind(3))
    return tuple((stream.sum(dim=axes(shape), keepdim=True) if axes(shape) else stream).reshape(shape)
                 for stream, shape in zip(parts.unbind(3), shapes))


class PacsAttention(torch.autograd.Function):
    """The fused op with the backward kernels, for eager calls; inputs already checked by the ops
    (:func:`polaformer.ops.pacs_linear_attention`, :func:`polaformer.ops.pacs_layer_attention`).
    Differentiable once (see :class:`polaformer.ops.pola.triton.PolaAttention`)."""

    @staticmethod
    def forward(ctx, q, k, v, temp_same, temp_opposite, local, gate, sin, cos, eps, raw, key_padding_mask,
                cu_seqlens, cu_seqlens_k):
        out, state, call = pacs_forward(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask,
                                        cu_seqlens, cu_seqlens_k, raw=raw, local=local, gate=gate)
        ctx.save_for_backward(q, k, v, sin, cos, local, gate, state)
        ctx.call, ctx.eps = call, eps
        ctx.temps = ((temp_same.shape, temp_same.dtype), (temp_opposite.shape, temp_opposite.dtype))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, sin, cos, local, gate, state = ctx.saved_tensors
        (same_shape, same_dtype), (opp_shape, opp_dtype) = ctx.temps
        grads = pacs_backward(ctx.call, q, k, v, sin, cos, state, ctx.eps, grad_out, (same_shape, opp_shape))
        grads = (*grads[:3], grads[3].to(same_dtype), grads[4].to(opp_dtype), *grads[5:])
        return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)),
                None, None, None, None, None, None, None)


# The op as torch.compile sees it, the kernels inside its graph (see :mod:`polaformer.ops.pola.triton`): eager calls use
# :class:`PacsAttention` directly.
@torch.library.triton_op("polaformer::pacs_attention", mutates_args=())
def _pacs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, temp_same: torch.Tensor, temp_opposite: torch.Tensor,
             local: torch.Tensor | None, gate: torch.Tensor | None, sin: torch.Tensor | None, cos: torch.Tensor | None,
             eps: float, raw: bool, key_padding_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
             cu_seqlens_k: torch.Tensor | None, save_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, state, _ = pacs_forward(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, cu_seqlens,
                                 cu_seqlens_k, save_state=save_state, raw=raw, local=local, gate=gate, traced=True)
    return out, state


@torch.library.triton_op("polaformer::pacs_attention_backward", mutates_args=())
def _pacs_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      temp_same: torch.Tensor, temp_opposite: torch.Tensor, local: torch.Tensor | None,
                      gate: torch.Tensor | None, sin: torch.Tensor | None, cos: torch.Tensor | None,
                      state: torch.Tensor, eps: float, raw: bool, key_padding_mask: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients of q, k, v and the two temperatures, then, with a gate, those of the local branch (where
    given) and of the gate (without one, the caller takes the local branch's from the output's)."""
    call = _Call(q, k, v, temp_same, temp_opposite, sin, key_padding_mask, cu_seqlens, cu_seqlens_k, raw, local,
                 gate)
    grads = pacs_backward(call, q, k, v, sin, cos, state, eps, grad_out, (temp_same.shape, temp_opposite.shape),
                          traced=True)
    # an operator's outputs own their memory (the two temperatures' gradients are views of one buffer)
    present = [*grads[:3], grads[3].to(temp_same.dtype, copy=True), grads[4].to(temp_opposite.dtype, copy=True)]
    if gate is not None:
        present += [grad for grad in grads[5:] if grad is not None]
    return present


def _pacs_op_setup(ctx, inputs, output):
    (q, k, v, temp_same, temp_opposite, local, gate, sin, cos, eps, raw, key_padding_mask, cu_seqlens, cu_seqlens_k,
     _) = inputs
    ctx.save_for_backward(q, k, v, temp_same, temp_opposite, local, gate, sin, cos, output[1], key_padding_mask,
                          cu_seqlens, cu_seqlens_k)
    ctx.eps, ctx.raw = eps, raw


def _pacs_op_backward(ctx, grad_out, _grad_state):
    (q, k, v, temp_same, temp_opposite, local, gate, sin, cos, state, key_padding_mask, cu_seqlens,
     cu_seqlens_k) = ctx.saved_tensors
    present = iter(_pacs_backward_op(grad_out, q, k, v, temp_same, temp_opposite, local, gate, sin, cos, state,
                                     ctx.eps, ctx.raw, key_padding_mask, cu_seqlens, cu_seqlens_k))
    grads = [next(present) for _ in range(5)]
    grad_local = grad_gate = None
    if gate is not None:
        grad_local = None if local is None else next(present)
        grad_gate = next(present)
    elif local is not None:
        grad_local = grad_out[:, :, q.shape[2] - local.shape[-2]:]
    grads += [grad_local, grad_gate]
    return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)),
            None, None, None, None, None, None, None, None)


_pacs_op.register_autograd(_pacs_op_backward, setup_context=_pacs_op_setup)


def pacs_attention(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask=None, cu_seqlens=None,
                   cu_seqlens_k=None, *, raw=False, local=None, gate=None):
    """:func:`polaformer.ops.pacs_linear_attention` (and, with the raw temperature weights, ``raw``, of
    :func:`polaformer.ops.pacs_layer_attention`) on the Triton kernels, for arguments the op has checked:
    (B, H, N, d) queries, (B, H, M, d) keys, (B, H, M, dv) values, or packed (1, H, T, ·) with ``cu_seqlens``
    (``cu_seqlens_k`` for the keys, default ``cu_seqlens``); RoPE tables (N or T, 2d); the output
    ``(attention + local) · gate`` where those are given. Any strides; output in v's dtype."""
    if sin is not None and sin.stride() != cos.stride():
        sin, cos = sin.contiguous(), cos.contiguous()
    tensors = (q, k, v, temp_same, temp_opposite, local, gate)
    options = (sin, cos, eps, raw, key_padding_mask, cu_seqlens, cu_seqlens_k)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if torch.compiler.is_compiling():
        return _pacs_op(*tensors, *options, needs_grad)[0]
    if needs_grad:
        return PacsAttention.apply(*tensors, *options)
    return pacs_forward(q, k, v, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, cu_seqlens, cu_seqlens_k,
                        save_state=False, raw=raw, local=local, gate=gate)[0]
