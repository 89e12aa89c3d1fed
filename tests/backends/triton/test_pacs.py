"""The Triton PaCS kernels against the float64 O(N²) reference (ops/naive.py), forward and every gradient.

Without CUDA they run in Triton's interpreter on CPU tensors (conftest.py). The interpreter checks no bounds, so
inputs are views into NaN-filled buffers (a read outside leaks NaN into the results) and a separate test
writes the outputs and gradients into views of sentinel-filled buffers. The cases are a covering set, not a
product: batch 1 and 2, N in {1, 17, 64, 100}, M = N or 16, head widths 5, 8, 40, 48, value halves of odd
width, key masks with an all-padding row, packed batches, exact zeros and large magnitudes, fp32/fp16/bf16.
"""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import pacs_linear_attention, rope_2d, rope_angles
from polaformer.ops.naive import naive_pacs_linear_attention
from precision import half_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: half_tolerance(torch.float16),
             torch.bfloat16: half_tolerance(torch.bfloat16)}


def error_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS(actual − expected) / RMS(expected), in float64."""
    expected = expected.double().cpu()
    diff = actual.double().cpu() - expected
    return (diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def inside(x: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(1, -1) for _ in x.shape)


def guarded_buffer(x: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: ``x`` copied one element inside a ``fill``-ed buffer on every side, so rows get a
    larger stride and anything past an edge of the view is ``fill``."""
    buffer = torch.full([n + 2 for n in x.shape], fill, dtype=x.dtype, device=x.device)
    view = buffer[inside(x)]
    view.copy_(x)
    return buffer, view


