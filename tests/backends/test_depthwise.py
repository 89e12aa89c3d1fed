"""polaformer.backends.cpu.conv.depthwise_conv2d: F.conv2d's values and gradients, with the weight gradient from the
native kernel where it applies (5×5 and larger, channels-last, with gradients).

Tolerances (tests/README.md, tests/tolerances.py): float64 against F.conv2d and autograd at 1e-12, far above
reorder_rtol(n, float64) for sums of at most a 9x9 window over a 33x7x9 batch (n ≤ 2,000: 4.4e-13·κ); float32 against
float64 at 1e-5 is probable_rtol of the 5x5 windows and the gate's products (n ≤ 64: 7.6e-6)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import polaformer.backends.cpu.conv as conv_mod
from polaformer import accelerate
from polaformer.backends.cpu.conv import depthwise_conv2d, plus_depthwise_conv

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64
needs_kernel = pytest.mark.skipif(conv_mod._weight_grad_kernels() is None, reason="native kernels not built here")


def _case(shape, k, dtype=F64, seed=0, channels_last=True):
    gen = torch.Generator().manual_seed(seed)
    b, c, h, w = shape
    x = torch.randn(b, c, h, w, generator=gen, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, k, k, generator=gen, dtype=dtype)
    bias = torch.randn(c, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (x, weight, bias)]


def _grads(fn, leaves, grad):
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad)


@needs_kernel
@pytest.mark.parametrize("shape,k", [((2, 5, 7, 9), 5), ((3, 19, 6, 5), 5), ((1, 33, 4, 4), 7), ((2, 3, 5, 5), 9),
                                     ((1, 8, 1, 1), 5), ((2, 17, 3, 11), 5)])
def test_native_weight_gradient_matches_autograd_in_float64(shape, k):
    leaves = _case(shape, k)
    out, grads = _grads(depthwise_conv2d, leaves, grad := torch.randn(shape, dtype=F64))
    assert out.grad_fn.name().startswith("_DepthwiseConv")
    ref, ref_grads = _grads(lambda x, w, b: F.conv2d(x, w, b, padding=k // 2, groups=shape[1]), leaves, grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@needs_kernel
def test_float32_gradients_match_float64():
    leaves = _case((4, 40, 12, 12), 5, dtype=torch.float32)
    grad = torch.randn(4, 40, 12, 12)
    _, grads = _grads(depthwise_conv2d, leaves, grad)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    _, ref = _grads(lambda x, w, b: F.conv2d(x, w, b, padding=2, groups=40), leaves64, grad.double())
    for a, r in zip(grads, ref):
        assert (a.double() - r).abs().max() <= 1e-5 * r.abs().max()


@needs_kernel
def test_weight_gradient_does_not_depend_on_the_thread_count():
    leaves = _case((4, 24, 30, 30), 5, dtype=torch.float32)
    grad = torch.randn(4, 24, 30, 30)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_grads(depthwise_conv2d, leaves, grad)[1])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0][1:], other[1:]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("case", ["3x3", "channels-first", "no gradients", "no bias", "input only"])
def test_other_calls_take_torchs_conv_or_the_kernel_as_they_should(case):
    k = 3 if case == "3x3" else 5  # a small 3×3 map stays on oneDNN
    x, w, b = _case((2, 6, 5, 5), k, channels_last=case != "channels-first")
    bias = None if case == "no bias" else b
    if case == "no gradients":
        with torch.no_grad():
            out = depthwise_conv2d(x, w, bias)
        assert out.grad_fn is None
    else:
        if case == "input only":
            w, bias = w.detach(), bias.detach()
        out = depthwise_conv2d(x, w, bias)
        native = case in ("no bias", "input only")
        assert out.grad_fn.name().startswith("_DepthwiseConv") is native
        leaves = [t for t in (x, w, bias) if t is not None and t.requires_grad]
        grad = torch.randn(out.shape, dtype=F64)
        ref = F.conv2d(x, w, bias, padding=k // 2, groups=6)
        for a, r in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, F.conv2d(x, w, bias, padding=k // 2, groups=6), rtol=0, atol=0)


@needs_kernel
def test_the_folded_identity_goes_through_the_kernel_with_the_same_gradients():
    x, w, b = _case((2, 6, 7, 7), 5)
    out = plus_depthwise_conv(x, w, b, 5, 6)
    assert out.grad_fn.name().startswith("_DepthwiseConv")
    ref = x + F.conv2d(x, w, b, padding=2, groups=6)
    grad = torch.randn(out.shape, dtype=F64)
    for a, r in zip(torch.autograd.grad(out, (x, w, b), grad), torch.autograd.grad(ref, (x, w, b), grad)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_named():
    x = torch.randn(1, 4, 5, 5)
    with pytest.raises(ValueError, match=r"depthwise weight \(C, 1, K, K\) with K odd"):
        depthwise_conv2d(x, torch.randn(4, 1, 4, 4))
    with pytest.raises(ValueError, match=r"expected a map \(B, 3, H, W\)"):
        depthwise_conv2d(x, torch.randn(3, 1, 5, 5))


@needs_kernel
def test_the_kernel_rejects_what_it_cannot_read():
    kernels = conv_mod._weight_grad_kernels()
    x = torch.randn(1, 4, 5, 5)
    with pytest.raises(RuntimeError, match="dense channels-last"):
        kernels.depthwise_weight_grad(x, x, 3)
    cl = x.contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="must be odd"):
        kernels.depthwise_weight_grad(cl, cl, 4)


@needs_kernel
def test_a_large_3x3_map_takes_the_kernel():
    x, w, b = _case((1, 16, 363, 363), 3, dtype=torch.float32)
    assert x.numel() >= conv_mod._NATIVE_MIN_3X3_ELEMENTS
    out = depthwise_conv2d(x, w, b)
    assert out.grad_fn.name().startswith("_DepthwiseConv")
    grad = torch.randn(out.shape)
    ref = F.conv2d(x, w, b, padding=1, groups=16)
    for a, r in zip(torch.autograd.grad(out, (x, w, b), grad), torch.autograd.grad(ref, (x, w, b), grad)):
        assert (a - r).abs().max() <= 1e-4 * r.abs().max()


@pytest.mark.parametrize("dtype,grad", [(F64, True), (torch.float32, False), (torch.float32, True)])
def test_depthwise_conv_gelu_linear_is_the_three_ops(dtype, grad):
    from polaformer.backends.cpu.conv import depthwise_conv_gelu_linear

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 96, 24, 24, generator=gen, dtype=dtype).contiguous(memory_format=torch.channels_last)
    cw, cb = torch.randn(96, 1, 3, 3, generator=gen, dtype=dtype), torch.randn(96, generator=gen, dtype=dtype)
    w, b = torch.randn(40, 96, generator=gen, dtype=dtype) / 10, torch.randn(40, generator=gen, dtype=dtype)
    leaves = [t.requires_grad_(grad) for t in (x, cw, cb, w, b)]
    out = depthwise_conv_gelu_linear(*leaves)
    leaves64 = [t.detach().double().requires_grad_(grad) for t in leaves]
    hidden = F.gelu(F.conv2d(leaves64[0], leaves64[1], leaves64[2], padding=1, groups=96))
    ref = F.linear(hidden.flatten(2).transpose(1, 2), leaves64[3], leaves64[4])
    tol = 1e-12 if dtype == F64 else 1e-5
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    if grad:
        g = torch.randn(out.shape, generator=gen, dtype=dtype)
        for a, r in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves64, g.double())):
            assert (a.double() - r).abs().max() <= tol * r.abs().max()


# --- Pola's local branch and gate without gradients: (out + dwc(v)) * g in one native pass ---------------

def _plain_local_branch(layer, out, v, g, prefix, h, w):
    """The layer's branch written out: the depthwise conv over the grid tokens, added, then the gate."""
    b, n, c = out.shape
    weight = torch.cat([layer.dwc.weight] * layer.num_heads)
    bias = torch.cat([layer.dwc.bias] * layer.num_heads)
    grid = v[:, prefix:].reshape(b, h, w, c).permute(0, 3, 1, 2)
    local = F.conv2d(grid, weight, bias, padding=layer.dwc.kernel_size[0] // 2, groups=c).flatten(2).transpose(1, 2)
    return torch.cat([out[:, :prefix], out[:, prefix:] + local], 1) * g


def _branch_case(dim, heads, k, prefix, grid, seed=0, dtype=F64):
    from polaformer.layers import PolaLinearAttention

    torch.manual_seed(seed)
    layer = PolaLinearAttention(dim, heads, kernel_size=k, num_prefix_tokens=prefix).to(dtype)
    n = prefix + grid[0] * grid[1]
    qkvg = torch.randn(2, n, 4 * dim, dtype=dtype)  # v and g as strided views of a projection's output
    return layer, torch.randn(2, n, dim, dtype=dtype), qkvg[..., 2 * dim:3 * dim], qkvg[..., 3 * dim:]


@needs_kernel
@pytest.mark.parametrize("dim,heads,k,prefix,grid", [
    (24, 3, 5, 0, (6, 7)), (32, 2, 5, 1, (5, 5)), (16, 4, 3, 0, (4, 9)), (12, 3, 7, 1, (3, 3)),
    (40, 2, 5, 0, (1, 1)), (96, 3, 5, 0, (9, 13)), (36, 2, 3, 1, (8, 11)), (34, 2, 5, 0, (7, 12))])
def test_fused_local_branch_matches_the_plain_ops_in_float64(dim, heads, k, prefix, grid):
    layer, out, v, g = _branch_case(dim, heads, k, prefix, grid)
    ref = _plain_local_branch(layer, out, v, g, prefix, *grid)
    with torch.no_grad():
        fused = accelerate(layer).local_branch_and_gate(out, v, g, *grid)
    assert fused is out  # the one-pass kernel writes into the attention's output
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


@needs_kernel
def test_fused_local_branch_in_float32_and_in_the_layer():
    layer, out, v, g = _branch_case(64, 2, 5, 1, (14, 14), dtype=torch.float32)
    ref = _plain_local_branch(layer.double(), out.double(), v.double(), g.double(), 1, 14, 14)
    layer = accelerate(layer.float())
    with torch.no_grad():
        assert layer.local_branch_and_gate(out, v, g, 14, 14) is out
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 197, 64)
    with torch.no_grad():
        fused = layer(x, 14, 14)
    assert not fused.requires_grad
    unfused = layer(x, 14, 14)  # with gradients the layer takes the unfused path
    assert unfused.grad_fn is not None
    torch.testing.assert_close(fused, unfused.detach(), rtol=1e-5, atol=1e-5)


