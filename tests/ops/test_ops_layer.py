"""``pola_layer_attention`` and ``pacs_layer_attention`` (the layers' raw parameters, key positions, local branch
and gate around the attention) on the CPU paths against their float64 references, forward and every gradient,
causal forms included; and one-line errors for arguments that do not fit. The Triton path is
tests/backends/triton/test_layer_ops.py."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import (
    naive_pacs_layer_attention,
    naive_pola_layer_attention,
    pacs_layer_attention,
    pola_layer_attention,
)
from polaformer.ops.dispatch import set_attention_backend


def _leaves(**shapes):
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()
            for name, shape in shapes.items()}


def _assert_matches(op, reference, tensors, **options):
    out = op(**tensors, **options)
    expected = reference(**tensors, **options)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    names = list(tensors)
    for name, got, want in zip(names, torch.autograd.grad(out, list(tensors.values()), grad),
                               torch.autograd.grad(expected, list(tensors.values()), grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.fixture(params=["native", "torch"])
def cpu_backend(request):
    previous = set_attention_backend(request.param)
    yield request.param
    set_attention_backend(previous)


@pytest.mark.parametrize("causal", [False, True])
def test_pola_layer_op_matches_reference(cpu_backend, causal):
    tensors = _leaves(q=(2, 2, 9, 6), k=(2, 2, 9, 6), v=(2, 2, 9, 5), scale=(1, 2, 1, 6), power=(1, 2, 1, 6),
                      key_positions=(1, 2, 9, 6), local=(2, 2, 8, 5), gate=(2, 2, 9, 5))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, -3:] = True
    _assert_matches(pola_layer_attention, naive_pola_layer_attention, tensors, alpha=3.0, key_padding_mask=mask,
                    causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_pacs_layer_op_matches_reference(cpu_backend, causal):
    tensors = _leaves(q=(2, 2, 9, 6), k=(2, 2, 9, 6), v=(2, 2, 9, 6), same=(1, 2, 1, 12), opposite=(2, 1, 12),
                      local=(2, 2, 9, 6), gate=(2, 2, 9, 6))
    _assert_matches(pacs_layer_attention, naive_pacs_layer_attention, tensors, causal=causal)


@pytest.mark.parametrize("change, message", [
    (dict(scale=torch.zeros(1, 3, 1, 4)), "scale must broadcast to"),
    (dict(power=torch.zeros(1, 2, 2, 4)), "power must broadcast to"),
    (dict(alpha=-1.0), "alpha must be a finite number >= 0"),
    (dict(key_positions=torch.zeros(1, 2, 5, 4)), "key_positions must broadcast to"),
    (dict(local=torch.zeros(1, 2, 7, 4)), "local must be"),
    (dict(gate=torch.zeros(1, 2, 5, 4)), "gate must be"),
    (dict(key_positions=torch.zeros(1, 2, 6, 4), cu_seqlens=torch.tensor([0, 2, 6])), "key_positions cannot"),
])
def test_pola_layer_op_refuses_arguments_that_do_not_fit(change, message):
    q = torch.zeros(1, 2, 6, 4)
    arguments = dict(q=q, k=q, v=q, scale=torch.zeros(1, 2, 1, 4), power=torch.zeros(2, 1, 4), alpha=4.0)
    with pytest.raises(ValueError, match=message):
        pola_layer_attention(**{**arguments, **change})


def test_pacs_layer_op_refuses_a_misshaped_gate():
    q = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match="gate must be"):
        pacs_layer_attention(q, q, q, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), gate=torch.zeros(1, 2, 6, 5))
