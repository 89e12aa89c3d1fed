"""What the Triton kernels share: padded widths, the accumulation dtype and product precision of a call, and the
launch plan (how a call's work is spread over programs, from its shapes alone, nothing read from the device).

The kernels are compiled once per head width and option set: sequence lengths are runtime arguments they are not
specialised on (``do_not_specialize``), so a new length compiles nothing."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["FUSED_TOKENS", "Dots", "Plan", "accumulator_dtype", "dot", "dots", "padded_width", "plan", "pola_tile",
           "program", "sequence_tokens", "share", "sigmoid", "softplus", "traceable", "unpadded_keys", "warps"]


def padded_width(n: int) -> int:
    """``n`` channels padded to a power of two of at least 16 (``tl.dot``'s smallest operand); the extra
    channels are masked to zero inside the kernels."""
    return max(16, triton.next_power_of_2(n))


def accumulator_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (gradcheck), else float32: half-precision inputs accumulate in fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass(frozen=True)
class Dots:
    """How a call's ``tl.dot`` products are formed (compile-time switches of the kernels).

    ``operands``: the dtype the operands of the bounded products are rounded to (features are at most 1 in the
    log domain, states at most the largest value); ``grad_operands``: the same for products of gradients, which
    have no such bound; ``precision``: ``input_precision`` of the products whose operands are fp32."""

    operands: tl.dtype
    grad_operands: tl.dtype
    precision: str

    def constants(self) -> dict:
        return dict(DOT=self.operands, GRAD_DOT=self.grad_operands, PRECISION=self.precision)


def dots(*tensors: torch.Tensor, bounded: bool = True) -> Dots:
    """The products of a call on ``tensors`` (q, k, v), as torch's own matmuls would form them.

    All bf16: every product on bf16 operands (the tensor cores' fastest; bf16 has fp32's range). All fp16:
    fp16 operands where they are bounded (``bounded=False``: nowhere), TF32 for the gradients', which could
    leave fp16's range. fp32 follows ``torch.get_float32_matmul_precision()``: ``"highest"`` (torch's default)
    exact fp32 products (``ieee``), ``"high"``/``"medium"`` TF32; mixed half dtypes TF32 (its 10-bit mantissa
    holds both); fp64 exact. Products always accumulate in the accumulator dtype (fp32, or fp64)."""
    kinds = {t.dtype for t in tensors}
    if kinds == {torch.bfloat16}:
        return Dots(tl.bfloat16, tl.bfloat16, "tf32")
    if kinds == {torch.float16}:
        return Dots(tl.float16 if bounded else tl.float32, tl.float32, "tf32")
    if torch.float64 in kinds:
        return Dots(tl.float64, tl.float64, "ieee")
    if kinds <= {torch.float16, torch.bfloat16} or torch.get_float32_matmul_precision() != "highest":
        return Dots(tl.float32, tl.float32, "tf32")
    return Dots(tl.float32, tl.float32, "ieee")


# Triton's interpreter multiplies bf16 operands as raw 16-bit integers and truncates fp32 to bf16: under it the
# kernels round the operands to nearest bf16 themselves (as the GPU's conversion does) and multiply in fp32.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept in fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """``a·b`` accumulated in ``ACC``, the operands rounded to ``DOT`` first (see :func:`dots`)."""
    if _INTERPRETED and DOT == tl.bfloat16:
        return tl.dot(_round_to_bf16(a.to(tl.float32)), _round_to_bf16(b.to(tl.float32)), out_dtype=ACC)
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PRECISION, out_dtype=ACC)


class _Interpreted(JITFunction):
    """A kernel of Triton's interpreter as ``wrap_triton`` traces a compiled one (it leaves interpreted kernels
    untraceable): the JIT's view of the same function, launched in the interpreter."""

    def __init__(self, interpreted):
        super().__init__(interpreted.fn)
        self.interpreted = interpreted

    def run(self, *args, grid, warmup, **kwargs):
        return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    # by identity: the JIT's hash walks the helpers it calls, which are interpreted functions here
    __hash__ = object.__hash__


@functools.lru_cache(maxsize=None)
def _jit_view(kernel):
    return _Interpreted(kernel) if isinstance(kernel, InterpretedFunction) else kernel


