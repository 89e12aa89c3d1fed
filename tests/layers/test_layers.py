"""Attention layers: RoPE tables, gradients, prefix tokens, input checks.

Their outputs against the official vectors are checked in test_compat.py."""
import pytest
import torch

from conftest import load_vector
from polaformer.compat import from_official
from polaformer.layers import PacsLinearAttention, PolaLinearAttention, RoPE2d, RopeSoftmaxAttention


@pytest.mark.parametrize("case", ["attn_polapp", "attn_polapp_vanilla"])
def test_rope_tables_equal_official(case):
    record, tensors = load_vector(case)
    rope = RoPE2d(record["rope"]["embed_dim"], record["rope"]["num_heads"])
    assert torch.equal(rope.angle.double(), tensors["rope_angle"].double())
    sin, cos = rope.double()(*record["rope"]["slen"])
    assert torch.equal(sin, tensors["sin"]) and torch.equal(cos, tensors["cos"])


def test_pvt_attention_backward_reaches_every_parameter():
    attn = PolaLinearAttention(32, 2, sr_ratio=2, key_pos_tokens=16)
    out = attn(torch.randn(2, 64, 32), 8, 8)
    out.square().mean().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_prefix_tokens_skip_the_conv_branch():
    attn = PolaLinearAttention(16, 2, fused_qkvg=True, num_prefix_tokens=1).eval()
    x = torch.randn(1, 1 + 9, 16)
    with torch.no_grad():
        out = attn(x, 3, 3)
        # zeroing the conv leaves the class token's output unchanged but not the patches'
        attn.dwc.weight.zero_()
        attn.dwc.bias.zero_()
        out_no_conv = attn(x, 3, 3)
    torch.testing.assert_close(out[:, 0], out_no_conv[:, 0])
    assert not torch.allclose(out[:, 1:], out_no_conv[:, 1:])


def test_bad_inputs_raise_value_errors_naming_the_problem():
    with pytest.raises(ValueError, match="at least 2"):
        PolaLinearAttention(30, 30)  # head_dim 1: no second stream (the official torch.chunk fails too)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        PolaLinearAttention(32, 3)
    attn = PolaLinearAttention(32, 2, sr_ratio=2)
    with pytest.raises(ValueError, match="token count"):
        attn(torch.randn(1, 60, 32), 8, 8)
    with pytest.raises(ValueError, match=r"\(B, N, 32\)"):
        attn(torch.randn(1, 64, 16), 8, 8)
    with pytest.raises(ValueError, match="1x3 is smaller than the spatial reduction ratio 2"):
        attn(torch.randn(1, 3, 32), 1, 3)
    pp = PacsLinearAttention(32, 2)
    sin, cos = RoPE2d(64, 2)(4, 4)
    with pytest.raises(ValueError, match=r"\(B, 32, H, W\)"):
        pp(torch.randn(1, 16, 4, 4), sin, cos)
    with pytest.raises(ValueError, match="RoPE tables"):
        RopeSoftmaxAttention(32, 2)(torch.randn(1, 32, 5, 4), *RoPE2d(32, 2)(4, 4))


def test_from_official_rejects_unknown_classes():
    with pytest.raises(ValueError, match="no equivalent"):
        from_official({"family": "pvt", "official_class": "Nope", "constructor": {}})
    with pytest.raises(ValueError, match="lacks the field"):
        from_official({"family": "pvt"})


def test_key_positional_table_resamples_to_other_grids():
    attn = PolaLinearAttention(16, 2, key_pos_tokens=16).eval()  # trained on a 4x4 grid
    with torch.no_grad():
        same = attn(torch.randn(1, 16, 16), 4, 4)
        other = attn(torch.randn(1, 48, 16), 6, 8)
        # a constant table stays constant when resampled: the result equals that of a table of the new size
        attn.positional_encoding.fill_(0.3)
        x = torch.randn(1, 48, 16)
        wide = PolaLinearAttention(16, 2, key_pos_tokens=48).eval()
        wide.load_state_dict({**attn.state_dict(), "positional_encoding": torch.full((1, 48, 16), 0.3)})
        wide.key_pos_grid = (6, 8)
        torch.testing.assert_close(attn(x, 6, 8), wide(x, 6, 8))
    assert same.shape == (1, 16, 16) and other.shape == (1, 48, 16)
