"""Shortcuts of the fast paths (layouts, cached tables, the blocked no-gradient forward): same values as the plain
forms, never stale.

Tolerances (tests/README.md, tests/tolerances.py): float64 forms of one computation added in other orders agree to
reorder_rtol(n, float64)·κ = 2.2e-16·n·κ; the sums here have at most 64 terms (24 channels x a 3x3 conv, 23 keys x 4
channels), so 1e-13 allows κ up to 7 and 1e-12 (the blocked op, a quotient of two such sums) κ up to 70. The float32
PaCS forms at exponents up to 87 carry each feature's rounding (87 + 1)·u = 5e-6, then sums of 20 keys and 16
channels: about 9e-6·κ, so 1e-4 allows κ (RoPE's mixed-sign numerator) up to 10."""
import copy

import pytest
import torch
from timm.models.pvt_v2 import MlpWithDepthwiseConv

from polaformer import accelerate
from polaformer.layers import RoPE2d
from polaformer.models.pvt_v2 import DepthwiseConvMlp
from polaformer.ops import (
    naive_pacs_linear_attention,
    pacs_linear_attention,
    pola_linear_attention,
    rope_2d,
    rope_angles,
    tokens_to_map,
)
from polaformer.ops.pacs.autograd import _ROPE_TABLE_CACHE

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64


@pytest.mark.parametrize("batch", [1, 3])
def test_tokens_to_map_is_a_canonical_channels_last_view(batch):
    tokens = torch.randn(batch, 4 * 5, 6)
    grid = tokens_to_map(tokens, 4, 5)
    torch.testing.assert_close(grid, tokens.transpose(1, 2).reshape(batch, 6, 4, 5), rtol=0, atol=0)
    assert grid.data_ptr() == tokens.data_ptr()
    # the batch stride is H·W·C even for a batch of one: oneDNN reads anything else as channels-first
    assert grid.stride() == (4 * 5 * 6, 1, 5 * 6, 6)


def test_depthwise_conv_mlp_equals_timms():
    torch.manual_seed(0)
    theirs = MlpWithDepthwiseConv(8, 24).double()
    ours = DepthwiseConvMlp(8, 24).double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for batch, model in ((1, ours), (2, ours), (1, accelerate(copy.deepcopy(ours))), (2, ours)):
        x = torch.randn(batch, 5 * 7, 8, dtype=F64, requires_grad=True)
        a, b = model(x, 5, 7), theirs(x, [5, 7])
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
        ga, gb = torch.autograd.grad(a.square().sum(), x), torch.autograd.grad(b.square().sum(), x)
        torch.testing.assert_close(ga, gb, rtol=1e-13, atol=1e-14)


def _pacs_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=gen, dtype=F64) for _ in range(3))
    temps = torch.rand(2, 1, 2, 1, 8, generator=gen, dtype=F64).unbind(0)
    return q, k, v, temps


def test_rope_tables_modified_in_place_are_not_served_from_the_cache():
    q, k, v, (t_same, t_opp) = _pacs_inputs(0)
    sin, cos = rope_2d(rope_angles(16, 2, dtype=F64), 3, 4)
    first = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    assert any(ref() is sin for ref, _, _, _ in _ROPE_TABLE_CACHE.values())
    torch.testing.assert_close(first, naive_pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos))
    with torch.no_grad():
        sin.mul_(-0.5)
        cos.add_(0.25)
    second = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    torch.testing.assert_close(second, naive_pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos))
    assert not torch.allclose(first, second)


def test_rope_tables_made_in_inference_mode_serve_training_too():
    q, k, v, (t_same, t_opp) = _pacs_inputs(1)
    rope = RoPE2d(16, 2).double()
    with torch.inference_mode():
        sin, cos = rope(3, 4)
        pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    assert not sin.is_inference()
    q.requires_grad_()
    sin_again, cos_again = rope(3, 4)
    assert sin_again is sin  # kept per grid
    out = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    ref = naive_pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, q, grad)[0], torch.autograd.grad(ref, q, grad)[0])


