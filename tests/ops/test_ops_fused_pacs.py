"""The fused PaCS kernel (hand-written backward) against the naive reference and the functional graph path.

Tolerances (tests/README.md, tests/tolerances.py): float64 fused against naive at 1e-10 (gradients 1e-9), far above
reorder_rtol(n, float64) for these sums (n ≤ 200: 4e-14·κ). float32 at |q|, |k| up to 50: each feature exp(x) carries
(|x| + 1)·u, a normalised output at most (4·51 + 2)·u·max|v| = 4e-5 before RoPE's mixed signs, so 1e-4 (gradients 1e-3
of their largest entry, through exp's derivative of the same condition) allows a condition of 2.5 (10 for gradients)."""
import pytest
import torch

from polaformer.ops import (
    learnable_power,
    naive_pacs_linear_attention,
    pacs_linear_attention,
    pola_linear_attention,
    rope_2d,
    rope_angles,
)
from polaformer.ops.pacs.formulation import pacs_attention_graph

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64


def _inputs(b, h, n, d, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    def make(*s):
        return torch.randn(*s, generator=gen, dtype=F64).requires_grad_()
    return make(b, h, n, d), make(b, h, n, d), make(b, h, n, dv)


@pytest.mark.parametrize("with_rope", [False, True])
def test_temperatures_of_any_broadcast_shape_get_their_own_gradient(with_rope):
    q, k, v = _inputs(2, 3, 12, 4, 6, seed=3)
    gen = torch.Generator().manual_seed(4)
    t_same = torch.rand(3, 1, 8, generator=gen, dtype=F64).requires_grad_()  # no batch dim
    t_opp = torch.rand(8, generator=gen, dtype=F64).requires_grad_()  # shared by all heads
    sin = cos = None
    if with_rope:
        sin, cos = rope_2d(rope_angles(8 * 3, 3, dtype=F64), 3, 4)
    fast = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    ref = naive_pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(ref)
    leaves = (q, k, v, t_same, t_opp)
    for a, b in zip(torch.autograd.grad(fast, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_overflow_falls_back_to_the_log_domain_forward_and_backward():
    # |q|, |k| up to 50 at temperature 1: features up to e^50, products beyond float32 outside the log domain
    gen = torch.Generator().manual_seed(5)
    q, k = ((torch.rand(1, 2, 16, 8, generator=gen) * 100 - 50).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 16, 8, generator=gen, requires_grad=True)
    s = torch.ones(1, 2, 1, 16, requires_grad=True)
    sin, cos = rope_2d(rope_angles(32, 2), 4, 4)
    out = pacs_linear_attention(q, k, v, s, s, sin, cos)
    grads = torch.autograd.grad(out.sum(), (q, k, v, s))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    q64, k64, v64, s64 = leaves64
    ref = naive_pacs_linear_attention(q64, k64, v64, s64, s64, sin.double(), cos.double())
    refs = torch.autograd.grad(ref.sum(), leaves64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, refs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


def test_fused_and_graph_paths_agree_with_padding():
    q, k, v = _inputs(3, 2, 12, 4, 6, seed=6)
    gen = torch.Generator().manual_seed(7)
    t1, t2 = torch.rand(1, 2, 1, 8, generator=gen, dtype=F64), torch.rand(1, 2, 1, 8, generator=gen, dtype=F64)
    sin, cos = rope_2d(rope_angles(16, 2, dtype=F64), 3, 4)
    mask = torch.rand(3, 12, generator=gen) < 0.4
    fused = pacs_linear_attention(q, k, v, t1, t2, sin, cos, key_padding_mask=mask)
    keep = (~mask).to(F64)[:, None, :, None]
    graph = pacs_attention_graph(q, k, v, t1, t2, sin, cos, 1e-6, keep, keep.sum(-2, keepdim=True).clamp_min(1))
    torch.testing.assert_close(fused, graph, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_outputs_are_token_major_so_merging_heads_is_a_view(op):
    q, k, v = (t.detach() for t in _inputs(2, 3, 10, 4, 6, seed=8))
    if op == "pola":
        out = pola_linear_attention(q, k, v, learnable_power(torch.zeros(1, 3, 1, 4, dtype=F64), 4.0))
    else:
        s = torch.full((1, 3, 1, 8), 0.5, dtype=F64)
        out = pacs_linear_attention(q, k, v, s, s)
    assert out.shape == (2, 3, 10, 6)
    assert out.transpose(1, 2).is_contiguous()
