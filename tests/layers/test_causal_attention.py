"""Causal self-attention layers: no token sees a later one, incremental decoding equals the parallel pass, and
nn.MultiheadAttention's is_causal path inside torch's decoder layer.

Tolerances (tests/README.md, tests/tolerances.py): float64 step by step against the parallel pass at 1e-10, far above
reorder_rtol(n, float64) for the prefix sums of at most 12 tokens x 16 channels."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from polaformer.layers import PacsCausalSelfAttention, PolaCausalSelfAttention, PolaMultiheadAttention

LAYERS = [PolaCausalSelfAttention, PacsCausalSelfAttention]


@pytest.mark.parametrize("cls", LAYERS)
def test_no_later_token_changes_an_earlier_output(cls):
    torch.manual_seed(0)
    layer = cls(16, 2, chunk_size=4)
    x = torch.randn(2, 13, 16)
    base = layer(x)
    moved = x.clone()
    moved[:, 7] += 10.0
    out = layer(moved)
    assert torch.equal(out[:, :7], base[:, :7])
    assert not torch.equal(out[:, 7], base[:, 7])


@pytest.mark.numerics
@pytest.mark.parametrize("cls", LAYERS)
def test_step_by_step_equals_the_parallel_pass(cls):
    torch.manual_seed(1)
    layer = cls(16, 2, chunk_size=4).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    full = layer(x)
    out, cache = layer.step(x[:, :5])  # a prompt through the chunked form, then one token at a time
    outs = [out]
    for t in range(5, 11):
        out, cache = layer.step(x[:, t:t + 1], cache)
        outs.append(out)
    steps = torch.cat(outs, dim=1)
    torch.testing.assert_close(steps, full, atol=1e-10, rtol=1e-10)
    assert cache.position == 11
    grad = torch.randn_like(full)
    torch.testing.assert_close(torch.autograd.grad(steps, x, grad)[0], torch.autograd.grad(full, x, grad)[0])


def test_padding_is_seen_by_no_token():
    torch.manual_seed(2)
    layer = PolaCausalSelfAttention(16, 2)
    x = torch.randn(1, 9, 16)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 3] = True
    garbage = x.clone()
    garbage[0, 3] = 50.0
    keep = [t for t in range(9) if t != 3]
    torch.testing.assert_close(layer(x, mask)[:, keep], layer(garbage, mask)[:, keep])


@pytest.mark.parametrize("feature_map", ["pola", "pacs"])
def test_multihead_is_causal_inside_torch_decoder_layer(feature_map):
    torch.manual_seed(3)
    layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = PolaMultiheadAttention(16, 2, batch_first=True, feature_map=feature_map)
    layer.eval()
    x, memory = torch.randn(2, 8, 16), torch.randn(2, 5, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(8)
    base = layer(x, memory, tgt_mask=mask, tgt_is_causal=True)
    moved = x.clone()
    moved[:, 5] += 10.0
    out = layer(moved, memory, tgt_mask=mask, tgt_is_causal=True)
    assert torch.equal(out[:, :5], base[:, :5])
    assert not torch.allclose(out[:, 5], base[:, 5])


@pytest.mark.parametrize("cls", LAYERS)
def test_triton_kernels_equal_the_torch_form_in_training_and_decoding(cls):
    """The layers through the fused Triton kernels (Triton's interpreter without CUDA; float64) equal their torch
    form: forward and every parameter's gradient with padding, and a prompt (the chunked form from an empty
    state, through the kernels) followed by a generated token."""
    from polaformer.ops.dispatch import set_attention_backend

    torch.manual_seed(4)
    layer = cls(16, 2, chunk_size=16).double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, -5:] = True
    grad = torch.randn(2, 20, 16, dtype=torch.float64)
    results = []
    for backend in ("triton", "torch"):
        previous = set_attention_backend(backend)
        try:
            out = layer(x, mask)
            grads = torch.autograd.grad(out, list(layer.parameters()), grad)
            prompt, cache = layer.step(x[:, :17])
            token, cache = layer.step(x[:, 17:18], cache)
        finally:
            set_attention_backend(previous)
        results.append((out, grads, prompt, token))
    (out, grads, prompt, token), (ref_out, ref_grads, ref_prompt, ref_token) = results
    for actual, expected in zip((out, *grads, prompt, token), (ref_out, *ref_grads, ref_prompt, ref_token)):
        torch.testing.assert_close(actual, expected, atol=1e-10, rtol=1e-10)