def traceable(kernel):
    """``kernel`` as the body of a ``torch.library.triton_op`` launches it: through ``wrap_triton``, so that
    torch.compile records the launch itself in its graph (inductor sees it, plans its buffers and fuses around
    it). Under the interpreter the same tracing runs, with CPU tensors (``_Interpreted``)."""
    return wrap_triton(_jit_view(kernel))


# A sequence's forward stays in one launch (each program building the key state itself) while a program walks at
# most this many tokens; longer sequences with too few (sequence, head) pairs to fill the GPU split the keys over a
# state launch and a partial-sum buffer.
FUSED_TOKENS = 8192
# The backward of a (sequence, head) pair is one program while the pairs fill the GPU or a pair walks fewer than
# this many tokens (queries and keys); past it, with too few pairs, it splits into token blocks: a query-side launch
# (gradients of the queries, partial gradients of the state per span of blocks) and a key-side launch (the partials
# added in span order, then the keys' and values' gradients, per span of key blocks). On an H200 (docs/gpu.md) the
# split measured 1.56x faster at 3,185 tokens and 64 pairs (Pola-PVT stage 1, batch 64) and 0.83x at 833 tokens and
# 128 pairs (stage 2): a tunable, until a card measures where between the two it starts to pay.
BACKWARD_SPLIT_TOKENS = 2048
# A forward program may rebuild the whole key state for as few as a quarter as many queries: more programs,
# at most four times the key work.
REBUILDS = 4
# Most programs one sequence's keys (or its queries' gradient sums) are split over: beyond it the partial
# sums cost more to merge than the split gains.
MAX_SPLITS = 16


@functools.lru_cache(maxsize=None)
def target_programs(device: torch.device) -> int:
    """Programs that fill the device: two per multiprocessor on a GPU; an H100's count (132) elsewhere, so that
    the interpreter plans a call as that GPU would."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2 * 132


@dataclass(frozen=True)
class Plan:
    """How one call's work is spread over programs (grid ``(programs per sequence, heads, sequences)``).

    ``query_spans``: forward programs per sequence, each over its share of the query blocks; ``key_splits``:
    0 when each of them builds the whole key state itself (one launch), else the programs per sequence of a
    separate key-state launch whose partial states the query programs merge. ``backward_spans``: 1 when one
    program per sequence does the whole backward (one launch), else the programs of the query-side pass,
    followed by ``backward_key_splits`` programs of a key-side pass (``BACKWARD_SPLIT_TOKENS``)."""

    block: int
    query_spans: int
    key_splits: int
    backward_spans: int
    backward_key_splits: int


def plan(sequences: int, heads: int, query_tokens: int, key_tokens: int, block: int, device) -> Plan:
    """The :class:`Plan` for ``sequences`` × ``heads`` pairs of ``query_tokens`` queries and ``key_tokens`` keys
    each (the mean per sequence for packed batches)."""
    pairs = max(sequences * heads, 1)
    target = target_programs(torch.device(device))
    wanted = max(1, -(-target // pairs))
    query_blocks = max(1, -(-query_tokens // block))
    key_blocks = max(1, -(-key_tokens // block))
    spans = max(1, min(wanted, query_blocks, REBUILDS * query_tokens // max(key_tokens, 1)))
    if pairs * spans >= target or key_tokens + -(-query_tokens // spans) <= FUSED_TOKENS:
        forward = (spans, 0)
    else:
        forward = (min(wanted, query_blocks, MAX_SPLITS), min(wanted, key_blocks, MAX_SPLITS))
    if pairs >= target or query_tokens + key_tokens < BACKWARD_SPLIT_TOKENS:
        backward = (1, 0)
    else:
        backward = (min(wanted, query_blocks, MAX_SPLITS), min(wanted, key_blocks, MAX_SPLITS))
    return Plan(block, *forward, *backward)


def warps(rows: int, columns: int) -> int:
    """Warps per program: eight for states of 32 × 32 and more, which spill registers with four (ptxas on
    sm_90, ``scripts/triton_compile_check.py``)."""
    return 8 if rows * columns >= 32 * 32 else 4


def pola_tile(rows: int, columns: int, on_gpu: bool) -> tuple[int, int]:
    """(tokens per block, warps) of the Pola kernels for a ``rows × columns`` state. Narrow heads (states of at
    most 32 × 32) take 64-token blocks with four warps: a sweep on an H200 at the models' shapes measured them
    fastest, forward and backward (docs/gpu.md, "Tiles"). Wider heads keep 32 tokens and :func:`warps`. The
    interpreter takes 16 tokens, so that the tests' small shapes cover several blocks."""
    if not on_gpu:
        return 16, warps(rows, columns)
    if rows * columns <= 32 * 32:
        return 64, 4
    return 32, warps(rows, columns)


