"""torch.compile of every model family: one full graph, no graph breaks, no recompiles, eager results.

Small configurations of each family's smallest variant keep this in CI time on CPU: the graph-level
checks use the ``aot_eager`` backend (dynamo capture plus AOT autograd's traced backward, no code
generation); a single inductor test covers code generation on the smallest model.

Tolerances (tests/README.md, tests/tolerances.py): compiled against eager, float32, at 1e-5: the compiler fuses and
reorders the same operations; probable_rtol of these small models' reductions (at most 256 terms: 1.5e-5 at κ = 1).
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import polaformer.models  # noqa: F401  (registers the models)

# (model, overrides, input size): each family's smallest variant, narrowed and shortened. Swin is
# built for 128 px so that its third stage (8x8 tokens, 7x7 softmax windows) shifts, pads and
# uses the stored attn_mask buffer; its linear stages stay global as in the official layout.
FAMILIES = {
    "deit": ("pola_deit_digits", dict(depth=2), 8),
    "pvt": ("pola_pvt_tiny", dict(embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8), depths=(1, 1, 1, 1),
                                  mlp_ratios=(2, 2, 2, 2)), 64),
    "pvt_v2": ("pola_pvt_v2_b0", dict(embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8), depths=(1, 1, 1, 1),
                                      mlp_ratios=(2, 2, 2, 2)), 64),
    "swin": ("pola_swin_t", dict(img_size=128, embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4),
                                 mlp_ratio=2.0), 128),
    "polapp": ("POLA_b0", dict(embed_dims=(16, 32, 64, 128), depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8),
                               projection=64), 64),
}
TOL = dict(rtol=1e-5, atol=1e-5)


def build(family: str, **kwargs):
    name, overrides, size = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **{**overrides, **kwargs})
    return model, torch.randn(2, model.default_cfg["input_size"][0], size, size)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty dynamo caches. One thread: these tensors are tiny, and two OpenMP
    threads on a busy 2-core CI machine spend most of their time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_graph_breaks(family):
    model, x = build(family)
    explanation = torch._dynamo.explain(model.eval())(x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_fullgraph_inference_matches_eager_without_recompiles(family):
    model, x = build(family)
    model.eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected, **TOL)
        with torch.compiler.set_stance("fail_on_recompile"):
            for _ in range(2):
                torch.testing.assert_close(compiled(x), expected, **TOL)
    assert counter.frame_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fullgraph_training_matches_eager_without_recompiles(family):
    """Forward, backward and SGD steps (stochastic depth on) give eager's outputs, gradients and weights."""
    model, x = build(family, drop_path_rate=0.1)
    model.train()
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (reference, model)]
    for step in range(2):  # the second step runs on updated weights and must not recompile
        outputs = []
        for fn, optimizer in zip((reference, compiled), optimizers):
            torch.manual_seed(step)  # the same stochastic-depth draws
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                out = fn(x)
            out.square().mean().backward()
            outputs.append(out.detach())
        torch.testing.assert_close(outputs[1], outputs[0], **TOL)
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=lambda m: f"{name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p, p_ref, **TOL)
    for b_ref, b in zip(reference.buffers(), model.buffers()):  # BatchNorm running statistics
        torch.testing.assert_close(b, b_ref, **TOL)
    assert counter.frame_count == 1


def test_inductor_fullgraph_smallest_model():
    """Inductor code generation (default mode) on the digits DeiT matches eager in inference.

    Inference only: compiling the backward with inductor as well takes longer than CI allows on two
    CPU cores; the aot_eager training tests above cover the traced backward graph."""
    model, x = build("deit")
    compiled = torch.compile(model, fullgraph=True)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
