"""The fast ops against their O(N²) references, in float64, forward and backward.

Tolerances (tests/README.md, tests/tolerances.py): the float64 checks (1e-9 to 1e-12, relative) are orders above
reorder_rtol(n, float64) = 2.2e-16·n·κ for sums of at most a few hundred terms; the float32 one against float64 at
magnitudes up to 50 (1e-3, 1e-4) is above the bound of features exp(s·x) computed in float32: their relative error
(|s·x| + 1)·u moves a normalised output by at most (4·51 + 2)·u·max|v| = 4e-5; the low-precision one uses
linear_attention_atol."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from polaformer.ops import (
    apply_rope,
    apply_rope_export,
    elu_feature,
    focused_feature,
    learnable_power,
    linear_attention,
    linear_attention_weights,
    naive_pacs_linear_attention,
    naive_pola_linear_attention,
    official_pola_linear_attention,
    pacs_key_features,
    pacs_linear_attention,
    pacs_query_features,
    pola_attention_weights,
    pola_linear_attention,
    power_feature,
    rope_2d,
    rope_angles,
    softmax_attention_weights,
)
from tolerances import linear_attention_atol

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64


def rand(*shape, gen, scale=1.0, grad=True):
    t = torch.randn(*shape, generator=gen, dtype=F64) * scale
    return t.requires_grad_(grad)


def assert_close(a, b, rel=1e-9):
    tol = rel * max(1.0, b.abs().max().item())
    err = (a - b).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3e} > {tol:.3e}"


def pola_inputs(b, h, n, m, d, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    return rand(b, h, n, d, gen=gen), rand(b, h, m, d, gen=gen), rand(b, h, m, dv, gen=gen), rand(1, h, 1, d, gen=gen)


def compare_pola(q, k, v, w, alpha=4.0):
    fast = pola_linear_attention(q, k, v, learnable_power(w, alpha))
    ref = naive_pola_linear_attention(q, k, v, learnable_power(w, alpha))
    assert fast.shape == ref.shape == q.shape[:-1] + (v.shape[-1],)
    assert_close(fast, ref)
    grad = torch.randn_like(ref)
    g_fast = torch.autograd.grad(fast, (q, k, v, w), grad)
    g_ref = torch.autograd.grad(ref, (q, k, v, w), grad)
    for name, a, b in zip("qkvw", g_fast, g_ref):
        assert a.shape == b.shape, name
        assert_close(a, b)


@pytest.mark.parametrize(
    "b,h,n,m,d,dv",
    [
        (1, 1, 1, 1, 2, 2),  # smallest case
        (1, 2, 17, 17, 8, 8),  # batch 1, odd token count
        (2, 3, 33, 9, 6, 4),  # keys/values shorter than queries (spatial reduction)
        (3, 2, 5, 12, 4, 10),  # more keys than queries, dv != d
        (2, 4, 49, 49, 16, 16),
    ],
)
def test_fused_pola_matches_naive(b, h, n, m, d, dv):
    compare_pola(*pola_inputs(b, h, n, m, d, dv, seed=n * 31 + m))


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3), h=st.integers(1, 3), n=st.integers(1, 40), m=st.integers(1, 40),
    d=st.integers(1, 6), half_dv=st.integers(1, 5), seed=st.integers(0, 2**16),
)
def test_fused_pola_matches_naive_random_shapes(b, h, n, m, d, half_dv, seed):
    compare_pola(*pola_inputs(b, h, n, m, d, 2 * half_dv, seed))


def test_fused_pola_gradcheck():
    q, k, v, w = pola_inputs(2, 2, 5, 4, 3, 4, seed=1)
    assert torch.autograd.gradcheck(lambda q, k, v, w: pola_linear_attention(q, k, v, learnable_power(w, 3.0)),
                                    (q, k, v, w))


def test_fused_pola_per_batch_power_and_exact_zeros():
    q, k, v, _ = pola_inputs(2, 2, 6, 6, 4, 4, seed=2)
    with torch.no_grad():
        q[0, 0, 0] = 0.0  # x = 0 exactly: the gradient through |x|^p is 0, not NaN
        k[1, 1, 2, 1] = 0.0
    w = rand(2, 2, 1, 4, gen=torch.Generator().manual_seed(3))  # a different exponent per sample
    compare_pola(q, k, v, w)
    out = pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    grads = torch.autograd.grad(out.sum(), (q, k, v, w))
    assert all(torch.isfinite(g).all() for g in grads)


def test_power_feature_is_relu_power_of_both_signs():
    gen = torch.Generator().manual_seed(0)
    x = rand(2, 3, 7, 5, gen=gen, grad=False)
    p = learnable_power(rand(1, 3, 1, 5, gen=gen, grad=False), 4.0)
    expected = torch.cat([F.relu(x) ** p, F.relu(-x) ** p], dim=-1)
    torch.testing.assert_close(power_feature(x, p), expected, rtol=1e-12, atol=0)
    # the learnable exponent stays in (1, 1 + alpha)
    assert (p > 1).all() and (p < 5).all()


def test_pacs_features_follow_the_official_formula():
    gen = torch.Generator().manual_seed(0)
    q = rand(2, 2, 9, 4, gen=gen, grad=False)
    k = rand(2, 2, 9, 4, gen=gen, grad=False)
    s1, s2 = torch.rand(1, 2, 1, 8, generator=gen, dtype=F64), torch.rand(1, 2, 1, 8, generator=gen, dtype=F64)
    qp, qn = F.relu(q), F.relu(-q)
    same, opposite = pacs_query_features(q, s1, s2)
    torch.testing.assert_close(same, torch.exp(torch.cat([qp, qn], -1) * s1) - 1, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(opposite, torch.exp(torch.cat([qn, qp], -1) * s2) - 1, rtol=1e-12, atol=1e-15)
    kp, kn = F.relu(k), F.relu(-k)
    torch.testing.assert_close(pacs_key_features(k), torch.exp(torch.cat([kp, kn], -1)) - 1, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize("b,h,n,d,dv", [(1, 1, 4, 4, 2), (2, 2, 12, 4, 6), (1, 3, 9, 8, 8)])
def test_pacs_matches_naive(b, h, n, d, dv, with_rope):
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = rand(b, h, n, d, gen=gen), rand(b, h, n, d, gen=gen), rand(b, h, n, dv, gen=gen)
    s1, s2 = rand(1, h, 1, 2 * d, gen=gen), rand(1, h, 1, 2 * d, gen=gen)
    sin = cos = None
    if with_rope:
        side_w = 3 if n % 3 == 0 else 2
        sin, cos = rope_2d(rope_angles(2 * d * h, h, dtype=F64), n // side_w, side_w)
    inputs = (q, k, v, s1, s2)
    fast = pacs_linear_attention(q, k, v, torch.sigmoid(s1), torch.sigmoid(s2), sin, cos)
    ref = naive_pacs_linear_attention(q, k, v, torch.sigmoid(s1), torch.sigmoid(s2), sin, cos)
    assert_close(fast, ref)
    grad = torch.randn_like(ref)
    for a, b_ in zip(torch.autograd.grad(fast, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        assert_close(a, b_)


def test_pacs_gradcheck():
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(1, 2, 6, 2, gen=gen), rand(1, 2, 6, 2, gen=gen), rand(1, 2, 6, 4, gen=gen)
    s1, s2 = rand(1, 2, 1, 4, gen=gen), rand(1, 2, 1, 4, gen=gen)
    sin, cos = rope_2d(rope_angles(8, 2, dtype=F64), 2, 3)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s1, s2: pacs_linear_attention(q, k, v, torch.sigmoid(s1), torch.sigmoid(s2), sin, cos),
        (q, k, v, s1, s2),
    )


def test_weights_are_row_normalised_without_eps():
    gen = torch.Generator().manual_seed(0)
    q, k = rand(2, 2, 10, 4, gen=gen, grad=False), rand(2, 2, 7, 4, gen=gen, grad=False)
    same, opposite = pola_attention_weights(q, k, learnable_power(torch.zeros(1, 2, 1, 4, dtype=F64), 4.0), eps=0.0)
    for w in (same, opposite):
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    soft = softmax_attention_weights(q, k)
    torch.testing.assert_close(soft.sum(-1), torch.ones_like(soft.sum(-1)))


@pytest.mark.parametrize("feature", [elu_feature, F.relu, focused_feature])
def test_baseline_linear_attention_matches_its_weights(feature):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (rand(2, 2, 11, 4, gen=gen, grad=False) for _ in range(3))
    phi_q, phi_k = feature(q), feature(k)
    torch.testing.assert_close(
        linear_attention(phi_q, phi_k, v), linear_attention_weights(phi_q, phi_k) @ v, rtol=1e-10, atol=1e-12
    )


def test_focused_feature_keeps_the_relu_norm():
    x = torch.randn(4, 6, 8, dtype=F64)
    torch.testing.assert_close(focused_feature(x).norm(dim=-1), (F.relu(x) + 1e-6).norm(dim=-1))


def test_rope_rotation_preserves_pair_norms_and_relative_phase():
    sin, cos = rope_2d(rope_angles(16, 1, dtype=F64), 3, 4)
    x = torch.randn(12, 16, dtype=F64)
    y = apply_rope(x, sin, cos)
    def pairs(t):
        return t.reshape(12, 8, 2).norm(dim=-1)
    torch.testing.assert_close(pairs(y), pairs(x))
    # a rotation by the angle of position 0 is the identity
    torch.testing.assert_close(y[0], x[0])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_rope_export_form_gives_the_same_values(dtype):
    """The pair rotation as a product with ±1 and 0: each output is one input, negated or not, plus a zero."""
    sin, cos = rope_2d(rope_angles(16, 1, dtype=dtype), 3, 4)
    x = torch.randn(2, 3, 12, 16, dtype=dtype) * torch.logspace(-30, 30, 16, dtype=dtype)
    x[0, 0, 0, :4] = 0.0
    assert torch.equal(apply_rope_export(x, sin, cos), apply_rope(x, sin, cos))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_stays_finite(dtype):
    gen = torch.Generator().manual_seed(0)
    q = (torch.rand(2, 4, 64, 16, generator=gen) * 100 - 50)  # |x| ≤ 50
    k = (torch.rand(2, 4, 64, 16, generator=gen) * 100 - 50)
    v = torch.randn(2, 4, 64, 16, generator=gen)
    w = torch.full((1, 4, 1, 16), 10.0)  # p close to 1 + alpha = 5: |x|^p ≈ 3e8
    with torch.autocast("cpu", dtype=dtype):
        out = pola_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), learnable_power(w, 4.0))
        s = torch.ones(1, 4, 1, 32)  # temperature 1: exp(50) ≈ 5e21 per feature
        out_pp = pacs_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), s, s)
    for o in (out, out_pp):
        assert o.dtype == dtype
        assert torch.isfinite(o).all()
    # float32 of the same (rounded) inputs, up to autocast's roundings of the features and products to dtype
    ref = pola_linear_attention(*(t.to(dtype).float() for t in (q, k, v)), learnable_power(w, 4.0))
    atol = linear_attention_atol(v.to(dtype).abs().max().item(), dtype, roundings=4)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)


def test_pacs_large_inputs_float32_do_not_overflow():
    gen = torch.Generator().manual_seed(1)
    q = torch.rand(1, 2, 16, 8, generator=gen) * 100 - 50
    k = torch.rand(1, 2, 16, 8, generator=gen) * 100 - 50
    v = torch.randn(1, 2, 16, 8, generator=gen)
    s = torch.ones(1, 2, 1, 16)
    out = pacs_linear_attention(q, k, v, s, s)
    assert torch.isfinite(out).all()
    ref = naive_pacs_linear_attention(q.double(), k.double(), v.double(), s.double(), s.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (((2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 1)), "at least 2"),
        (((2, 2, 8, 4), (2, 2, 8, 5), (2, 2, 8, 4)), "head_dim differ"),
        (((2, 2, 8, 4), (2, 2, 7, 4), (2, 2, 8, 4)), "token counts differ"),
        (((2, 8, 4), (2, 8, 4), (2, 8, 4)), "4-D"),
        (((2, 2, 8, 4), (3, 2, 8, 4), (3, 2, 8, 4)), "batch and head"),
    ],
)
def test_bad_shapes_raise_clear_errors(shapes, message):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        pola_linear_attention(q, k, v, torch.ones(1, 1, 1, q.shape[-1]) * 2)


def test_graph_capture_path_matches_naive_forward_and_backward(monkeypatch):
    """Under torch.compile / export / ONNX the op runs its functional form: it must be as exact."""
    import polaformer.ops.pola.op as pola_ops

    monkeypatch.setattr(pola_ops, "capturing", lambda: True)
    q, k, v, w = pola_inputs(2, 3, 11, 7, 4, 6, seed=12)
    with torch.no_grad():
        q[0, 0, 0, 0] = 0.0  # |x|^p at 0: the gradients stay finite
    compare_pola(q, k, v, w)
    mask = torch.tensor([[False] * 7, [False] * 3 + [True] * 4])
    p = learnable_power(w, 4.0)
    torch.testing.assert_close(pola_linear_attention(q, k, v, p, key_padding_mask=mask),
                               naive_pola_linear_attention(q, k, v, p, key_padding_mask=mask), rtol=1e-9, atol=1e-12)


def test_op_compiles_without_graph_breaks_forward_and_backward():
    q, k, v, w = pola_inputs(2, 2, 9, 9, 4, 4, seed=13)
    def fn(q, k, v, w):
        return pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, ref = compiled(q, k, v, w), fn(q, k, v, w)
    assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, w), grad), torch.autograd.grad(ref, (q, k, v, w), grad)):
        assert_close(a, b)


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_plus_depthwise_conv_is_the_residual_sum_forward_and_backward(kernel_size):
    from polaformer.backends.cpu.conv import plus_depthwise_conv

    conv = torch.nn.Conv2d(6, 6, kernel_size, padding=kernel_size // 2, groups=6).double()
    x = torch.randn(2, 6, 9, 7, dtype=F64, requires_grad=True)
    fused = plus_depthwise_conv(x, conv.weight, conv.bias, kernel_size, 6)
    plain = x + conv(x)
    assert_close(fused, plain, rel=1e-13)
    grad = torch.randn_like(plain)
    leaves = (x, conv.weight, conv.bias)
    for a, b in zip(torch.autograd.grad(fused, leaves, grad), torch.autograd.grad(plain, leaves, grad)):
        assert_close(a, b, rel=1e-13)
    with pytest.raises(ValueError, match="odd kernel"):
        plus_depthwise_conv(x, conv.weight, conv.bias, 4, 6)


def test_plus_depthwise_conv_traces_with_fx():
    from polaformer.backends.cpu.conv import plus_depthwise_conv

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)

        def forward(self, x):
            return plus_depthwise_conv(x, self.conv.weight, self.conv.bias, 3, 4)

    block = Block()
    traced = torch.fx.symbolic_trace(block)
    x = torch.randn(1, 4, 5, 5)
    torch.testing.assert_close(traced(x), x + block.conv(x))


@pytest.mark.parametrize("n,m,dv", [(9, 9, 6), (12, 5, 7)])
def test_official_two_stream_formulation_equals_the_reference(n, m, dv):
    q, k, v, w = pola_inputs(2, 3, n, m, 4, dv, seed=3)
    p = learnable_power(w, 4.0)
    torch.testing.assert_close(official_pola_linear_attention(q, k, v, p), naive_pola_linear_attention(q, k, v, p),
                               rtol=1e-10, atol=1e-12)
