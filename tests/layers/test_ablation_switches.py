"""The ablation switches of the Pola attention layers (paper Table 3): polarity, polarity_coefficients, local.

Tolerances (tests/README.md, tests/tolerances.py): float64 fast against slow forms at 1e-10 to 1e-12, far above
reorder_rtol(n, float64) for these sums (at most a few hundred terms: 1e-13·κ)."""
import pytest
import timm
import torch
import torch.nn.functional as F

from polaformer.layers import (
    DeformableDepthwiseConv1d,
    DeformableDepthwiseConv2d,
    PolaLinearAttention,
    PolaMultiheadAttention,
    PolaSequenceAttention,
)
from polaformer.ops import naive_power_linear_attention, power_linear_attention

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

SWITCHES = [
    ({}, {"qkvg", "dwc"}),
    ({"polarity": False}, {"qkvg", "dwc"}),
    ({"polarity_coefficients": False}, {"qkv", "dwc"}),
    ({"local": "dcn"}, {"qkvg", "dcn"}),
    ({"local": "none"}, {"qkvg"}),
    ({"polarity": False, "polarity_coefficients": False, "local": "none"}, {"qkv"}),
]


@pytest.mark.parametrize("switches, modules", SWITCHES)
def test_2d_layer_shape_and_parameter_set(switches, modules):
    torch.manual_seed(0)
    layer = PolaLinearAttention(16, 2, fused_qkvg=True, num_prefix_tokens=1, kernel_size=3, **switches)
    x = torch.randn(2, 1 + 9, 16)
    out = layer(x, 3, 3)
    assert out.shape == x.shape
    out.square().sum().backward()
    roots = {name.split(".")[0] for name, _ in layer.named_parameters()}
    assert roots == modules | {"proj", "power", "scale"}
    assert [n for n, p in layer.named_parameters() if p.grad is None] == []  # nothing left unused


def test_pvt_layout_without_coefficients_has_a_query_projection():
    layer = PolaLinearAttention(16, 2, sr_ratio=2, polarity_coefficients=False)
    assert layer.q.out_features == 16 and not hasattr(layer, "qg")
    assert layer(torch.randn(1, 16, 16), 4, 4).shape == (1, 16, 16)


def test_switched_off_gate_and_branch_are_what_the_output_loses():
    torch.manual_seed(1)
    full = PolaLinearAttention(16, 2, kernel_size=3).double()
    plain = PolaLinearAttention(16, 2, kernel_size=3, polarity_coefficients=False, local="none").double()
    with torch.no_grad():
        plain.q.weight.copy_(full.qg.weight[:16])
        plain.q.bias.copy_(full.qg.bias[:16])
        for name in ("kv", "proj"):
            getattr(plain, name).load_state_dict(getattr(full, name).state_dict())
        # a zero depthwise conv and a gate of exactly one make the full layer the plain one
        full.dwc.weight.zero_()
        full.dwc.bias.zero_()
        full.qg.weight[16:].zero_()
        full.qg.bias[16:].fill_(1.0)
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(plain(x, 4, 4), full(x, 4, 4), rtol=0, atol=1e-12)


@pytest.mark.parametrize("model", ["pola_deit_digits", "pola_pvt_v2_b0"])
def test_default_switches_are_the_official_model(model):
    kwargs = {} if model == "pola_deit_digits" else {"img_size": 32, "num_classes": 5, "depths": (1, 1, 1, 1)}
    torch.manual_seed(0)
    plain = timm.create_model(model, **kwargs).eval()
    torch.manual_seed(0)
    explicit = timm.create_model(model, polarity=True, polarity_coefficients=True, local="dwc", **kwargs).eval()
    assert list(plain.state_dict()) == list(explicit.state_dict())
    x = torch.randn(2, *plain.pretrained_cfg["input_size"][:1], *(8, 8) if model == "pola_deit_digits" else (32, 32))
    with torch.no_grad():
        assert torch.equal(plain(x), explicit(x))


@pytest.mark.parametrize("model", ["pola_deit_digits", "pola_swin_t", "pola_pvt_tiny", "pola_pvt_v2_b0"])
def test_every_pola_family_takes_the_switches(model):
    kwargs = {} if model == "pola_deit_digits" else {"img_size": 64, "num_classes": 3, "depths": (1, 1, 1, 1)}
    if model == "pola_swin_t":
        kwargs.update(window_size=2)
    net = timm.create_model(model, polarity=False, polarity_coefficients=False, local="dcn", **kwargs)
    attentions = [m for m in net.modules() if isinstance(m, PolaLinearAttention)]
    assert attentions and all(not a.polarity and hasattr(a, "dcn") and not hasattr(a, "dwc") for a in attentions)


