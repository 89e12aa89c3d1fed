"""Every launch plan of the Pola and PaCS kernels (``common.plan``: query spans, a key-state launch, the backward
split into token blocks) exact against the float64 reference, forward and every gradient, the layers' parameters
included: each plan forced on a call whose shapes would take another, so that the split paths the models' long
sequences take run in the interpreter's small shapes. In Triton's interpreter without CUDA."""
from __future__ import annotations

import pytest
import torch

from polaformer.backends.triton import common
from polaformer.ops import (
    naive_pacs_layer_attention,
    naive_pola_layer_attention,
    pacs_layer_attention,
    pola_layer_attention,
    rope_2d,
    rope_angles,
)
from polaformer.ops.pacs import triton as pacs
from polaformer.ops.pola import triton as pola

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = 1e-12  # float64 kernels against the float64 reference: rounding only

# (query spans, key-state splits, backward query spans, backward key splits) with 16-token blocks; 50 queries and
# 40 keys are four and three blocks, so the widest plan also has spans without a block.
PLANS = {
    "one launch each way": (1, 0, 1, 0),
    "query spans": (3, 0, 1, 0),
    "key-state launch": (2, 3, 1, 0),
    "split backward": (1, 0, 3, 2),
    "split everything, empty spans": (5, 4, 5, 4),
}


@pytest.fixture(params=PLANS)
def forced_plan(request, monkeypatch):
    spans, splits, backward_spans, backward_splits = PLANS[request.param]
    forced = lambda *args, **kwargs: common.Plan(16, spans, splits, backward_spans, backward_splits)  # noqa: E731
    for module in (pola, pacs):
        monkeypatch.setattr(module, "plan", forced)
    return request.param


def _leaves(**shapes):
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64).to(DEVICE).requires_grad_()
            for name, shape in shapes.items()}


def _check(op, reference, tensors, **options):
    out = op(**tensors, **options)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    grads = torch.autograd.grad(out, list(tensors.values()), grad_out)
    exact = {name: t.detach().cpu().requires_grad_() for name, t in tensors.items()}
    expected = reference(**exact, **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()})
    expected_grads = torch.autograd.grad(expected, list(exact.values()), grad_out.cpu())
    torch.testing.assert_close(out.cpu(), expected, rtol=EXACT, atol=EXACT)
    for name, grad, want in zip(tensors, grads, expected_grads):
        torch.testing.assert_close(grad.cpu(), want, rtol=EXACT, atol=EXACT, msg=name)


def test_pola_every_plan_is_exact(triton_backend, forced_plan):
    """A layer's call: raw scale and exponent weights, key positions, a class token without a local term, gate, and
    a key mask with a sequence of no valid key."""
    tensors = _leaves(q=(2, 2, 50, 8), k=(2, 2, 40, 8), v=(2, 2, 40, 6), scale=(1, 2, 1, 8), power=(1, 2, 1, 8),
                      key_positions=(1, 2, 40, 8), local=(2, 2, 49, 6), gate=(2, 2, 50, 6))
    mask = torch.rand(2, 40, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[1] = True
    _check(pola_layer_attention, naive_pola_layer_attention, tensors, alpha=3.0, key_padding_mask=mask.to(DEVICE))


def test_pacs_every_plan_is_exact(triton_backend, forced_plan):
    """A layer's call with RoPE: raw temperature weights, the local branch and the gate."""
    tensors = _leaves(q=(1, 2, 48, 8), k=(1, 2, 48, 8), v=(1, 2, 48, 8), same=(1, 2, 1, 16), opposite=(1, 2, 1, 16),
                      local=(1, 2, 48, 8), gate=(1, 2, 48, 8))
    sin, cos = (t.to(DEVICE, torch.float64) for t in rope_2d(rope_angles(16, 1), 6, 8))
    _check(pacs_layer_attention, naive_pacs_layer_attention, tensors, sin=sin, cos=cos)


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_packed_split_plan_is_exact(triton_backend, monkeypatch, op):
    """Packed sequences (one of no token) under the widest plan: spans and splits per sequence."""
    forced = lambda *args, **kwargs: common.Plan(16, 3, 2, 3, 2)  # noqa: E731
    monkeypatch.setattr(pola if op == "pola" else pacs, "plan", forced)
    offsets = [0, 20, 20, 45]
    if op == "pola":
        tensors = _leaves(q=(1, 2, 45, 8), k=(1, 2, 45, 8), v=(1, 2, 45, 6), scale=(1, 2, 1, 8), power=(1, 2, 1, 8),
                          gate=(1, 2, 45, 6))
        op_fn, naive = pola_layer_attention, naive_pola_layer_attention
    else:
        tensors = _leaves(q=(1, 2, 45, 8), k=(1, 2, 45, 8), v=(1, 2, 45, 8), same=(1, 2, 1, 16),
                          opposite=(1, 2, 1, 16), gate=(1, 2, 45, 8))
        op_fn, naive = pacs_layer_attention, naive_pacs_layer_attention

    def reference(q, k, v, gate, cu_seqlens, **params):
        rows = list(zip(offsets, offsets[1:]))
        return torch.cat([naive(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], **params, gate=gate[:, :, a:e])
                          for a, e in rows if e > a], dim=2)

    _check(op_fn, reference, tensors, cu_seqlens=torch.tensor(offsets, device=DEVICE))


def test_the_plan_splits_the_backward_of_long_pairs_that_do_not_fill_the_device():
    """The tunable heuristic: the backward splits once a pair walks ``BACKWARD_SPLIT_TOKENS`` tokens and the pairs
    do not fill the device (an H100's two programs per multiprocessor in the interpreter), never otherwise."""
    cpu = torch.device("cpu")
    long_pairs = common.plan(64, 1, 3136, 49, 32, cpu)  # Pola-PVT's first stage, batch 64
    assert long_pairs.backward_spans > 1 and long_pairs.backward_key_splits > 1
    assert common.plan(64, 2, 784, 49, 32, cpu).backward_spans == 1  # 833 tokens: one program per pair
    assert common.plan(512, 1, 3136, 49, 32, cpu).backward_spans == 1  # the pairs fill the device
    tokens = common.BACKWARD_SPLIT_TOKENS
    assert common.plan(1, 1, tokens - 100, 99, 32, cpu).backward_spans == 1
    assert common.plan(1, 1, tokens - 100, 100, 32, cpu).backward_spans > 1
