"""The windowed softmax op (Swin's softmax windows) against the plain formula, in float64.

Tolerances (tests/README.md, tests/tolerances.py): float64 against the plain formula at 1e-12, above reorder_rtol(n,
float64)·κ for the softmax sums and products here (at most 49 tokens x 24 channels: n = 1,176, 2.6e-13·κ) for
conditions up to 4, which a softmax's normalised, same-sign weights keep."""
import pytest
import torch
import torch.nn.functional as F

import polaformer.ops.window_softmax as ws
from polaformer.layers import WindowAttention
from polaformer.ops import window_softmax_attention

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default


def _reference(q, k, v, bias, scale):
    logits = scale * q @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias.repeat(q.shape[0] // bias.shape[0], 1, 1, 1)
    return logits.softmax(-1) @ v


def _inputs(b=8, h=3, n=49, d=16, groups=4, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(groups, h, n, n, generator=g, dtype=torch.float64) if groups else None
    tensors = [q, k, v] + ([bias] if bias is not None else [])
    for t in tensors:
        t.requires_grad_(grad)
    return q, k, v, bias


@pytest.mark.parametrize("groups", [0, 1, 4, 8])
def test_forward_and_backward_match_the_formula(groups):
    q, k, v, bias = _inputs(groups=groups)
    out = window_softmax_attention(q, k, v, bias, 0.3)
    ref = _reference(q, k, v, bias, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    inputs = [t for t in (q, k, v, bias) if t is not None]
    for a, b in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_without_gradients_the_bias_is_left_unchanged_and_masked_pairs_get_zero_weight():
    q, k, v, bias = _inputs(grad=False)
    bias[:, :, :, 5] = float("-inf")  # no query may look at key 5
    kept = bias.clone()
    with torch.no_grad():
        out = window_softmax_attention(q, k, v, bias, 0.3)
    assert torch.equal(bias, kept)
    v_changed = v.clone()
    v_changed[:, :, 5] += 100.0
    with torch.no_grad():
        torch.testing.assert_close(window_softmax_attention(q, k, v_changed, bias, 0.3), out, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, _reference(q, k, v, bias, 0.3), rtol=1e-12, atol=1e-12)


def test_default_scale_and_wider_values():
    q, k, _, bias = _inputs(grad=False)
    v = torch.randn(8, 3, 49, 24, dtype=torch.float64)
    torch.testing.assert_close(window_softmax_attention(q, k, v, bias), _reference(q, k, v, bias, 16 ** -0.5),
                               rtol=1e-12, atol=1e-12)


def test_cpu_eager_calls_skip_sdpa_and_the_rest_take_it(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(ws.F, "scaled_dot_product_attention", spy)
    q, k, v, bias = _inputs(grad=False)
    window_softmax_attention(q, k, v, bias, 0.3)
    assert calls == []
    # active dropout and windows beyond the size limit go to SDPA, with the bias repeated per window
    window_softmax_attention(q, k, v, bias, 0.3, dropout_p=0.5)
    monkeypatch.setattr(ws, "_MAX_EXPLICIT_TOKENS", 16)
    out = window_softmax_attention(q, k, v, bias, 0.3)
    assert len(calls) == 2 and all(mask.shape == (8, 3, 49, 49) for mask in calls)
    torch.testing.assert_close(out, _reference(q, k, v, bias, 0.3), rtol=1e-12, atol=1e-12)


def test_without_a_bias_many_long_windows_take_sdpa(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(ws.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    q, k, v, _ = _inputs(b=2, h=2, n=100, groups=0, grad=False)  # 40k logits
    window_softmax_attention(q, k, v)
    assert calls == []
    monkeypatch.setattr(ws, "_MAX_EXPLICIT_LOGITS_WITHOUT_BIAS", 30_000)
    out = window_softmax_attention(q, k, v)
    assert calls == [1]
    torch.testing.assert_close(out, _reference(q, k, v, None, 16 ** -0.5), rtol=1e-12, atol=1e-12)
    q, k, v, _ = _inputs(b=20, h=2, n=49, groups=0, grad=False)  # short windows stay explicit at any count
    window_softmax_attention(q, k, v)
    assert calls == [1]


def test_bad_shapes_are_named():
    q, k, v, bias = _inputs(grad=False)
    with pytest.raises(ValueError, match="G dividing the 8 windows"):
        window_softmax_attention(q, k, v, bias[:3], 0.3)
    with pytest.raises(ValueError, match=r"bias must be \(G, 3, 49, 49\)"):
        window_softmax_attention(q, k, v, bias[..., :48], 0.3)
    with pytest.raises(ValueError, match="q, k, v must be"):
        window_softmax_attention(q, k[:, :, :48], v, bias, 0.3)


def test_layer_rejects_a_window_count_that_is_not_whole_images():
    layer = WindowAttention(12, 4, 3)
    with pytest.raises(ValueError, match="not a whole number of images"):
        layer(torch.randn(6, 16, 12), mask=torch.zeros(4, 16, 16))


def test_layer_matches_sdpa_with_the_mask_repeated_per_image():
    torch.manual_seed(0)
    layer = WindowAttention(12, 4, 3).double()
    x = torch.randn(8, 16, 12, dtype=torch.float64)
    mask = torch.zeros(4, 16, 16, dtype=torch.float64).masked_fill(torch.rand(4, 16, 16) < 0.3, float("-inf"))
    mask.diagonal(dim1=1, dim2=2).zero_()  # every row keeps its own token
    b_, n, c = x.shape
    q, k, v = layer.qkv(x).reshape(b_, n, 3, 3, 4).permute(2, 0, 3, 1, 4)
    bias = layer.relative_position_bias().unsqueeze(0) + mask.unsqueeze(1).repeat(2, 1, 1, 1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=layer.scale)
    ref = layer.proj(ref.transpose(1, 2).reshape(b_, n, c))
    torch.testing.assert_close(layer(x, mask), ref, rtol=1e-12, atol=1e-12)
