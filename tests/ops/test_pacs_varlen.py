"""``pacs_linear_attention(..., cu_seqlens=...)``, packed variable-length batches, on the CPU backends (the Triton
kernels' packed path is tested in tests/backends/triton): each sequence gets the output and gradients of the
float64 reference run on it alone."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import pacs_linear_attention, rope_2d, rope_angles
from polaformer.ops.dispatch import set_attention_backend
from polaformer.ops.naive import naive_pacs_linear_attention

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default


@pytest.fixture(params=["torch", "native"])
def backend(request):
    previous = set_attention_backend(request.param)
    yield request.param
    set_attention_backend(previous)


def packed_inputs(tokens_q, tokens_k, d=8, dv=6, heads=2, dtype=torch.float64):
    q = torch.randn(1, heads, tokens_q, d, dtype=dtype, requires_grad=True)
    k = torch.randn(1, heads, tokens_k, d, dtype=dtype, requires_grad=True)
    v = torch.randn(1, heads, tokens_k, dv, dtype=dtype, requires_grad=True)
    temps = [torch.rand(heads, 1, 2 * d, dtype=dtype, requires_grad=True) for _ in range(2)]
    return [q, k, v, *temps]


def per_sequence(inputs, offsets, offsets_k, tables=None):
    q, k, v, temp_same, temp_opposite = inputs
    parts = []
    for s in range(len(offsets) - 1):
        rows, keys = slice(offsets[s], offsets[s + 1]), slice(offsets_k[s], offsets_k[s + 1])
        if keys.start == keys.stop:
            parts.append(q.new_zeros(1, q.shape[1], rows.stop - rows.start, v.shape[-1]))
            continue
        rope = () if tables is None else (tables[0][rows], tables[1][rows])
        parts.append(naive_pacs_linear_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], temp_same,
                                                 temp_opposite, *rope))
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("offsets, offsets_k", [([0, 4, 4, 13], None), ([0, 4, 9, 13], [0, 2, 2, 7])])
def test_packed_batch_matches_each_sequence_alone(backend, offsets, offsets_k):
    inputs = packed_inputs(offsets[-1], (offsets_k or offsets)[-1])
    cu_k = None if offsets_k is None else torch.tensor(offsets_k)
    out = pacs_linear_attention(*inputs, cu_seqlens=torch.tensor(offsets, dtype=torch.int32), cu_seqlens_k=cu_k)
    expected = per_sequence(inputs, offsets, offsets_k or offsets)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad))


def test_packed_batch_with_rope_tables_per_token(backend):
    lengths = (3, 5)
    tables = [rope_2d(rope_angles(16, 1, dtype=torch.float64), 1, n) for n in lengths]
    sin, cos = (torch.cat([t[i] for t in tables]) for i in (0, 1))
    inputs = packed_inputs(8, 8, heads=1)
    out = pacs_linear_attention(*inputs, sin, cos, cu_seqlens=torch.tensor([0, 3, 8]))
    torch.testing.assert_close(out, per_sequence(inputs, [0, 3, 8], [0, 3, 8], (sin, cos)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(cu_seqlens=torch.tensor([0, 3, 7])), "end at the packed token count"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "int32/int64"),
    (dict(cu_seqlens_k=torch.tensor([0, 8])), "cu_seqlens_k needs cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 4, 8])), "as many sequences"),
    (dict(cu_seqlens=torch.tensor([0, 8]), key_padding_mask=torch.zeros(1, 8, dtype=torch.bool)), "not both"),
])
def test_bad_packed_arguments_name_the_problem(kwargs, message):
    inputs = packed_inputs(8, 8)
    with pytest.raises(ValueError, match=message):
        pacs_linear_attention(*inputs, **kwargs)


def test_rope_keys_must_be_packed_like_the_queries():
    inputs = packed_inputs(8, 8, heads=1)
    sin, cos = rope_2d(rope_angles(16, 1, dtype=torch.float64), 1, 8)
    with pytest.raises(ValueError, match="packed like the queries"):
        pacs_linear_attention(*inputs, sin, cos, cu_seqlens=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 8]))
