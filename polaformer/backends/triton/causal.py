"""Triton kernels of the causal chunked numerator (:mod:`polaformer.ops.causal`, every stream of the causal
Pola, PaCS and single-stream ops).

For numerator features ``q``, ``k`` (B, H, N, F), values ``v`` (B, H, N, dv) and an initial state ``S₀``
(B, H, F, dv) the kernels compute, per (batch, head),

    o_t = q_t·S₀ + Σ_{s≤t} (q_t·k_s) v_s          and the final state  S₀ + Σ_s k_sᵀ v_s

in chunks of C tokens: with ``S_c`` the state entering chunk ``c``, the chunk's output is
``q S_c + tril(q kᵀ) v``. The normaliser is a prefix sum and stays in torch (ops/causal.py).

Kernels:

- ``_states_kernel`` (grid: (B·H, F blocks, dv blocks)) walks the chunks in order, writing each ``S_c`` (kept
  for the backward pass) and the final state.
- ``_output_kernel`` (grid: (chunks, B·H)): one chunk's output from ``S_c``.
- ``_state_grads_kernel`` (grid as the states kernel) walks the chunks backwards: the gradient of the state
  leaving chunk ``c``, ``dS_{c+1} = dS_final + Σ_{chunks after c} qᵀ dO``, and the initial state's gradient.
- ``_input_grads_kernel`` (grid: (chunks, B·H)), per chunk, with ``A = tril(q kᵀ)`` and ``dA = tril(dO vᵀ)``::

      dq = dO S_cᵀ + dA k        dk = v dS_{c+1}ᵀ + dAᵀ q        dv = k dS_{c+1} + Aᵀ dO

Products and states are fp32 (fp64 for fp64 inputs); rows past the sequence's end load as zeros, channels
are padded to powers of two and masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import accumulator_dtype, padded_width

__all__ = ["CausalNumerator", "causal_numerator", "kernel_chunk"]

_LARGEST_CHUNK = 64  # with larger chunks the backward kernel outgrows a Hopper block's shared memory
_CHUNK_WARPS = 8  # the per-chunk kernels hold (C × C) scores and several (C × 32) tiles at once


def kernel_chunk(chunk_size: int) -> int:
    """The kernels' tokens per chunk for the op's ``chunk_size``: rounded up to a power of two, at least 16
    (``tl.dot``'s smallest operand) and at most 64. The results do not depend on it beyond rounding."""
    return min(_LARGEST_CHUNK, max(16, triton.next_power_of_2(chunk_size)))


@triton.jit
def _tile(base, rows, cols, stride_row, stride_col, rows_valid, cols_valid, dtype: tl.constexpr):
    """A (rows × cols) tile, zero outside the valid rows and columns."""
    return tl.load(base + rows[:, None] * stride_row + cols[None, :] * stride_col,
                   mask=rows_valid[:, None] & cols_valid[None, :], other=0.0).to(dtype)


@triton.jit
def _states_kernel(
    k_ptr, v_ptr, initial_ptr, states_ptr, final_ptr,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_ib, stride_ih, stride_if, stride_iv,
    HEADS, LENGTH, F, DV, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The state entering every chunk of one (batch, head), one (F block × dv block) tile of it, and the final
    state. Grid: (B·H, F blocks, dv blocks)."""
    bh = tl.program_id(0)
    batch, head = bh // HEADS, bh % HEADS
    acc_t = states_ptr.dtype.element_ty
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    state = _tile(initial_ptr + batch.to(tl.int64) * stride_ib + head * stride_ih, f, j, stride_if, stride_iv,
                  f < F, j < DV, acc_t)
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + head * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + head * stride_vh
    states_base = states_ptr + bh.to(tl.int64) * CHUNKS * FP * DVP + f[:, None] * DVP + j[None, :]
    for chunk in range(CHUNKS):
        tl.store(states_base + chunk * FP * DVP, state)
        t = chunk * CHUNK + tl.arange(0, CHUNK)
        rows = t.to(tl.int64)
        keys = _tile(k_base, rows, f, stride_kt, stride_kc, t < LENGTH, f < F, acc_t)
        values = _tile(v_base, rows, j, stride_vt, stride_vc, t < LENGTH, j < DV, acc_t)
        state += tl.dot(tl.trans(keys), values, input_precision=PRECISION, out_dtype=acc_t)
    tl.store(final_ptr + bh.to(tl.int64) * F * DV + f[:, None] * DV + j[None, :], state,
             mask=(f < F)[:, None] & (j < DV)[None, :])


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, v_ptr, states_ptr, out_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    HEADS, LENGTH, F, DV, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BLOCK_F: tl.constexpr, PRECISION: tl.constexpr,
):
    """``q S_c + tril(q kᵀ) v`` of one chunk of one (batch, head), the features taken ``BLOCK_F`` channels at a
    time; ``out`` is contiguous. Grid: (chunks, B·H)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    batch, head = bh // HEADS, bh % HEADS
    acc_t = states_ptr.dtype.element_ty
    j = tl.arange(0, DVP)
    t = chunk * CHUNK + tl.arange(0, CHUNK)
    rows, valid = t.to(tl.int64), t < LENGTH
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + head * stride_kh
    state_base = states_ptr + (bh.to(tl.int64) * CHUNKS + chunk) * FP * DVP
    scores = tl.zeros([CHUNK, CHUNK], dtype=acc_t)
    out = tl.zeros([CHUNK, DVP], dtype=acc_t)
    for f0 in range(0, FP, BLOCK_F):
        c = f0 + tl.arange(0, BLOCK_F)
        queries = _tile(q_base, rows, c, stride_qt, stride_qc, valid, c < F, acc_t)
        keys = _tile(k_base, rows, c, stride_kt, stride_kc, valid, c < F, acc_t)
        state = tl.load(state_base + c[:, None] * DVP + j[None, :])
        scores += tl.dot(queries, tl.trans(keys), input_precision=PRECISION, out_dtype=acc_t)
        out += tl.dot(queries, state, input_precision=PRECISION, out_dtype=acc_t)
    values = _tile(v_ptr + batch.to(tl.int64) * stride_vb + head * stride_vh, rows, j, stride_vt, stride_vc,
                   valid, j < DV, acc_t)
    scores = tl.where(t[:, None] >= t[None, :], scores, 0.0)
    out += tl.dot(scores, values, input_precision=PRECISION, out_dtype=acc_t)
    tl.store(out_ptr + bh.to(tl.int64) * LENGTH * DV + rows[:, None] * DV + j[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (j < DV)[None, :])


@triton.jit
def _state_grads_kernel(
    q_ptr, grad_out_ptr, grad_final_ptr, grad_states_ptr, grad_initial_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_gb, stride_gh, stride_gt, stride_gc,
    HEADS, LENGTH, F, DV, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, PRECISION: tl.constexpr,
):
    """The gradient of the state leaving every chunk (one tile of it), walking the chunks backwards, and the
    initial state's gradient. ``grad_final`` is contiguous (B, H, F, dv). Grid: (B·H, F blocks, dv blocks)."""
    bh = tl.program_id(0)
    batch, head = bh // HEADS, bh % HEADS
    acc_t = grad_states_ptr.dtype.element_ty
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = (f < F)[:, None] & (j < DV)[None, :]
    cell = bh.to(tl.int64) * F * DV + f[:, None] * DV + j[None, :]
    if HAS_FINAL_GRAD:
        grad = tl.load(grad_final_ptr + cell, mask=inside, other=0.0).to(acc_t)
    else:
        grad = tl.zeros([BLOCK_F, BLOCK_V], dtype=acc_t)
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
    g_base = grad_out_ptr + batch.to(tl.int64) * stride_gb + head * stride_gh
    states_base = grad_states_ptr + bh.to(tl.int64) * CHUNKS * FP * DVP + f[:, None] * DVP + j[None, :]
    for step in range(CHUNKS):
        chunk = CHUNKS - 1 - step
        tl.store(states_base + chunk * FP * DVP, grad)
        t = chunk * CHUNK + tl.arange(0, CHUNK)
        rows = t.to(tl.int64)
        queries = _tile(q_base, rows, f, stride_qt, stride_qc, t < LENGTH, f < F, acc_t)
        grad_out = _tile(g_base, rows, j, stride_gt, stride_gc, t < LENGTH, j < DV, acc_t)
        grad += tl.dot(tl.trans(queries), grad_out, input_precision=PRECISION, out_dtype=acc_t)
    tl.store(grad_initial_ptr + cell, grad, mask=inside)


@triton.jit
def _input_grads_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, states_ptr, grad_states_ptr, grad_q_ptr, grad_k_ptr, grad_v_ptr,
    stride_qb, stride_qh, stride_qt, stride_qc,
    stride_kb, stride_kh, stride_kt, stride_kc,
    stride_vb, stride_vh, stride_vt, stride_vc,
    stride_gb, stride_gh, stride_gt, stride_gc,
    HEADS, LENGTH, F, DV, CHUNKS,
    CHUNK: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BLOCK_F: tl.constexpr, PRECISION: tl.constexpr,
):
    """``grad_q``, ``grad_k`` and ``grad_v`` of one chunk of one (batch, head) from the states entering and
    the gradients leaving it, the features taken ``BLOCK_F`` channels at a time: a first pass gathers
    ``q kᵀ`` and ``grad_v``, a second writes ``grad_q`` and ``grad_k``. The gradient buffers are contiguous.
    Grid: (chunks, B·H)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    batch, head = bh // HEADS, bh % HEADS
    acc_t = states_ptr.dtype.element_ty
    j = tl.arange(0, DVP)
    t = chunk * CHUNK + tl.arange(0, CHUNK)
    rows, valid = t.to(tl.int64), t < LENGTH
    seen = t[:, None] >= t[None, :]
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + head * stride_kh
    values = _tile(v_ptr + batch.to(tl.int64) * stride_vb + head * stride_vh, rows, j, stride_vt, stride_vc,
                   valid, j < DV, acc_t)
    grad_out = _tile(grad_out_ptr + batch.to(tl.int64) * stride_gb + head * stride_gh, rows, j, stride_gt,
                     stride_gc, valid, j < DV, acc_t)
    state_offset = (bh.to(tl.int64) * CHUNKS + chunk) * FP * DVP
    scores = tl.zeros([CHUNK, CHUNK], dtype=acc_t)
    grad_v = tl.zeros([CHUNK, DVP], dtype=acc_t)
    for f0 in range(0, FP, BLOCK_F):
        c = f0 + tl.arange(0, BLOCK_F)
        queries = _tile(q_base, rows, c, stride_qt, stride_qc, valid, c < F, acc_t)
        keys = _tile(k_base, rows, c, stride_kt, stride_kc, valid, c < F, acc_t)
        grad_state = tl.load(grad_states_ptr + state_offset + c[:, None] * DVP + j[None, :])
        scores += tl.dot(queries, tl.trans(keys), input_precision=PRECISION, out_dtype=acc_t)
        grad_v += tl.dot(keys, grad_state, input_precision=PRECISION, out_dtype=acc_t)
    scores = tl.where(seen, scores, 0.0)
    grad_v += tl.dot(tl.trans(scores), grad_out, input_precision=PRECISION, out_dtype=acc_t)
    tl.store(grad_v_ptr + bh.to(tl.int64) * LENGTH * DV + rows[:, None] * DV + j[None, :],
             grad_v.to(grad_v_ptr.dtype.element_ty), mask=valid[:, None] & (j < DV)[None, :])
    grad_scores = tl.where(seen, tl.dot(grad_out, tl.trans(values), input_precision=PRECISION, out_dtype=acc_t),
                           0.0)
    feature_base = bh.to(tl.int64) * LENGTH * F + rows[:, None] * F
    for f0 in range(0, FP, BLOCK_F):
        c = f0 + tl.arange(0, BLOCK_F)
        queries = _tile(q_base, rows, c, stride_qt, stride_qc, valid, c < F, acc_t)
        keys = _tile(k_base, rows, c, stride_kt, stride_kc, valid, c < F, acc_t)
        state = tl.load(states_ptr + state_offset + c[:, None] * DVP + j[None, :])
        grad_state = tl.load(grad_states_ptr + state_offset + c[:, None] * DVP + j[None, :])
        grad_q = tl.dot(grad_out, tl.trans(state), input_precision=PRECISION, out_dtype=acc_t)
        grad_q += tl.dot(grad_scores, keys, input_precision=PRECISION, out_dtype=acc_t)
        grad_k = tl.dot(values, tl.trans(grad_state), input_precision=PRECISION, out_dtype=acc_t)
        grad_k += tl.dot(tl.trans(grad_scores), queries, input_precision=PRECISION, out_dtype=acc_t)
        feature_rows = valid[:, None] & (c < F)[None, :]
        tl.store(grad_q_ptr + feature_base + c[None, :], grad_q.to(grad_q_ptr.dtype.element_ty), mask=feature_rows)
        tl.store(grad_k_ptr + feature_base + c[None, :], grad_k.to(grad_k_ptr.dtype.element_ty), mask=feature_rows)


def _strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


class _Launch:
    """Sizes, paddings, grids and precision shared by one call's forward and backward kernels."""

    def __init__(self, q, k, v, chunk_size: int, half_precision_inputs: bool):
        self.batch, self.heads, self.length, self.features = q.shape
        self.dv = v.shape[-1]
        self.fp, self.dvp = padded_width(self.features), padded_width(self.dv)
        self.chunk = kernel_chunk(chunk_size)
        self.chunks = triton.cdiv(max(self.length, 1), self.chunk)
        self.acc = accumulator_dtype(q, k, v)
        self.precision = "tf32" if half_precision_inputs and self.acc == torch.float32 else "ieee"
        # The state tiles: smaller on a GPU, so that more programs share the sequential walk over the chunks;
        # 16 under the interpreter, whose small test widths then span several tiles.
        tile = 32 if q.is_cuda else 16
        self.block_f, self.block_v = min(self.fp, tile), min(self.dvp, tile)
        self.walk_grid = (self.batch * self.heads, self.fp // self.block_f, self.dvp // self.block_v)
        self.chunk_grid = (self.chunks, self.batch * self.heads)
        self.sizes = dict(HEADS=self.heads, LENGTH=self.length, F=self.features, DV=self.dv, CHUNKS=self.chunks,
                          CHUNK=self.chunk, FP=self.fp, DVP=self.dvp, PRECISION=self.precision)

    def new_states(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_empty(self.batch, self.heads, self.chunks, self.fp, self.dvp, dtype=self.acc)

    def forward(self, q, k, v, initial):
        states = self.new_states(q)
        final = q.new_empty(self.batch, self.heads, self.features, self.dv, dtype=self.acc)
        _states_kernel[self.walk_grid](
            k, v, initial, states, final, *_strides(k), *_strides(v), *_strides(initial),
            BLOCK_F=self.block_f, BLOCK_V=self.block_v, **self.sizes,
        )
        out = q.new_empty(self.batch, self.heads, self.length, self.dv, dtype=self.acc)
        _output_kernel[self.chunk_grid](q, k, v, states, out, *_strides(q), *_strides(k), *_strides(v),
                                        BLOCK_F=self.block_f, num_warps=_CHUNK_WARPS, **self.sizes)
        return out, final, states

    def backward(self, q, k, v, states, grad_out, grad_final):
        grad_states = self.new_states(q)
        grad_initial = q.new_empty(self.batch, self.heads, self.features, self.dv, dtype=self.acc)
        has_final_grad = grad_final is not None
        _state_grads_kernel[self.walk_grid](
            q, grad_out, grad_final.contiguous() if has_final_grad else grad_initial, grad_states, grad_initial,
            *_strides(q), *_strides(grad_out), BLOCK_F=self.block_f, BLOCK_V=self.block_v,
            HAS_FINAL_GRAD=has_final_grad, **self.sizes,
        )
        grad_q = q.new_empty(q.shape, dtype=self.acc)
        grad_k = q.new_empty(k.shape, dtype=self.acc)
        grad_v = q.new_empty(v.shape, dtype=self.acc)
        _input_grads_kernel[self.chunk_grid](
            q, k, v, grad_out, states, grad_states, grad_q, grad_k, grad_v,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), BLOCK_F=self.block_f,
            num_warps=_CHUNK_WARPS, **self.sizes,
        )
        return grad_q, grad_k, grad_v, grad_initial


class CausalNumerator(torch.autograd.Function):
    """The chunked numerator with its backward kernels: gradients of q, k, v and the initial state, from the
    output's gradient and the final state's."""

    @staticmethod
    def forward(ctx, q, k, v, initial, chunk_size, half_precision_inputs):
        launch = _Launch(q, k, v, chunk_size, half_precision_inputs)
        out, final, states = launch.forward(q, k, v, initial)
        ctx.save_for_backward(q, k, v, states)
        ctx.launch = launch
        ctx.set_materialize_grads(False)
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        q, k, v, states = ctx.saved_tensors
        if grad_out is None:
            grad_out = q.new_zeros(ctx.launch.batch, ctx.launch.heads, ctx.launch.length, ctx.launch.dv)
        grads = ctx.launch.backward(q, k, v, states, grad_out, grad_final)
        return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)), None, None)