def guarded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a leaf view inside a NaN-filled buffer: a read past an edge leaks NaN into the results."""
    return guarded_buffer(x, float("nan"))[1].detach().requires_grad_()


def rope_tables(tokens: int, d: int, heads: int = 1):
    """(tokens, 2d) RoPE tables, as PolaFormer++ builds them for a 2d-channel feature."""
    return rope_2d(rope_angles(2 * d * heads, heads, dtype=torch.float64), 1, tokens)


def make_inputs(b, h, n, m, d, dv, dtype, magnitude=1.0, zeros=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) * magnitude
    k = torch.randn(b, h, m, d, generator=gen, dtype=torch.float64) * magnitude
    v = torch.randn(b, h, m, dv, generator=gen, dtype=torch.float64)
    if zeros:
        q[..., ::3] = 0.0
        k[..., 1::4] = 0.0
        q[:, :, :1] = 0.0  # a whole row of zeros
    temp_same = torch.rand(h, 1, 2 * d, generator=gen, dtype=torch.float64)
    temp_opposite = torch.rand(1, h, 1, 2 * d, generator=gen, dtype=torch.float64)
    return [t.to(DEVICE, dtype) for t in (q, k, v, temp_same, temp_opposite)]


def reference(q, k, v, temp_same, temp_opposite, sin=None, cos=None, key_padding_mask=None):
    args = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, temp_same, temp_opposite)]
    tables = [None if t is None else t.double().cpu() for t in (sin, cos)]
    mask = None if key_padding_mask is None else key_padding_mask.cpu()
    return args, naive_pacs_linear_attention(*args, *tables, key_padding_mask=mask)


def check_against_reference(inputs, dtype, sin=None, cos=None, key_padding_mask=None, **packed):
    """Forward and the five gradients of the Triton op on guarded inputs against the float64 reference."""
    leaves = [guarded(t) for t in inputs]
    out = pacs_linear_attention(*leaves, sin, cos, key_padding_mask=key_padding_mask, **packed)
    assert out.dtype == inputs[2].dtype and out.shape == (*inputs[0].shape[:-1], inputs[2].shape[-1])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    if packed:
        expected, expected_grads = packed_reference(inputs, grad_out, sin, cos, **packed)
    else:
        args, expected = reference(*inputs, sin, cos, key_padding_mask)
        expected_grads = torch.autograd.grad(expected, args, grad_out.double().cpu())
    tolerance = TOLERANCE[dtype]
    assert error_ratio(out, expected) < tolerance
    for name, leaf, grad, want in zip(("q", "k", "v", "temp_same", "temp_opposite"), leaves, grads, expected_grads):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype, name
        assert error_ratio(grad, want) < tolerance, name
    return out, grads


def packed_reference(inputs, grad_out, sin, cos, cu_seqlens, cu_seqlens_k=None):
    """The reference, one sequence at a time: (output, gradients)."""
    offsets = cu_seqlens.tolist()
    offsets_k = offsets if cu_seqlens_k is None else cu_seqlens_k.tolist()
    args = [t.detach().double().cpu().requires_grad_() for t in inputs]
    q, k, v, temp_same, temp_opposite = args
    parts = []
    for s in range(len(offsets) - 1):
        rows, keys = slice(offsets[s], offsets[s + 1]), slice(offsets_k[s], offsets_k[s + 1])
        if keys.stop == keys.start:  # no keys: zero output
            parts.append(torch.zeros(1, q.shape[1], rows.stop - rows.start, v.shape[-1], dtype=torch.float64))
            continue
        tables = [None if t is None else t[rows].double().cpu() for t in (sin, cos)]
        parts.append(naive_pacs_linear_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], temp_same,
                                                 temp_opposite, *tables))
    expected = torch.cat(parts, dim=2)
    return expected, torch.autograd.grad(expected, args, grad_out.double().cpu(), allow_unused=True)


PADDED_CASES = [
    # b, h, n, m, d, dv, dtype, rope, mask, magnitude/zeros
    pytest.param(1, 2, 1, 16, 8, 8, torch.float32, False, False, {}, id="one-query"),
    pytest.param(2, 1, 17, 17, 48, 10, torch.float32, False, True, {}, id="d48-odd-value-half-mask"),
    pytest.param(2, 1, 64, 64, 8, 8, torch.float32, True, False, {}, id="rope"),
    pytest.param(1, 1, 100, 16, 40, 6, torch.float32, False, False, {"magnitude": 12.0, "zeros": True},
                 id="large-and-zeros"),
    pytest.param(1, 1, 17, 16, 5, 4, torch.float32, False, False, {}, id="odd-head-width"),
    pytest.param(2, 1, 100, 16, 48, 10, torch.float16, False, True, {}, id="fp16-mask"),
    pytest.param(1, 1, 64, 64, 48, 16, torch.bfloat16, True, False, {}, id="bf16-rope-d48"),
]


@pytest.mark.parametrize("b, h, n, m, d, dv, dtype, rope, mask, extra", PADDED_CASES)
def test_padded_batches_match_reference(triton_backend, b, h, n, m, d, dv, dtype, rope, mask, extra):
    inputs = make_inputs(b, h, n, m, d, dv, dtype, **extra)
    sin = cos = None
    if rope:
        sin, cos = (t.to(DEVICE, dtype) for t in rope_tables(n, d, h))
    key_padding_mask = None
    if mask:
        key_padding_mask = torch.rand(b, m, generator=torch.Generator().manual_seed(2)) < 0.3
        key_padding_mask[-1] = True  # a sequence without any valid key
        key_padding_mask = key_padding_mask.to(DEVICE)
    out, grads = check_against_reference(inputs, dtype, sin, cos, key_padding_mask)
    if mask:  # the all-padding sequence: zero output and zero gradients, never NaN
        assert out[-1].abs().max() == 0
        for grad in grads[:3]:
            assert grad[-1].abs().max() == 0


def test_packed_batches_match_reference(triton_backend):
    """Sequences of 5, 0, 32 and 33 tokens: tiles overlap several sequences, one sequence is empty."""
    inputs = make_inputs(1, 2, 70, 70, 8, 6, torch.float32)
    cu_seqlens = torch.tensor([0, 5, 5, 37, 70], dtype=torch.int32, device=DEVICE)
    check_against_reference(inputs, torch.float32, cu_seqlens=cu_seqlens)


def test_packed_keys_differ_from_queries(triton_backend):
    """Keys packed apart from the queries (fewer keys; a sequence without keys gets zeros)."""
    q, _, _, temp_same, temp_opposite = make_inputs(1, 1, 64, 1, 16, 8, torch.float32)
    _, k, v, _, _ = make_inputs(1, 1, 1, 20, 16, 8, torch.float32, seed=3)
    cu_seqlens = torch.tensor([0, 17, 30, 64], device=DEVICE)
    cu_seqlens_k = torch.tensor([0, 3, 3, 20], device=DEVICE)
    out, _ = check_against_reference([q, k, v, temp_same, temp_opposite], torch.float32,
                                     cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k)
    assert out[:, :, 17:30].abs().max() == 0


def test_packed_batches_with_rope_tables_per_token(triton_backend):
    lengths = (7, 33)
    inputs = make_inputs(1, 1, sum(lengths), sum(lengths), 8, 8, torch.float16)
    tables = [rope_tables(n, 8) for n in lengths]
    sin, cos = (torch.cat([t[i] for t in tables]).to(DEVICE, torch.float16) for i in (0, 1))
    cu_seqlens = torch.tensor([0, 7, 40], dtype=torch.int32, device=DEVICE)
    check_against_reference(inputs, torch.float16, sin, cos, cu_seqlens=cu_seqlens)


def test_gradcheck_float64(triton_backend):
    """The kernels take float64 under the interpreter (fp64 accumulation): gradcheck on a tiny masked RoPE case.
    (On CUDA the op runs float64 in torch, so there this checks the torch formulation.)"""
    q, k, v, temp_same, temp_opposite = make_inputs(2, 1, 3, 3, 4, 4, torch.float64)
    mask = torch.tensor([[False, True, False], [False, False, False]], device=DEVICE)
    sin, cos = (t.to(DEVICE) for t in rope_tables(3, 4))
    leaves = [t.requires_grad_() for t in (q, k, v, temp_same, temp_opposite)]
    assert torch.autograd.gradcheck(lambda *x: pacs_linear_attention(*x, sin, cos, key_padding_mask=mask), leaves,
                                    fast_mode=True, check_undefined_grad=False)


def test_kernels_write_only_inside_their_outputs(triton_backend):
    """Output and gradients written into views of sentinel-filled buffers leave the sentinels untouched."""
    from polaformer.ops.pacs import triton as pacs

    sentinel = -1234.5
    configs = [
        dict(b=2, n=17, m=16, d=5, dv=6, dtype=torch.float16, mask=True),
        dict(b=1, n=40, m=40, d=6, dv=10, dtype=torch.float32, rope=True, cu=[0, 3, 3, 40]),
    ]
    for config in configs:
        b, n, m, d, dv, dtype = (config[key] for key in ("b", "n", "m", "d", "dv", "dtype"))
        q, k, v, temp_same, temp_opposite = (t.detach() for t in make_inputs(b, 2, n, m, d, dv, dtype))
        sin = cos = key_mask = cu = None
        if config.get("rope"):
            sin, cos = (t.to(DEVICE, dtype) for t in rope_tables(n, d))
        if config.get("mask"):
            key_mask = torch.zeros(b, m, dtype=torch.bool, device=DEVICE)
            key_mask[0, ::2] = True
        if "cu" in config:
            cu = torch.tensor(config["cu"], dtype=torch.int32, device=DEVICE)
        out_buffer, out = guarded_buffer(torch.empty(*q.shape[:-1], dv, dtype=dtype, device=DEVICE), sentinel)
        _, state, call = pacs.pacs_forward(q, k, v, temp_same, temp_opposite, sin, cos, 1e-6, key_mask, cu, cu,
                                           out=out)
        buffers, grads = zip(*(guarded_buffer(torch.empty_like(t), sentinel) for t in (q, k, v)))
        pacs.pacs_backward(call, q, k, v, sin, cos, state, 1e-6, torch.randn_like(out),
                           (temp_same.shape, temp_opposite.shape), *grads)
        for buffer, written in zip((out_buffer, *buffers), (out, *grads)):
            assert torch.isfinite(written).all()
            outside = buffer.clone()
            outside[inside(written)] = sentinel
            assert (outside == sentinel).all()


def test_forward_is_deterministic_and_dispatched(triton_backend, monkeypatch):
    """The op reaches the Triton entry point, and two runs (split reductions) give the same bits."""
    from polaformer.ops.pacs import triton as pacs

    calls = []
    entry = pacs.pacs_attention
    monkeypatch.setattr(pacs, "pacs_attention", lambda *a, **kw: calls.append(1) or entry(*a, **kw))
    q, k, v, temp_same, temp_opposite = make_inputs(1, 1, 100, 100, 8, 8, torch.float32)
    first = pacs_linear_attention(q, k, v, temp_same, temp_opposite)
    second = pacs_linear_attention(q, k, v, temp_same, temp_opposite)
    assert len(calls) == 2 and torch.equal(first, second)
