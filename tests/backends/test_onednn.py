"""The oneDNN linear path (polaformer.backends.cpu.onednn; the nn.Linear and timm Mlp swaps of accelerate): the
same values and gradients as F.linear and timm's Mlp, taken only where it applies.

Tolerances (tests/README.md, tests/tolerances.py): float32 against float64 at 1e-4 relative (_close32), probable_rtol
of the 768-term products (2.6e-5) through a GELU; the float32 GELU kernel at 1e-6 absolute against float64, a few
units of float32's rounding (u = 6e-8) of values up to 16; bfloat16 autocast at 2e-2 relative and 5e-2 absolute,
bfloat16's u = 3.9e-3 of the inputs and the output plus the products' float32 accumulation."""
import time

import pytest
import timm.layers
import torch
import torch.nn.functional as F
from torch import nn

import polaformer.backends.cpu.onednn as onednn
from polaformer import accelerate
from polaformer.backends.cpu.onednn import linear


def Linear(*args, **kwargs):
    return accelerate(nn.Linear(*args, **kwargs))


def Mlp(*args, **kwargs):
    return accelerate(timm.layers.Mlp(*args, **kwargs))


pytestmark = [pytest.mark.skipif(not onednn.onednn_linear_available(), reason="this torch has no oneDNN linear"),
              pytest.mark.numerics]  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64
# (rows, in, out): below and above the size where oneDNN takes over, a wide inner dimension, odd sizes
SHAPES = [(7, 5, 3), (196, 192, 768), (50, 300, 260), (1030, 48, 680)]


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the calls that reach oneDNN's kernel, under the narrow policy (the counts below assume it)."""
    monkeypatch.setattr(onednn, "_POLICY", onednn.NARROW)
    calls = []
    real, real_binary = onednn._OP, onednn._OP_BINARY

    def spy(*args):
        calls.append(args[3])
        return real(*args)

    def spy_binary(*args):
        calls.append(args[4])
        return real_binary(*args)

    monkeypatch.setattr(onednn, "_OP", spy)
    monkeypatch.setattr(onednn, "_OP_BINARY", spy_binary)
    return calls


def _inputs(rows, inner, outer, seed=0, lead=(2,)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, inner, generator=gen)
    weight = torch.randn(outer, inner, generator=gen) / inner**0.5
    bias = torch.randn(outer, generator=gen)
    return x, weight, bias


def _close32(actual, expected64):
    """float32 products against the float64 result: rounding of the inner dimension's sums only."""
    scale = expected64.abs().max().item() + 1e-30
    err = (actual.double() - expected64).abs().max().item()
    assert err <= 1e-5 * scale, f"max error {err:g} against max |value| {scale:g}"


@pytest.mark.parametrize("rows,inner,outer", SHAPES)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_forward_without_gradients_matches_float64(rows, inner, outer, activation):
    x, w, b = _inputs(rows, inner, outer)
    with torch.inference_mode():
        out = linear(x, w, b, activation)
    ref = F.linear(x.double(), w.double(), b.double())
    _close32(out, F.gelu(ref) if activation else ref)
    assert out.dtype == torch.float32 and out.shape == (2, rows, outer)


@pytest.mark.parametrize("rows,inner,outer", SHAPES)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_gradients_match_float64(rows, inner, outer, activation):
    x, w, b = _inputs(rows, inner, outer)
    leaves32 = [t.clone().requires_grad_() for t in (x, w, b)]
    leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
    grad = torch.randn(2, rows, outer)
    out = linear(*leaves32, activation)
    ref = F.linear(*leaves64)
    ref = F.gelu(ref) if activation else ref
    _close32(out.detach(), ref.detach())
    for a, r in zip(torch.autograd.grad(out, leaves32, grad), torch.autograd.grad(ref, leaves64, grad.double())):
        _close32(a, r)