def test_fused_local_branch_is_skipped_with_gradients_or_while_tracing(monkeypatch):
    layer, out, v, g = _branch_case(24, 3, 5, 0, (6, 7))
    layer = accelerate(layer)
    v.requires_grad_()
    assert layer.local_branch_and_gate(out, v, g, 6, 7) is not out
    import polaformer.acceleration as accelerated

    monkeypatch.setattr(accelerated, "capturing", lambda: True)
    with torch.no_grad():
        assert layer.local_branch_and_gate(out, v.detach(), g, 6, 7) is not out


@needs_kernel
def test_fused_local_branch_kernel_names_bad_arguments():
    from polaformer.backends.cpu.native import native_kernels

    kernels = native_kernels()
    out, v, g = torch.randn(1, 10, 8), torch.randn(1, 10, 8), torch.randn(1, 10, 8)
    taps, bias = torch.randn(9, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="token count 10 != 0 \\+ 3\\*3"):
        kernels.dwconv_add_gate(out, v, g, taps, bias, 0, 3, 3, 3)
    with pytest.raises(RuntimeError, match="must be odd"):
        kernels.dwconv_add_gate(out, v, g, taps, bias, 1, 3, 3, 2)
    with pytest.raises(RuntimeError, match=r"wt must be contiguous \(K\*K, C\)"):
        kernels.dwconv_add_gate(out, v, g, taps[:4], bias, 1, 3, 3, 3)
    with pytest.raises(RuntimeError, match="unit channel stride"):
        kernels.dwconv_add_gate(out, v.transpose(1, 2).contiguous().transpose(1, 2), g, taps, bias, 1, 3, 3, 3)


