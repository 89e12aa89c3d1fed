"""How the Triton path runs, as opposed to what it computes: launches per call at the models' shapes, the ops
inside a torch.compile graph (equal to eager, forward and backward), and the registered ops' fake-tensor
shapes. Without CUDA the kernels run in Triton's interpreter on CPU tensors; with CUDA the compile and opcheck
tests run on the GPU and the launch counts, which count the interpreter's launches, are skipped."""
from __future__ import annotations

import os

import pytest
import torch

import polaformer.ops.pola.op as pola_ops
from graph_recording import GraphRecorder
from interpreted_kernels import kernel_writes
from launch_counting import counting
from polaformer.backends.triton import common
from polaformer.layers import PolaLinearAttention
from polaformer.ops import pacs_linear_attention, pola_linear_attention, rope_2d, rope_angles
from polaformer.ops.pacs import triton as pacs
from polaformer.ops.pola import triton as pola

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="counts the launches of Triton's interpreter (CPU tensors)")

# (heads, queries, keys, head width) of the models' attention calls per image: Pola-PVT's four stages (keys
# spatially reduced), a Pola-Swin window, PolaDiT-S/2 on 32×32 latents, PolaFormer++'s first stage (RoPE).
MODEL_CALLS = {
    "pola_pvt 56x56/sr8": (1, 3136, 49, 64),
    "pola_pvt 28x28/sr4": (2, 784, 49, 64),
    "pola_pvt 14x14/sr2": (5, 196, 49, 64),
    "pola_pvt 7x7": (8, 49, 49, 64),
    "pola_swin window 7x7": (3, 49, 49, 32),
    "pola_dit_s_2 32x32": (6, 256, 256, 64),
    "polapp_b0 56x56": (1, 3136, 3136, 64),
}


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("call", MODEL_CALLS)
def test_models_shapes_plan_one_forward_launch(call, batch):
    """On an H100-sized plan (the interpreter's), every model call runs its forward in one program per query
    span, from batch 1 to 64; its backward is one program per (sequence, head) except where a pair walks
    ``BACKWARD_SPLIT_TOKENS`` tokens without the pairs filling the device (tests/backends/triton/test_plans.py)."""
    heads, queries, keys, _ = MODEL_CALLS[call]
    for block in (64, 32, 16):  # Pola's (narrow and wide heads) and PaCS's token blocks on a GPU
        plan = common.plan(batch, heads, queries, keys, block, torch.device("cpu"))
        assert plan.key_splits == 0, plan
        long_pairs = queries + keys >= common.BACKWARD_SPLIT_TOKENS and batch * heads < 264
        assert (plan.backward_spans > 1) == long_pairs, plan


def test_narrow_pola_heads_take_64_token_tiles_on_a_gpu_and_16_in_the_interpreter():
    assert common.pola_tile(32, 32, on_gpu=True) == (64, 4)
    assert common.pola_tile(64, 64, on_gpu=True) == (32, 8)
    assert common.pola_tile(32, 32, on_gpu=False)[0] == 16


def test_long_sequences_with_few_pairs_split_the_keys():
    plan = common.plan(1, 8, 32768, 32768, 64, torch.device("cpu"))
    assert plan.key_splits > 1 and plan.query_spans > 1 and plan.backward_spans > 1 and plan.backward_key_splits > 1


@pytest.fixture
def gpu_checks_only(monkeypatch):
    """The exponent's value check reads the tensor and runs on CPU tensors only: on CUDA it is skipped, so the
    counts below leave it out too."""
    monkeypatch.setattr(pola_ops, "check_power_values", lambda *args: None)


def _leaf(x):
    return x.to(DEVICE).requires_grad_()


def _pola_inputs(batch, heads, queries, keys, width):
    q = _leaf(torch.randn(batch, heads, queries, width))
    k, v = (_leaf(torch.randn(batch, heads, keys, width)) for _ in range(2))
    return q, k, v, _leaf(torch.full((1, heads, 1, width), 2.5))


def _pacs_inputs(batch, heads, tokens, width):
    q, k, v = (_leaf(torch.randn(batch, heads, tokens, width)) for _ in range(3))
    temps = (_leaf(torch.rand(1, heads, 1, 2 * width)) for _ in range(2))
    return (q, k, v, *temps)


def _on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