def test_large_products_run_on_onednn_and_small_ones_on_torch(onednn_calls):
    big, small = _inputs(196, 192, 768), _inputs(7, 5, 3)
    with torch.no_grad():
        linear(*big)
        assert onednn_calls == ["none"]
        linear(*small)
        assert onednn_calls == ["none"]  # below the size where oneDNN wins: F.linear
        linear(*small, activation="gelu")  # the fused GELU saves a pass at any size
        assert onednn_calls == ["none", "gelu"]
    x, w, b = (t.requires_grad_() for t in big)
    linear(x, w, b).sum().backward()  # forward and the input's gradient
    assert onednn_calls == ["none", "gelu", "none", "none"]


def test_grad_mode_runs_gelu_as_its_own_pass(onednn_calls):
    x, w, b = _inputs(196, 192, 768)
    w.requires_grad_()
    linear(x, w, b, activation="gelu")
    assert onednn_calls == ["none"]  # GELU's backward needs the pre-activation


@pytest.mark.parametrize("case", ["float64", "bfloat16 autocast", "env off", "strided", "no bias", "fx"])
def test_where_onednn_does_not_apply_the_result_is_still_right(case, onednn_calls, monkeypatch):
    x, w, b = _inputs(196, 192, 768)
    expected_calls = []
    if case == "float64":
        x, w, b = x.double(), w.double(), b.double()
        out = linear(x, w, b, "gelu")
        torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)), rtol=0, atol=0)
    elif case == "bfloat16 autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = linear(x, w, b)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x, w, b), rtol=2e-2, atol=5e-2)
    elif case == "env off":
        monkeypatch.setattr(onednn, "_ENABLED", False)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    elif case == "strided":  # oneDNN reads the strides: no copy, same values
        xs = x.transpose(0, 1)
        _close32(linear(xs, w.t().contiguous().t(), b), F.linear(xs.double(), w.double(), b.double()))
        expected_calls = ["none"]
    elif case == "no bias":
        _close32(linear(x, w), F.linear(x.double(), w.double()))
        expected_calls = ["none"]
    else:
        graph = torch.fx.symbolic_trace(Linear(192, 768))
        assert "linear" in str(graph.graph) and "mkldnn" not in str(graph.code)
        torch.testing.assert_close(graph(x), F.linear(x, graph.weight, graph.bias), rtol=0, atol=0)
    assert onednn_calls == expected_calls


def test_malformed_calls_fail_as_in_torch():
    x, w, b = _inputs(196, 192, 768)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        linear(x[..., :100], w, b)
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(x, w, b, activation="relu")
    assert linear(x[:, :0], w, b).shape == (2, 0, 768)


def test_linear_module_is_an_nn_linear_with_the_same_state():
    theirs = nn.Linear(192, 768)
    ours = Linear(192, 768)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert isinstance(ours, nn.Linear)
    x = torch.randn(3, 196, 192)
    with torch.no_grad():
        _close32(ours(x), theirs.double()(x.double()))


def test_mlp_loads_timms_state_and_gives_its_outputs_and_gradients():
    theirs = timm.layers.Mlp(64, 256)
    ours = Mlp(64, 256)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert [n for n, _ in ours.named_children()] == [n for n, _ in theirs.named_children()]
    x = torch.randn(4, 300, 64)
    with torch.inference_mode():
        _close32(ours(x), theirs.double()(x.double()))
    theirs.float()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(xa).square().sum().backward()
    theirs(xb).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_mlp_honours_a_swapped_or_hooked_activation(onednn_calls):
    mlp = Mlp(64, 256)
    x = torch.randn(2, 300, 64)
    mlp.act = nn.ReLU()
    with torch.no_grad():
        out = mlp(x)
    torch.testing.assert_close(out, mlp.fc2(F.relu(mlp.fc1(x))))
    assert "gelu" not in onednn_calls
    mlp.act = nn.GELU()
    seen = []
    mlp.act.register_forward_hook(lambda module, args, result: seen.append(result.shape))
    with torch.no_grad():
        mlp(x)
    assert seen == [(2, 300, 256)] and "gelu" not in onednn_calls