@needs_kernel
@pytest.mark.parametrize("layer_cls", ["PacsLinearAttention", "RopeSoftmaxAttention"])
@pytest.mark.parametrize("grid,channels,heads", [((7, 9), 40, 2), ((5, 6), 24, 3), ((1, 1), 16, 2)])
def test_lepe_branch_and_gate_of_the_accelerated_layers_matches_the_plain_layers(layer_cls, grid, channels, heads):
    import polaformer.layers as layers

    torch.manual_seed(0)
    plain = getattr(layers, layer_cls)(channels, heads).double()
    fast = accelerate(copy.deepcopy(plain))
    n = grid[0] * grid[1]
    qkvg = torch.randn(2, n, 4 * channels, dtype=F64)
    v, g = qkvg[..., 2 * channels:3 * channels], qkvg[..., 3 * channels:]
    out = torch.randn(2, n, channels, dtype=F64)
    ref = plain.local_branch_and_gate(out.clone(), v, g, *grid)
    with torch.no_grad():
        fused = fast.local_branch_and_gate(out.clone(), v, g, *grid)
    torch.testing.assert_close(fused, ref.detach(), rtol=1e-12, atol=1e-12)
    unfused = fast.local_branch_and_gate(out.clone(), v, g, *grid)  # with gradients: the conv, then add and gate
    assert unfused.grad_fn is not None
    torch.testing.assert_close(unfused, ref, rtol=1e-12, atol=1e-12)
