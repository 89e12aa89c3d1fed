"""Launch helpers shared by the Triton attention kernels: work items over (packed) sequences, the
deterministic second-step reduction, block sizes and precisions, and the in-register helpers.

Work items. Every kernel runs on a grid ``(items, heads)``. An item is one chunk of one sequence: ``chunk``
consecutive tokens (a whole number of token blocks). A dense batch (B, H, L, ·) is B sequences of length L;
a packed batch (1, H, T, ·) with offsets ``cu_seqlens`` is S sequences of their own lengths. The item table
(``item_seq``, ``item_first``) is built on the device, so nothing here waits for the GPU: a packed batch
launches an upper bound of ``cdiv(T, chunk) + S`` items and the items past a sequence's end do nothing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "Items",
    "accumulator_dtype",
    "dot_precision",
    "items_for",
    "padded_width",
    "sum_item_partials",
    "token_block",
]

# Items per sequence the state and gradient reductions aim for when there are few (sequence, head) pairs:
# enough programs to fill a large GPU, few enough that the second step stays small.
_TARGET_PROGRAMS = 256


def padded_width(n: int) -> int:
    """``n`` channels padded to a power of two of at least 16 (``tl.dot``'s smallest operand); the extra
    channels are masked to zero inside the kernels."""
    return max(16, triton.next_power_of_2(n))


def token_block(x: torch.Tensor) -> int:
    """Tokens per block: 64 on a GPU; 16 under the interpreter, whose small test shapes then cover several
    blocks, partial blocks and several chunks per sequence."""
    return 64 if x.is_cuda else 16


def accumulator_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (gradcheck), else float32: half-precision inputs accumulate in fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def dot_precision(*tensors: torch.Tensor) -> str:
    """``tl.dot``'s input precision. Half-precision inputs: TF32 (its 10-bit mantissa holds theirs, and the
    tensor cores run it). fp32 inputs follow ``torch.get_float32_matmul_precision()``, as torch's own matmuls
    do: ``"highest"`` (torch's default) exact fp32 products, ``"high"``/``"medium"`` TF32. fp64: exact."""
    if all(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        return "tf32"
    if any(t.dtype == torch.float64 for t in tensors) or torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


# A sequence's work stays in one launch (each forward program building the key state itself, one backward
# program per sequence and head) while a program walks at most this many tokens; longer sequences with too few
# (sequence, head) pairs to fill the GPU split the keys over one more launch per pass and a partial-sum buffer.
FUSED_TOKENS = 8192
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
    followed by ``backward_key_splits`` programs of a key-side pass."""

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
    if pairs >= target or query_tokens + key_tokens <= FUSED_TOKENS:
        backward = (1, 0)
    else:
        backward = (min(wanted, query_blocks, MAX_SPLITS), min(wanted, key_blocks, MAX_SPLITS))
    return Plan(block, *forward, *backward)


# The kernels are compiled once per head width and option set: sequence lengths are plain runtime arguments
# (``do_not_specialize``), so a new length compiles nothing.


def warps(dp: int, dvp: int) -> int:
    """Warps per program: more for wide states, which would otherwise spill registers."""
    return 8 if dp * dvp >= 64 * 64 else 4


def triton_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@dataclass(frozen=True)
class Items:
    """The work items of one launch (see the module docstring)."""

    count: int  # items launched (an upper bound for packed batches)
    chunk: int  # tokens per item
    item_seq: torch.Tensor  # (count,) int32: the sequence of each item
    item_first: torch.Tensor  # (S + 1,) int32: the first item of each sequence, and the total


def items_for(sequences: int, length: int, chunk: int, device, cu_seqlens: torch.Tensor | None = None) -> Items:
    """Items of ``chunk`` tokens over ``sequences`` dense sequences of ``length`` tokens, or over the packed
    sequences of ``cu_seqlens`` (then ``length`` is the packed total)."""
    if cu_seqlens is None:
        per_sequence = triton.cdiv(max(length, 1), chunk)
        first = torch.arange(sequences + 1, device=device, dtype=torch.int32) * per_sequence
        seq = torch.arange(sequences * per_sequence, device=device, dtype=torch.int32) // per_sequence
        return Items(sequences * per_sequence, chunk, seq, first)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    per_sequence = (lengths + chunk - 1) // chunk
    first = torch.zeros(sequences + 1, device=device, dtype=torch.int64)
    torch.cumsum(per_sequence, 0, out=first[1:])
    count = triton.cdiv(length, chunk) + sequences
    item = torch.arange(count, device=device, dtype=torch.int64)
    seq = torch.searchsorted(first[1:], item, right=True).clamp_max_(sequences - 1)
    return Items(count, chunk, seq.to(torch.int32), first.to(torch.int32))


def reduction_chunk(sequences: int, heads: int, length: int, block: int) -> int:
    """Tokens per item for a reduction over a sequence (the state, the query-side gradients): one item per
    sequence when the (sequence, head) pairs fill the GPU, else split so that about ``_TARGET_PROGRAMS`` run."""
    splits = max(1, triton.cdiv(_TARGET_PROGRAMS, max(sequences * heads, 1)))
    per_item = triton.cdiv(max(triton.cdiv(length, max(sequences, 1)), 1), splits)
    return triton.cdiv(per_item, block) * block


@triton.jit
def locate_item(item, item_seq_ptr, item_first_ptr, cu_ptr, LENGTH, CHUNK: tl.constexpr, PACKED: tl.constexpr):
    """(sequence, batch index, first token of the sequence, its length, first token of the item's chunk,
    relative to the sequence) of work item ``item``."""
    seq = tl.load(item_seq_ptr + item)
    chunk_start = (item - tl.load(item_first_ptr + seq)) * CHUNK
    if PACKED:
        batch = seq * 0
        start = tl.load(cu_ptr + seq)
        length = tl.load(cu_ptr + seq + 1) - start
    else:
        batch = seq
        start = 0
        length = LENGTH
    return seq, batch, start, length, chunk_start


@triton.jit
def power_map(x, p):
    """``(x⁺ᵖ, x⁻ᵖ)`` of a block, one log2 and one exp2 per element; exact zeros where ``x`` is zero (so
    masked-out loads give zero features)."""
    nonzero = x != 0
    magnitude = tl.where(nonzero, tl.exp2(p * tl.log2(tl.where(nonzero, tl.abs(x), 1.0))), 0.0)
    return tl.where(x > 0, magnitude, 0.0), tl.where(x < 0, magnitude, 0.0)


@triton.jit
def row_power_of_two_scale(row_max):
    """The largest power of two not above each row's maximum, and at least 1: dividing a query row's
    features (and ``eps`` with them) by it is exact and bounds the products by 2d·max|state|, so large
    inputs do not overflow the fp32 products."""
    return tl.exp2(tl.floor(tl.log2(tl.maximum(row_max, 1.0))))


@triton.jit
def _sum_item_partials_kernel(part_ptr, item_first_ptr, out_ptr, HEADS, WIDTH, BLOCK: tl.constexpr):
    """out[s, h, :] = Σ part[i, h, :] over the items i of sequence s, in item order (deterministic).
    Grid: (sequences, heads, cdiv(WIDTH, BLOCK))."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < WIDTH
    acc = tl.zeros([BLOCK], dtype=part_ptr.dtype.element_ty)
    for item in range(tl.load(item_first_ptr + seq), tl.load(item_first_ptr + seq + 1)):
        acc += tl.load(part_ptr + (item * HEADS + head) * WIDTH + cols, mask=inside, other=0.0)
    tl.store(out_ptr + (seq * HEADS + head) * WIDTH + cols, acc, mask=inside)


def sum_item_partials(partials: torch.Tensor, items: Items) -> torch.Tensor:
    """The second step of a split reduction: (items, H, W) per-item partials → (S, H, W) per-sequence sums."""
    sequences = items.item_first.numel() - 1
    _, heads, width = partials.shape
    out = partials.new_empty(sequences, heads, width)
    block = min(1024, triton.next_power_of_2(width))
    _sum_item_partials_kernel[(sequences, heads, triton.cdiv(width, block))](
        partials, items.item_first, out, heads, width, BLOCK=block
    )
    return out