def _kernels():
    kernels = onednn._gelu_kernels()
    if kernels is None:
        pytest.skip("native kernels not built here")
    return kernels


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gelu_with_slope_matches_torchs_gelu_and_its_backward(dtype):
    kernels = _kernels()
    x = torch.randn(1000, 37, dtype=dtype) * 4
    x[0, :5] = torch.tensor([0.0, -0.0, 40.0, -40.0, float("nan")], dtype=dtype)
    slope = x.clone()
    (out,) = kernels.gelu_with_slope(slope, in_place=True)
    # float32 against the float64 values (torch's own float32 GELU is off by up to 1.1e-6 here)
    x64 = x.double()
    tol = dict(rtol=0, atol=1e-15) if dtype == F64 else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(out.double(), F.gelu(x64), equal_nan=True, **tol)
    torch.testing.assert_close(slope.double(), torch.ops.aten.gelu_backward(torch.ones_like(x64), x64),
                               equal_nan=True, **tol)
    # any dense layout: a channels-last map gives its values in its own layout
    cl = x[:999].reshape(1, 37, 27, 37).contiguous(memory_format=torch.channels_last)
    out_cl, slope_cl = kernels.gelu_with_slope(cl, in_place=False)
    assert out_cl.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out_cl.double(), F.gelu(cl.double()), equal_nan=True, **tol)
    with pytest.raises(RuntimeError, match="dense"):
        kernels.gelu_with_slope(x[:, ::2], in_place=False)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gelu_with_gradients_keeps_the_slope_and_matches_float64(layout):
    _kernels()
    x = torch.randn(2, 16, 9, 7) * 3
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = onednn.gelu(x32)
    assert out.grad_fn is not None and "Gelu" in type(out.grad_fn).__name__ and out.stride() == x.stride()
    grad = torch.randn(x.shape)
    ref = F.gelu(x64)
    _close32(out.detach(), ref.detach())
    _close32(torch.autograd.grad(out, x32, grad)[0], torch.autograd.grad(ref, x64, grad.double())[0])
    with torch.no_grad():  # no gradient wanted: torch's GELU
        torch.testing.assert_close(onednn.gelu(x), F.gelu(x), rtol=0, atol=0)
    torch.testing.assert_close(onednn.gelu(x64.detach()), F.gelu(x64.detach()), rtol=0, atol=0)


@pytest.mark.parametrize("rows,inner,outer", SHAPES)
def test_mlp_matches_float64_with_gradients(rows, inner, outer, onednn_calls):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, rows, inner, generator=gen)
    w1, b1 = torch.randn(outer, inner, generator=gen) / inner**0.5, torch.randn(outer, generator=gen)
    w2, b2 = torch.randn(inner, outer, generator=gen) / outer**0.5, torch.randn(inner, generator=gen)
    leaves32 = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    leaves64 = [t.double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    out = onednn.mlp(*leaves32)
    ref = F.linear(F.gelu(F.linear(*leaves64[:3])), *leaves64[3:])
    _close32(out.detach(), ref.detach())
    grad = torch.randn(out.shape, generator=gen)
    for a, r in zip(torch.autograd.grad(out, leaves32, grad), torch.autograd.grad(ref, leaves64, grad.double())):
        _close32(a, r)
    fused = onednn._prefers_onednn(2 * rows, inner, outer) and onednn._prefers_onednn(2 * rows, outer, inner)
    if fused and onednn._gelu_kernels() is not None:
        # fc1, fc2; backward: the hidden gradient (with GELU's slope as a post-op) and fc1's input gradient
        assert onednn_calls == ["none", "none", "mul", "none"]


def test_mlp_gradients_for_some_inputs_only():
    _kernels()
    x, w1, b1 = _inputs(196, 192, 768)
    w2, b2 = torch.randn(192, 768) / 768**0.5, torch.randn(192)
    w2.requires_grad_()
    (g,) = torch.autograd.grad(onednn.mlp(x, w1, b1, w2, b2).square().sum(), w2)
    w2_64 = w2.detach().double().requires_grad_()
    ref = F.linear(F.gelu(F.linear(x.double(), w1.double(), b1.double())), w2_64, b2.double())
    _close32(g, torch.autograd.grad(ref.square().sum(), w2_64)[0])


def test_linear_gelu_with_gradients_folds_the_slope(onednn_calls):
    _kernels()
    x, w, b = _inputs(196, 192, 768)
    x.requires_grad_()
    out = linear(x, w, b, activation="gelu")
    assert out.grad_fn.name().startswith("_LinearGelu")
    ref_x = x.detach().double().requires_grad_()
    ref = F.gelu(F.linear(ref_x, w.double(), b.double()))
    grad = torch.randn(out.shape)
    _close32(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, ref_x, grad.double())[0])