def test_power_linear_attention_equals_its_naive_reference_in_float64():
    torch.manual_seed(2)
    q, k = torch.randn(2, 2, 7, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    power = (1 + 2 * torch.rand(1, 2, 1, 4, dtype=torch.float64))
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for key_padding_mask in (None, mask):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, power)]
        reference = [t.clone().requires_grad_() for t in (q, k, v, power)]
        fast = power_linear_attention(*inputs, key_padding_mask=key_padding_mask)
        slow = naive_power_linear_attention(*reference, key_padding_mask=key_padding_mask)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
        grad = torch.randn_like(fast)
        fast.backward(grad)
        slow.backward(grad)
        for a, b in zip(inputs, reference):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_power_linear_attention_only_sees_positive_parts():
    q, k, v = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)
    out = power_linear_attention(q, k, v, 2.0)
    torch.testing.assert_close(out, power_linear_attention(q.relu(), k.relu(), v, 2.0))


def test_dcn_at_zero_offsets_is_the_plain_depthwise_conv_in_float64():
    torch.manual_seed(3)
    conv2d = DeformableDepthwiseConv2d(4, 3).double()
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64)
    expected = F.conv2d(x, conv2d.conv.weight, conv2d.conv.bias, padding=1, groups=4)
    torch.testing.assert_close(conv2d(x), expected, rtol=0, atol=1e-12)

    conv1d = DeformableDepthwiseConv1d(4, 5).double()
    s = torch.randn(2, 4, 9, dtype=torch.float64)
    expected = F.conv1d(s, conv1d.conv.weight[:, :, 0], conv1d.conv.bias, padding=2, groups=4)
    torch.testing.assert_close(conv1d(s), expected, rtol=0, atol=1e-12)


def test_dcn_layer_at_zero_offsets_equals_the_dwc_layer_in_float64():
    torch.manual_seed(4)
    dwc = PolaLinearAttention(16, 2, kernel_size=3, fused_qkvg=True, num_prefix_tokens=1).double()
    dcn = PolaLinearAttention(16, 2, kernel_size=3, fused_qkvg=True, num_prefix_tokens=1, local="dcn").double()
    state = {k: v for k, v in dwc.state_dict().items() if not k.startswith("dwc.")}
    state.update({"dcn.conv.weight": dwc.dwc.weight, "dcn.conv.bias": dwc.dwc.bias,
                  "dcn.offset.weight": dcn.dcn.offset.weight, "dcn.offset.bias": dcn.dcn.offset.bias})
    dcn.load_state_dict(state)
    x = torch.randn(2, 17, 16, dtype=torch.float64)
    torch.testing.assert_close(dcn(x, 4, 4), dwc(x, 4, 4), rtol=0, atol=1e-12)


@pytest.mark.parametrize("switches", [{"polarity": False}, {"polarity_coefficients": False}, {"local": "dcn"},
                                      {"local": "none"}])
def test_sequence_layer_switches_keep_padding_exact(switches):
    torch.manual_seed(5)
    layer = PolaSequenceAttention(16, 2, kernel_size=3, **switches).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    out = layer(x, key_padding_mask=mask)
    torch.testing.assert_close(out[1, :5], layer(x[1:, :5])[0], rtol=1e-9, atol=1e-12)
    names = {name.split(".")[0] for name, _ in layer.named_parameters()}
    assert ("qg" in names) == switches.get("polarity_coefficients", True)
    assert ("q" in names) != switches.get("polarity_coefficients", True)
    assert {"dwc", "dcn"} & names == ({switches.get("local", "dwc")} - {"none"})


def test_multihead_wrapper_passes_the_switches():
    mha = PolaMultiheadAttention(16, 2, batch_first=True, polarity=False, local="none")
    assert not mha.attn.polarity and not hasattr(mha.attn, "dcn") and mha.attn.dwc is None
    x = torch.randn(1, 4, 16)
    assert mha(x, x, x)[0].shape == x.shape


@pytest.mark.parametrize("bad, message", [({"local": "conv"}, "local must be one of"),
                                          ({"polarity": "yes"}, "polarity must be True or False")])
def test_bad_switch_values_are_one_line_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        PolaLinearAttention(16, 2, **bad)
    with pytest.raises(ValueError, match=message):
        PolaSequenceAttention(16, 2, **bad)
