"""torch.compile of every model family on the Triton kernels: one graph per model, no graph break, the kernels
launched inside the forward and backward graphs (``torch.library.triton_op`` + ``wrap_triton``), and eager's
outputs and gradients.

Without CUDA this runs in Triton's interpreter with the ``aot_eager`` backend: inductor cannot generate code
around a user-written Triton kernel on CPU tensors (its CPU backend compiles C++, and the interpreter is no Triton
backend it can target), so the modes, which are inductor's, are checked on a GPU only: there every family
compiles with ``mode="default"``, ``"max-autotune-no-cudagraphs"`` and ``"reduce-overhead"`` (CUDA graphs)."""
from __future__ import annotations

import os

import pytest
import timm
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import polaformer.models  # noqa: F401  (registers the models)
from graph_recording import GraphRecorder
from interpreted_kernels import kernel_writes
from polaformer.tasks.lra.model import LRAClassifier, LRAModelConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (model, kwargs, input maker): each family's smallest variant, narrowed (the interpreter runs every program). Two
# images, not one: at batch 1 a convolution's output layout is ambiguous, and a fake tensor may predict another
# than the CPU returns; the kernels' strides are recorded from the fakes, which inductor enforces at run time
# but aot_eager does not (docs/gpu.md).
SMALL_STAGES = dict(embed_dims=(8, 16, 16, 16), num_heads=(1, 1, 1, 1), depths=(1, 1, 1, 1), mlp_ratios=(1, 1, 1, 1))
FAMILIES = {
    "deit": ("pola_deit_digits", dict(depth=1), lambda: (torch.randn(2, 1, 8, 8),)),
    "pvt": ("pola_pvt_tiny", SMALL_STAGES, lambda: (torch.randn(2, 3, 32, 32),)),
    "pvt_v2": ("pola_pvt_v2_b0", SMALL_STAGES, lambda: (torch.randn(2, 3, 32, 32),)),
    "swin": ("pola_swin_t", dict(img_size=32, embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                 mlp_ratio=1.0, window_size=2), lambda: (torch.randn(2, 3, 32, 32),)),
    "polapp": ("POLA_b0", dict(embed_dims=(8, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                               projection=16), lambda: (torch.randn(2, 3, 32, 32),)),
    "pola_dit": ("pola_dit_s_2", dict(input_size=8, in_channels=4, depth=1, hidden_size=32, num_heads=2,
                                      num_classes=10),
                 lambda: (torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 7]))),
    "lm pola": ("pola_lm_tiny", dict(attention="pola", context=16, depth=1), lambda: (torch.randint(0, 256, (2, 16)),)),
    "lm pacs": ("pola_lm_tiny", dict(attention="pacs", context=16, depth=1), lambda: (torch.randint(0, 256, (2, 16)),)),
    "lra pola": ("lra", dict(attention="pola"), lambda: (torch.randint(0, 32, (2, 16)),
                                                          torch.arange(16) >= torch.tensor([16, 9])[:, None])),
    "lra pacs": ("lra", dict(attention="pacs"), lambda: (torch.randint(0, 32, (2, 16)),
                                                          torch.arange(16) >= torch.tensor([16, 9])[:, None])),
}


def build(family: str):
    name, kwargs, inputs = FAMILIES[family]
    torch.manual_seed(0)
    if name == "lra":
        model = LRAClassifier(LRAModelConfig(vocab_size=32, num_classes=3, max_len=16, num_layers=1, dropout=0.0,
                                             attention_dropout=0.0, **kwargs))
    else:
        model = timm.create_model(name, **kwargs, **({} if "num_classes" in kwargs or name.startswith("pola_lm")
                                                      else dict(num_classes=3)))
    # eval mode: no dropout or stochastic depth, whose draws a compiled graph may take in another order; the
    # backward runs all the same
    return model.to(DEVICE).eval(), tuple(t.to(DEVICE) for t in inputs())


def _step(model, inputs):
    """Outputs and every parameter's gradient of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out.float().square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's aot_eager check")
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_family_is_one_graph_launching_the_kernels(triton_backend, family):
    model, inputs = build(family)
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=recorder.backend())
    with kernel_writes():
        out, grads = _step(compiled, inputs)
        expected, expected_grads = _step(model, inputs)
    assert dict(counters["graph_break"]) == {}
    assert len(recorder.kernels) == 2, recorder.kernels  # one forward graph, one backward graph
    forward, backward = recorder.kernels
    assert any(name in forward for name in ("_forward_kernel", "_output_kernel")), forward
    assert any(name in backward for name in ("_backward_kernel", "_grads_kernel")), backward
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's modes need CUDA")
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_family_runs_in_every_mode_without_graph_breaks(family, mode):
    model, inputs = build(family)
    compiled = torch.compile(model, mode=mode)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):  # reduce-overhead records its CUDA graphs on the second and third calls
            out, _ = _step(compiled, inputs)
        expected, _ = _step(model, inputs)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(out.float(), expected.float(), rtol=5e-2, atol=5e-2)