def test_small_linear_gelu_with_gradients_folds_the_slope_on_torchs_products(onednn_calls):
    _kernels()
    x, w, b = _inputs(7, 5, 3)
    leaves32 = [t.clone().requires_grad_() for t in (x, w, b)]
    out = linear(*leaves32, activation="gelu")
    assert out.grad_fn.name().startswith("_LinearGelu")
    leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref = F.gelu(F.linear(*leaves64))
    grad = torch.randn(out.shape)
    for a, r in zip(torch.autograd.grad(out, leaves32, grad), torch.autograd.grad(ref, leaves64, grad.double())):
        _close32(a, r)
    assert onednn_calls == []  # too small for oneDNN: forward and gradients on torch's products


def test_mlp_traces_with_fx_as_plain_ops():
    mlp = Mlp(16, 64)
    graph = torch.fx.symbolic_trace(mlp)
    assert "mkldnn" not in graph.code
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(graph(x), mlp.fc2(F.gelu(mlp.fc1(x))))


@pytest.mark.parametrize("grad", [False, True])
def test_gelu_linear_matches_float64(grad, onednn_calls):
    _kernels()
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 600, 256, generator=gen) * 2
    w, b = torch.randn(64, 256, generator=gen) / 16, torch.randn(64, generator=gen)
    leaves = [t.clone().requires_grad_(grad) for t in (h, w, b)]
    out = onednn.gelu_linear(*leaves)
    leaves64 = [t.double().requires_grad_(grad) for t in (h, w, b)]
    ref = F.linear(F.gelu(leaves64[0]), *leaves64[1:])
    _close32(out.detach(), ref.detach())
    if grad:
        assert out.grad_fn.name().startswith("_GeluLinear")
        g = torch.randn(out.shape, generator=gen)
        for a, r in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves64, g.double())):
            _close32(a, r)
        assert onednn_calls == ["none", "mul"]


# --- the policy: which products run on oneDNN, chosen per machine ---------------------------------

@pytest.mark.parametrize("vendor, family, capability, expected", [
    ("AuthenticAMD", 26, "AVX512", "wide"),  # Zen 5
    ("AuthenticAMD", 25, "AVX512", "narrow"),  # Zen 4: AVX-512 in two halves
    ("AuthenticAMD", 26, "AVX2", "narrow"),
    ("GenuineIntel", 6, "AVX512", "narrow"),
    ("", 0, "DEFAULT", "narrow"),
])
def test_policy_follows_the_cpu_identity(vendor, family, capability, expected):
    assert onednn._policy_for(vendor, family, capability).name == expected


@pytest.mark.parametrize("forced", ["narrow", "wide", " Wide "])
def test_policy_can_be_forced_by_the_environment(forced, monkeypatch):
    monkeypatch.setattr(onednn, "_POLICY", None)
    monkeypatch.setenv("POLAFORMER_ONEDNN", forced)
    monkeypatch.setattr(onednn, "_cpu_identity", lambda: pytest.fail("identified although forced"))
    assert onednn.policy().name == forced.strip().lower()