def _rope(tokens, width):
    side = int(tokens ** 0.5)
    return _on_device(*rope_2d(rope_angles(2 * width, 1), side, tokens // side))


# Counted at the models' shapes where the interpreter is quick, and at smaller shapes that take the same plan
# (one program per query span forward, one per sequence and head backward) as the larger model calls.
COUNTED_CALLS = {  # (batch, heads, queries, keys, head width)
    "pola_pvt 7x7": (1, *MODEL_CALLS["pola_pvt 7x7"]),
    "pola_swin window 7x7": (2, *MODEL_CALLS["pola_swin window 7x7"]),
    "dit-like 8x8": (2, 2, 64, 64, 32),
}


@interpreter_only
@pytest.mark.parametrize("call", COUNTED_CALLS)
def test_pola_launches_per_call(triton_backend, gpu_checks_only, call):
    """Forward: one Triton launch and nothing else; forward and backward: at most three device kernels (the
    exponent's gradient is summed over the batch by one torch reduction)."""
    q, k, v, power = _pola_inputs(*COUNTED_CALLS[call])
    grad = torch.randn(q.shape[:3] + (v.shape[-1],))
    with counting() as forward:
        out = pola_linear_attention(q, k, v, power)
    with counting() as backward:
        torch.autograd.grad(out, (q, k, v, power), grad)
    assert forward.launches == ["_forward_kernel"] and forward.operations == []
    assert backward.launches == ["_backward_kernel"]
    assert forward.total + backward.total <= 3, (forward, backward)
    with torch.no_grad(), counting() as inference:
        pola_linear_attention(q, k, v, power)
    assert inference.total == 1


@interpreter_only
@pytest.mark.parametrize("variant", ["plain", "rope", "mask", "packed"])
def test_pacs_launches_per_call(triton_backend, variant):
    """As for Pola, at a Pola-Swin window's shape (two images: the temperatures' gradients are summed over them
    by one reduction)."""
    batch = 2
    q, k, v, ts, to = _pacs_inputs(batch, 2, 49, 32)
    kwargs = {}
    if variant == "rope":
        kwargs["sin"], kwargs["cos"] = _rope(49, 32)
    elif variant == "mask":
        kwargs["key_padding_mask"] = torch.rand(batch, 49) < 0.2
    elif variant == "packed":
        q, k, v = (t.detach().transpose(0, 1).reshape(1, 2, batch * 49, 32).requires_grad_() for t in (q, k, v))
        kwargs["cu_seqlens"] = torch.tensor([0, 30, batch * 49])
    grad = torch.randn(q.shape)
    with counting() as forward:
        out = pacs_linear_attention(q, k, v, ts, to, **kwargs)
    with counting() as backward:
        torch.autograd.grad(out, (q, k, v, ts, to), grad)
    assert forward.launches == ["_forward_kernel"] and forward.operations == []
    assert backward.launches == ["_backward_kernel"]
    assert forward.total + backward.total <= 3, (forward, backward)


def _layer_counts(layer, x, height, width):
    """(forward counts, backward counts) of one layer call and its backward (every input and parameter)."""
    leaves = [x, *layer.parameters()]
    with counting() as forward:
        out = layer(x, height, width)
    grad = torch.randn_like(out)
    with counting() as backward:
        torch.autograd.grad(out, leaves, grad)
    return forward, backward


@pytest.mark.slow
@interpreter_only
def test_a_deit_layer_call_is_one_launch_forward_and_one_backward(triton_backend):
    """Issue 52's target at Pola-DeiT-T's shape (PolaLinearAttention(192, 3), a class token and 14×14 tokens, two
    images): the scale, the exponent, the local branch's add and the gate run in the kernels, so around the
    launch only the layer's own projections, the conv and their gradients remain."""
    torch.manual_seed(0)
    layer = PolaLinearAttention(192, 3, fused_qkvg=True, num_prefix_tokens=1).to(DEVICE)
    forward, backward = _layer_counts(layer, _leaf(torch.randn(2, 197, 192)), 14, 14)
    assert forward.launches == ["_forward_kernel"] and len(forward.operations) <= 8, forward
    assert backward.launches == ["_backward_kernel"] and len(backward.operations) <= 20, backward
    # nothing of the layer's arithmetic around the attention is left to torch
    assert not {"softplus", "sigmoid", "div", "mul", "cat"} & set(forward.operations), forward


@interpreter_only
def test_a_spatially_reduced_layer_call_adds_only_its_key_reduction(triton_backend):
    """Pola-PVT's layout (keys and values through a strided conv and a LayerNorm, a key positional table, values
    stretched back along the tokens for the local branch): the same launches, and beside the DeiT call's work only
    the reduction's ops, the stretch, and the positions' gradient summed over the batch."""
    torch.manual_seed(0)
    layer = PolaLinearAttention(64, 1, sr_ratio=2, key_pos_tokens=16).to(DEVICE)
    forward, backward = _layer_counts(layer, _leaf(torch.randn(2, 64, 64)), 8, 8)
    reduction = {"convolution", "native_layer_norm", "upsample_linear1d"}
    assert forward.launches == ["_forward_kernel"] and len(forward.operations) <= 8 + len(reduction), forward
    assert backward.launches == ["_backward_kernel"] and len(backward.operations) <= 20 + len(reduction) + 1, backward
    assert not {"softplus", "sigmoid", "div", "mul", "cat"} & set(forward.operations), forward


def _compiled_equals_eager(fn, leaves, forward_kernel="_forward_kernel", backward_kernel="_backward_kernel"):
    """``fn`` compiled whole (no graph break) equals eager, forward and backward bit for bit, and its AOT graphs
    launch our kernels themselves (``wrap_triton``): the forward graph ``forward_kernel``, the backward graph
    ``backward_kernel``."""
    recorder = GraphRecorder()
    with kernel_writes():
        compiled = torch.compile(fn, backend=recorder.backend(), fullgraph=True)
        out = compiled(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    forward, backward = recorder.kernels
    assert forward_kernel in forward and backward_kernel in backward, recorder.kernels
    expected = fn(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves, torch.ones_like(expected))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["plain", "mask", "packed"])
def test_compiled_pola_calls_the_kernels_op(triton_backend, variant):
    torch._dynamo.reset()
    q, k, v, power = _pola_inputs(2, 2, 40, 24, 16)
    kwargs = {}
    if variant == "mask":
        kwargs["key_padding_mask"] = (torch.rand(2, 24) < 0.3).to(DEVICE)
    elif variant == "packed":
        q, k, v = (t.detach()[:1].requires_grad_() for t in (q, k, v))
        kwargs = dict(zip(("cu_seqlens", "cu_seqlens_k"), _on_device(torch.tensor([0, 15, 40]),
                                                                     torch.tensor([0, 10, 24]))))
    _compiled_equals_eager(lambda *x: pola_linear_attention(*x, **kwargs), (q, k, v, power))


@pytest.mark.parametrize("variant", ["rope", "mask", "packed"])
def test_compiled_pacs_calls_the_kernels_op(triton_backend, variant):
    torch._dynamo.reset()
    q, k, v, ts, to = _pacs_inputs(2, 2, 36, 8)
    kwargs = {}
    if variant == "rope":
        kwargs["sin"], kwargs["cos"] = _rope(36, 8)
    elif variant == "mask":
        kwargs["key_padding_mask"] = (torch.rand(2, 36) < 0.3).to(DEVICE)
    else:
        q, k, v = (t.detach()[:1].requires_grad_() for t in (q, k, v))
        kwargs["cu_seqlens"] = torch.tensor([0, 20, 36], device=DEVICE)
    _compiled_equals_eager(lambda *x: pacs_linear_attention(*x, **kwargs), (q, k, v, ts, to))


def _opcheck_pola(**options):
    q, k, v, power = (t.detach() for t in _pola_inputs(2, 2, 20, 12, 8))
    mask = options.get("mask")
    if options.get("packed"):
        q, k, v = q[:1], k[:1], v[:1]
    layer = (None,) * 4
    if options.get("layer"):  # raw scale and exponent weights, key positions, local branch (a class token) and gate
        layer = (torch.randn_like(power), torch.randn_like(k[:1]), torch.randn_like(q[:, :, 1:]), torch.randn_like(q))
    alpha = 4.0 if options.get("layer") else None
    args = (q, k, v, power, *layer, 1e-6, alpha, mask, options.get("cu_seqlens"), options.get("cu_seqlens_k"), True)
    torch.library.opcheck(pola._pola_op, args)
    out, state = pola._pola_op(*args)
    grad_args = (torch.randn_like(out), q, k, v, power, *layer, state, 1e-6, alpha, *args[10:13])
    torch.library.opcheck(pola._pola_backward_op, grad_args)


@pytest.mark.slow
def test_registered_pola_ops_pass_opcheck(triton_backend):
    """Schema, fake tensors (shapes, dtypes, strides) against the real kernels, autograd registration, and
    ahead-of-time tracing, for the options: key mask, packed queries and keys, a layer's call."""
    _opcheck_pola()
    _opcheck_pola(mask=(torch.rand(2, 12) < 0.3).to(DEVICE))
    _opcheck_pola(packed=True, cu_seqlens=torch.tensor([0, 5, 20], device=DEVICE),
                  cu_seqlens_k=torch.tensor([0, 4, 12], device=DEVICE))
    _opcheck_pola(layer=True)


@pytest.mark.slow
def test_registered_pacs_ops_pass_opcheck(triton_backend):
    q, k, v, ts, to = (t.detach() for t in _pacs_inputs(2, 2, 16, 8))
    sin, cos = _rope(16, 8)
    mask = (torch.rand(2, 16) < 0.3).to(DEVICE)
    offsets = torch.tensor([0, 6, 16], device=DEVICE)
    layer = (torch.randn_like(q), torch.randn_like(q))  # local branch and gate
    for tables, mask, packed, epilogue in (((sin, cos), None, None, (None, None)), ((None, None), mask, None, layer),
                                           ((sin, cos), None, offsets, (None, None))):
        inputs = (q[:1], k[:1], v[:1]) if packed is not None else (q, k, v)
        raw = epilogue[0] is not None
        args = (*inputs, ts, to, *epilogue, *tables, 1e-6, raw, mask, packed, packed, True)
        torch.library.opcheck(pacs._pacs_op, args)
        out, state = pacs._pacs_op(*args)
        torch.library.opcheck(pacs._pacs_backward_op, (torch.randn_like(out), *inputs, ts, to, *epilogue, *tables,
                                                       state, 1e-6, raw, mask, packed, packed))