@triton.jit
def program():
    """``(part, head, sequence, heads)`` of a program on a grid ``(parts per sequence, heads, sequences)``; head
    and sequence in 64 bits, so that every offset built from them is."""
    return tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64), tl.num_programs(1)


@triton.jit
def sequence_tokens(seq, cu_ptr, length, PACKED: tl.constexpr):
    """(batch index, first token, end token) of sequence ``seq``: a packed sequence's rows come from the
    offsets (read on the device), a dense one is a batch entry of ``length`` tokens."""
    if PACKED:
        return seq * 0, tl.load(cu_ptr + seq).to(tl.int64), tl.load(cu_ptr + seq + 1).to(tl.int64)
    else:
        return seq, tl.zeros((), tl.int64), tl.zeros((), tl.int64) + length


@triton.jit
def unpadded_keys(mask_base, t, valid, stride_mt, HAS_MASK: tl.constexpr):
    """Which of tokens ``t`` (``valid``: inside the sequence) are keys: those the padding mask row at
    ``mask_base`` does not mark, where there is one."""
    keep = valid
    if HAS_MASK:
        keep = keep & (tl.load(mask_base + t * stride_mt, mask=valid, other=1) == 0)
    return keep


@triton.jit
def share(first, end, part, parts, BLOCK: tl.constexpr):
    """Token range of ``part`` of ``parts``: whole blocks of ``[first, end)``, the same count each."""
    per = tl.cdiv(tl.cdiv(end - first, BLOCK), parts) * BLOCK
    lo = first + part * per
    return lo, tl.minimum(lo + per, end)


# Below this |x| exp(x) − 1 is its Taylor series: exp(x) − 1 would cancel, and the tricks that repair the
# cancellation (Kahan's (u − 1)·x / log u) need a log accurate near 1, which a GPU's approximate log is not.
_EXPM1_SERIES_BOUND = tl.constexpr(0.25)
_EXPM1_TERMS = tl.constexpr(13)  # x¹³/13! < 3e-17·|x| below the bound: float64's precision


@triton.jit
def expm1(x):
    """``exp(x) − 1`` to the input's precision for every x: the series near 0 (Horner), ``exp(x) − 1`` elsewhere
    (where nothing cancels, and exp may be 0 or infinite)."""
    near = tl.abs(x) < _EXPM1_SERIES_BOUND
    small = tl.where(near, x, 0.0)
    series = small * 0.0 + 1.0
    for n in tl.static_range(_EXPM1_TERMS, 1, -1):
        series = 1.0 + small / n * series
    return tl.where(near, small * series, tl.exp(x) - 1.0)


@triton.jit
def sigmoid(x):
    """``1 / (1 + e^-x)``, exact at both ends (``e^-x`` may be 0 or infinite)."""
    return 1.0 / (1.0 + tl.exp(-x))


_ATANH_TERMS = tl.constexpr(17)  # s¹⁹/19 < 4e-19 at s = 1/9: float64's precision


@triton.jit
def softplus(x):
    """``log(1 + e^x)`` (torch's ``softplus``) to the input's precision for every x: ``max(x, 0) + log1p(e^-|x|)``,
    where ``log1p(y) = 2·atanh(y / (2 + y))`` by its series below y = 1/4 (a GPU's log is approximate near 1;
    there ``s = y / (2 + y)`` is at most 1/9), ``log(1 + y)`` above."""
    y = tl.exp(-tl.abs(x))
    s = y / (2.0 + y)
    s2 = s * s
    series = s2 * 0.0 + 1.0 / _ATANH_TERMS
    for n in tl.static_range(_ATANH_TERMS - 2, 0, -2):
        series = 1.0 / n + s2 * series
    return tl.maximum(x, 0.0) + tl.where(y < 0.25, 2.0 * s * series, tl.log(1.0 + y))