def test_rope_module_tables_follow_the_angle_buffer_and_the_grid():
    rope = RoPE2d(16, 2)
    sin, cos = rope(3, 4)
    assert rope(3, 4)[0] is sin
    assert rope(4, 3)[0].shape == (12, 8) and rope(4, 3)[0] is not sin
    state = {"angle": rope.angle * 2}
    rope.load_state_dict(state)  # an in-place copy into the buffer: new version, new tables
    new_sin, new_cos = rope(3, 4)
    expected_sin, expected_cos = rope_2d(state["angle"], 3, 4)
    torch.testing.assert_close(new_sin, expected_sin, rtol=0, atol=0)
    torch.testing.assert_close(new_cos, expected_cos, rtol=0, atol=0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("keys", [23, 9])
def test_blocked_forward_without_gradients_equals_the_reference(monkeypatch, masked, keys):
    import polaformer.ops._common as op
    from polaformer.ops import learnable_power, naive_pola_linear_attention

    monkeypatch.setattr(op, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(op, "MIN_BLOCK_TOKENS", 5)  # blocks of 5 tokens, the last one short
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 17, 4, generator=gen, dtype=F64)
    k, v = torch.randn(2, 3, keys, 4, generator=gen, dtype=F64), torch.randn(2, 3, keys, 6, generator=gen, dtype=F64)
    power = learnable_power(torch.randn(1, 3, 1, 4, generator=gen, dtype=F64), 3.0)
    mask = None
    if masked:
        mask = torch.zeros(2, keys, dtype=torch.bool)
        mask[0, keys - 4:] = True
    ref = naive_pola_linear_attention(q, k, v, power, key_padding_mask=mask)
    with torch.no_grad():
        blocked = pola_linear_attention(q, k, v, power, key_padding_mask=mask)
    torch.testing.assert_close(blocked, ref, rtol=1e-12, atol=1e-13)
    # the one-block path with gradients gives the same values
    q.requires_grad_()
    torch.testing.assert_close(pola_linear_attention(q, k, v, power, key_padding_mask=mask), blocked,
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("masked", [False, True])
def test_blocked_pacs_forward_without_gradients_redoes_an_overflow_in_the_log_domain(monkeypatch, masked):
    import polaformer.ops._common as op

    monkeypatch.setattr(op, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(op, "MIN_BLOCK_TOKENS", 5)  # 20 tokens: blocks of 5
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 20, 8, generator=gen)
    # features up to e^87 in one token of one block: float32 sums of products overflow outside the log domain
    q[:, :, 11] = q[:, :, 11].sign() * (80 + 7 * torch.rand(2, 2, 8, generator=gen))
    k, v = torch.randn(2, 2, 20, 8, generator=gen), torch.randn(2, 2, 20, 8, generator=gen)
    t_same = t_opp = torch.ones(1, 2, 1, 16)
    sin, cos = rope_2d(rope_angles(32, 2), 4, 5)
    mask = None
    if masked:
        mask = torch.zeros(2, 20, dtype=torch.bool)
        mask[1, 13:] = True
    with torch.no_grad():
        blocked = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos, key_padding_mask=mask)
    ref = naive_pacs_linear_attention(*(t.double() for t in (q, k, v, t_same, t_opp, sin, cos)),
                                      key_padding_mask=mask)
    assert torch.isfinite(blocked).all()
    torch.testing.assert_close(blocked.double(), ref, rtol=1e-4, atol=1e-5)
    grad_path = pacs_linear_attention(q.requires_grad_(), k, v, t_same, t_opp, sin, cos, key_padding_mask=mask)
    torch.testing.assert_close(grad_path.detach(), blocked, rtol=1e-4, atol=1e-5)  # both float32: the same bound


@pytest.mark.parametrize("prefix, fused", [(0, False), (1, True)])
def test_pola_layer_gates_in_place_only_without_autograd(prefix, fused):
    from polaformer.layers import PolaLinearAttention

    torch.manual_seed(0)
    layer = accelerate(PolaLinearAttention(8, 2, fused_qkvg=fused, num_prefix_tokens=prefix).double())
    x = torch.randn(2, prefix + 4 * 5, 8, dtype=F64)
    with torch.no_grad():
        fast = layer(x, 4, 5)
    plain = layer(x.requires_grad_(), 4, 5)  # autograd: out-of-place
    # (not bit-equal: the no-gradient forward forms the normalisers in its feature pass, not in the product)
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-13, atol=1e-15)
    plain.square().sum().backward()  # the tensors autograd saved were not overwritten
    assert torch.isfinite(x.grad).all()


def test_pacs_layer_gates_in_place_only_without_autograd():
    from polaformer.layers import PacsLinearAttention

    torch.manual_seed(1)
    layer = accelerate(PacsLinearAttention(8, 2).double())
    sin, cos = RoPE2d(16, 2).double()(3, 4)
    x = torch.randn(2, 8, 3, 4, dtype=F64)
    with torch.no_grad():
        fast = layer(x, sin, cos)
    plain = layer(x.requires_grad_(), sin, cos)
    torch.testing.assert_close(fast, plain.detach(), rtol=1e-13, atol=1e-15)  # as the Pola layer's above
    plain.square().sum().backward()
    assert torch.isfinite(x.grad).all()