def causal_numerator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor,
                     chunk_size: int = 64, half_precision_inputs: bool = False):
    """``(o, S)``: ``o_t = q_t·S₀ + Σ_{s≤t} (q_t·k_s) v_s`` (B, H, N, dv) and the final state
    ``S = S₀ + Σ kᵀv`` (B, H, F, dv), both in the accumulator dtype (float32, float64 for float64 inputs), for
    q, k (B, H, N, F), v (B, H, N, dv) and ``initial_state`` S₀ (B, H, F, dv), any strides.

    ``chunk_size`` is rounded as :func:`kernel_chunk` says; ``half_precision_inputs`` (the op's inputs were
    fp16/bf16) lets float32 products use TF32 tensor cores. Gradients reach all four tensors.
    """
    b, h, n, f = q.shape
    expected = {"k": (b, h, n, f), "v": (b, h, n, v.shape[-1]), "initial_state": (b, h, f, v.shape[-1])}
    for name, t in (("k", k), ("v", v), ("initial_state", initial_state)):
        if t.dim() != 4 or tuple(t.shape) != expected[name]:
            raise ValueError(f"causal_numerator: {name} must be {expected[name]} for q{tuple(q.shape)}, "
                             f"got {tuple(t.shape)}")
    return CausalNumerator.apply(q, k, v, initial_state, chunk_size, half_precision_inputs)
