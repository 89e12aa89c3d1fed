"""Sequence attention layers: padding invariance, cross-attention, agreement with the grid layers, the MHA drop-in.

Tolerances (tests/README.md, tests/tolerances.py): float64 at 1e-12, far above reorder_rtol(n, float64) for these
sums; float32 padded against alone at 1e-6 (the encoder: 1e-5): padding adds exact zeros to every sum, so only the
blocking of the longer sums differs, probable_rtol of at most 23 keys x 32 channels (7e-6 at n = 736 for the encoder's
two layers, 1e-6 of the attention's own sums of 23 terms x 8 channels at the magnitudes of these normalised outputs)."""
import pytest
import torch
from torch import nn

from polaformer.layers import (
    GATE_INITS,
    PacsLinearAttention,
    PacsSequenceAttention,
    PolaLinearAttention,
    PolaMultiheadAttention,
    PolaSequenceAttention,
)
from polaformer.ops import rope_2d, rope_angles

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

LAYERS = {"pola": PolaSequenceAttention, "pacs": PacsSequenceAttention}


def randomize(module, seed=0):
    """Non-trivial values for the zero-initialised parameters (power, scale, temperatures, biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.rsplit(".", 1)[-1] in ("power", "scale", "s1", "s2", "bias"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


def pad_batch(seqs, side="right", junk=5.0):
    longest = max(s.shape[0] for s in seqs)
    batch = torch.full((len(seqs), longest, seqs[0].shape[-1]), junk)
    mask = torch.ones(len(seqs), longest, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = s.shape[0]
        sl = slice(0, n) if side == "right" else slice(longest - n, longest)
        batch[i, sl], mask[i, sl] = s, False
    return batch, mask


@pytest.mark.parametrize("kind", ["pola", "pacs"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_gives_each_sequence_its_unpadded_output(kind, side):
    layer = randomize(LAYERS[kind](32, 4, kernel_size=5)).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, 32, generator=gen) for n in (23, 3, 11)]
    batch, mask = pad_batch(seqs, side)
    out = layer(batch, key_padding_mask=mask)
    for i, s in enumerate(seqs):
        alone = layer(s[None])[0]
        torch.testing.assert_close(out[i][~mask[i]], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["pola", "pacs"])
def test_cross_attention_with_padded_context(kind):
    layer = randomize(LAYERS[kind](16, 2, kdim=12, vdim=12), seed=2).eval()
    gen = torch.Generator().manual_seed(3)
    queries = torch.randn(2, 7, 16, generator=gen)
    contexts = [torch.randn(n, 12, generator=gen) for n in (9, 4)]
    context, mask = pad_batch(contexts)
    out = layer(queries, context, key_padding_mask=mask)
    assert out.shape == (2, 7, 16)
    for i, c in enumerate(contexts):
        torch.testing.assert_close(out[i], layer(queries[i : i + 1], c[None])[0], rtol=1e-6, atol=1e-6)


def test_separate_key_and_value_inputs_use_the_two_weight_halves():
    layer = randomize(PolaSequenceAttention(8, 2), seed=4).double()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, 8, generator=gen, dtype=torch.float64) for n in (5, 6, 6))
    # one projection of a shared key/value input == the two halves applied separately
    torch.testing.assert_close(layer(q, k, k.clone()), layer(q, k), rtol=1e-12, atol=1e-12)
    # the value input only reaches the output through the value half
    assert not torch.allclose(layer(q, k, v), layer(q, k))


def test_pola_sequence_layer_equals_the_grid_layer_on_a_one_row_grid():
    """On a 1×N grid the official 5×5 depthwise conv only uses its middle kernel row."""
    grid = randomize(PolaLinearAttention(32, 4, kernel_size=5), seed=6).double().eval()
    seq = PolaSequenceAttention(32, 4, kernel_size=5).double().eval()
    state = dict(grid.state_dict())
    state["dwc.weight"] = state["dwc.weight"][:, :, 2, :]
    seq.load_state_dict(state)
    x = torch.randn(2, 19, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(seq(x), grid(x, 1, 19), rtol=1e-12, atol=1e-12)


def test_pacs_sequence_layer_equals_the_grid_layer_without_rotation():
    grid = randomize(PacsLinearAttention(16, 2), seed=8).double().eval()
    seq = PacsSequenceAttention(16, 2, kernel_size=5).double().eval()
    q, k, v, g = grid.qkvg.weight.chunk(4)
    bq, bk, bv, bg = grid.qkvg.bias.chunk(4)
    seq.load_state_dict({
        "qg.weight": torch.cat([q, g]), "qg.bias": torch.cat([bq, bg]),
        "kv.weight": torch.cat([k, v]), "kv.bias": torch.cat([bk, bv]),
        "dwc.weight": grid.lepe.weight[:, :, 2, :], "dwc.bias": grid.lepe.bias,
        "proj.weight": grid.proj.weight, "proj.bias": grid.proj.bias, "s1": grid.s1, "s2": grid.s2,
    })
    x = torch.randn(2, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    sin, cos = rope_2d(rope_angles(32, 2, dtype=torch.float64), 1, 13)
    identity = (torch.zeros_like(sin), torch.ones_like(cos))  # RoPE off: rotation by 0
    expected = grid(x.transpose(1, 2).reshape(2, 16, 1, 13), *identity).reshape(2, 16, 13).transpose(1, 2)
    torch.testing.assert_close(seq(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(GATE_INITS))
def test_gate_initialisations(name):
    layer = PolaSequenceAttention(16, 2, gate_init=name)
    gate = layer.qg.weight[16:]
    if name == "zeros":
        assert (gate == 0).all()
    elif name == "ones":
        assert (gate == 1).all()
    elif name == "uniform":
        assert gate.min() >= 0 and gate.max() <= 1 and gate.std() > 0.2
    elif name == "normal":
        assert 0.8 < gate.std() < 1.2
    else:  # nn.Linear's default: |w| <= 1/sqrt(fan_in)
        assert gate.abs().max() <= 16**-0.5
    # the query half keeps nn.Linear's default
    assert layer.qg.weight[:16].abs().max() <= 16**-0.5
    out = layer(torch.randn(2, 5, 16))
    out.sum().backward()
    assert layer.power.grad is not None and torch.isfinite(layer.power.grad).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dim=12, num_heads=4), "must be even"),
        (dict(dim=10, num_heads=4), "not divisible"),
        (dict(dim=16, num_heads=2, kernel_size=4), "odd"),
        (dict(dim=16, num_heads=2, gate_init="xavier"), "unknown gate_init"),
    ],
)
def test_bad_construction_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolaSequenceAttention(**kwargs)


def test_bad_inputs_raise_one_line_errors():
    layer = PolaSequenceAttention(16, 2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"query must be \(batch, tokens, 16\)"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"\(batch, keys\) = \(2, 5\)"):
        layer(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="only hold 0 and -inf"):
        layer(x, key_padding_mask=torch.randn(2, 5))
    with pytest.raises(ValueError, match="value must be"):
        layer(x, torch.randn(2, 6, 16), torch.randn(2, 5, 16))


# --- the nn.MultiheadAttention drop-in -------------------------------------------------------

@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("feature_map", ["pola", "pacs"])
def test_multihead_wrapper_matches_the_layer(batch_first, feature_map):
    mha = randomize(PolaMultiheadAttention(16, 2, batch_first=batch_first, feature_map=feature_map), seed=10).eval()
    x = torch.randn(3, 7, 16)  # (B, N, E)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 4:] = True
    inp = x if batch_first else x.transpose(0, 1)
    out, weights = mha(inp, inp, inp, key_padding_mask=mask)
    assert weights is None
    out = out if batch_first else out.transpose(0, 1)
    torch.testing.assert_close(out, mha.attn(x, key_padding_mask=mask))
    # a float mask with -inf at padding means the same
    float_mask = torch.zeros(3, 7).masked_fill(mask, float("-inf"))
    torch.testing.assert_close(mha(inp, inp, inp, key_padding_mask=float_mask)[0], mha(inp, inp, inp, mask)[0])
    # unbatched (L, E) input
    single, _ = mha(x[0], x[0], x[0])  # three view objects of the same data: still self-attention
    torch.testing.assert_close(single, mha.attn(x[:1])[0])


def test_multihead_wrapper_cross_attention_and_refusals():
    mha = PolaMultiheadAttention(16, 2, kdim=6, vdim=10, batch_first=True)
    out, _ = mha(torch.randn(2, 3, 16), torch.randn(2, 9, 6), torch.randn(2, 9, 10))
    assert out.shape == (2, 3, 16)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        PolaMultiheadAttention(16, 2)(x, x, x, attn_mask=torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs self-attention"):
        mha(torch.randn(2, 3, 16), torch.randn(2, 9, 6), torch.randn(2, 9, 10), is_causal=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        PolaMultiheadAttention(16, 2, add_bias_kv=True)


@pytest.mark.parametrize("train", [True, False])
def test_drop_in_for_transformer_encoder_with_padding(train):
    """Swap the attention of torch's own encoder: padded batches keep every sequence's output."""
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer.self_attn = PolaMultiheadAttention(32, 4, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train(train)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randn(n, 32, generator=gen) for n in (12, 5)]
    batch, mask = pad_batch(seqs)
    out = encoder(batch, src_key_padding_mask=mask)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i, : len(s)], encoder(s[None])[0], rtol=1e-5, atol=1e-5)
    if train:
        out.sum().backward()
        assert all(p.grad is not None for p in encoder.layers[0].self_attn.parameters())


def test_drop_in_for_transformer_decoder_cross_attention():
    layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = PolaMultiheadAttention(16, 2, batch_first=True)
    layer.multihead_attn = PolaMultiheadAttention(16, 2, batch_first=True)
    memory, mask = pad_batch([torch.randn(8, 16), torch.randn(3, 16)])
    out = layer(torch.randn(2, 4, 16), memory, memory_key_padding_mask=mask)
    assert out.shape == (2, 4, 16) and torch.isfinite(out).all()