def test_policy_does_not_depend_on_the_machine_load(monkeypatch):
    """Chosen without timing anything: a busy machine (every clock reading far apart) picks the same."""
    monkeypatch.delenv("POLAFORMER_ONEDNN", raising=False)
    monkeypatch.setattr(onednn, "_POLICY", None)
    quiet = onednn.policy()
    monkeypatch.setattr(onednn, "_POLICY", None)
    ticks = iter(range(0, 10**9, 10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    assert onednn.policy() is quiet and onednn.policy() is quiet
    assert onednn._policy_for(*onednn._cpu_identity(), torch.backends.cpu.get_cpu_capability()) is quiet


def test_policies_differ_in_the_sizes_they_take():
    # DeiT-T's qkv projection at batch 1: 197 x 192 -> 576 (21.8M multiply-adds)
    assert onednn.WIDE.prefers_onednn(197, 192, 576) and not onednn.NARROW.prefers_onednn(197, 192, 576)
    assert not onednn.WIDE.prefers_onednn(49, 32, 128)
    assert onednn.NARROW.prefers_onednn(392, 192, 768) and onednn.NARROW.prefers_onednn(49, 384, 1536)


# (tokens, in, out): both orientations of the weight's product, and the small ones left to MKL
WEIGHT_GRAD_SHAPES = [(197, 768, 192), (197, 192, 768), (3136, 32, 128), (392, 48, 300), (4, 512, 1024), (60, 8, 9)]


@pytest.mark.parametrize("tokens,inner,outer", WEIGHT_GRAD_SHAPES)
def test_wide_policy_weight_gradient_matches_float64(tokens, inner, outer, onednn_calls, monkeypatch):
    monkeypatch.setattr(onednn, "_POLICY", onednn.WIDE)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(tokens, inner, generator=gen), torch.randn(tokens, outer, generator=gen)
    grad_w = onednn._weight_grad(g, x)
    assert grad_w.shape == (outer, inner) and grad_w.is_contiguous()  # the layout AccumulateGrad keeps
    _close32(grad_w, g.double().t() @ x.double())
    on_onednn = tokens >= 8 and tokens * inner * outer >= onednn.WIDE.min_macs_weight_grad
    assert onednn_calls == (["none"] if on_onednn else [])


def test_wide_policy_runs_every_product_of_a_layer_on_onednn(onednn_calls, monkeypatch):
    monkeypatch.setattr(onednn, "_POLICY", onednn.WIDE)
    x, w, b = (t.requires_grad_() for t in _inputs(197, 192, 576, lead=(1,)))  # DeiT-T's qkv at batch 1
    out = linear(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b), torch.ones_like(out))
    assert onednn_calls == ["none", "none", "none"]  # forward, input gradient, weight gradient
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    out64 = F.linear(*ref)
    for a, r in zip(grads, torch.autograd.grad(out64, ref, torch.ones_like(out64))):
        _close32(a, r)


def test_weight_gradient_hands_onednn_dense_operands(onednn_calls, monkeypatch):
    """A projection fed a slice of a wider output (rows with a stride of their own) still gets the weight
    gradient right, from dense operands: oneDNN's reference code for such strides is 1000x slower."""
    monkeypatch.setattr(onednn, "_POLICY", onednn.WIDE)
    seen = []
    real = onednn._OP
    monkeypatch.setattr(onednn, "_OP", lambda *a: seen.append(a[:2]) or real(*a))
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(196, 3 * 384, generator=gen)
    x, g = wide[:, 768:], torch.randn(196, 384, generator=gen)
    grad_w = onednn._weight_grad(g, x)
    _close32(grad_w, g.double().t() @ x.double())
    assert seen and all(t.t().is_contiguous() for t in seen[0])
