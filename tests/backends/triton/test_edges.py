"""Inputs that once gave silently wrong results on the Triton path, each as a new user would pass them: a strided
key padding mask, a gradient penalty (double backward), tensors whose element offsets pass 2³¹, and magnitudes
outside float32's range (the last in tests/ops/test_numerics.py, on every backend). Without CUDA they run in
Triton's interpreter on CPU tensors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from polaformer.ops import dispatch, pacs_linear_attention, pola_linear_attention
from polaformer.ops.naive import naive_pacs_linear_attention, naive_pola_linear_attention


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().cpu().double()
    diff = actual.detach().cpu().double() - expected
    return (diff.norm() / expected.norm().clamp_min(1e-300)).item()


def test_a_strided_key_padding_mask_is_read_through_its_strides(triton_backend, device):
    mask = (torch.rand(2, 64, device=device) < 0.5)[:, ::2]  # every other column of a wider mask
    assert not mask.is_contiguous()
    q, k, v = (torch.randn(2, 2, 32, 8, device=device) for _ in range(3))
    temps = torch.rand(2, 1, 16, device=device)
    out = pacs_linear_attention(q, k, v, temps, temps.flip(-1), key_padding_mask=mask)
    expected = naive_pacs_linear_attention(q.double(), k.double(), v.double(), temps.double(),
                                           temps.flip(-1).double(), key_padding_mask=mask.contiguous())
    assert relative_error(out, expected) < 1e-5
    power = torch.full((1, 2, 1, 8), 2.5, device=device)
    out = pola_linear_attention(q, k, v, power, key_padding_mask=mask)
    expected = naive_pola_linear_attention(q.double(), k.double(), v.double(), power.double(),
                                           key_padding_mask=mask.contiguous())
    assert relative_error(out, expected) < 1e-5


def _call(op, q, k, v):
    if op == "pola":
        return pola_linear_attention(q, k, v, torch.full((1, 2, 1, 8), 2.0, device=q.device))
    temps = torch.full((1, 2, 1, 16), 0.5, device=q.device)
    return pacs_linear_attention(q, k, v, temps, temps)


@pytest.mark.parametrize("backend", ["triton", "native"])
@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_a_gradient_penalty_is_refused_not_silently_dropped(backend, op, device):
    """A second differentiation through the hand-written backward passes raises, where it used to return first
    gradients that did not depend on the inputs (so a gradient penalty added nothing)."""
    if backend == "native":
        device = torch.device("cpu")
    previous = dispatch.set_attention_backend(backend)
    try:
        q, k, v = (torch.randn(1, 2, 12, 8, device=device, requires_grad=True) for _ in range(3))
        out = _call(op, q, k, v)
        (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        loss = out.sum() + grad_q.square().sum()
        with pytest.raises(RuntimeError, match="differentiate twice"):
            loss.backward()
    finally:
        dispatch.set_attention_backend(previous)


# q, k and v are views of one float16 buffer of 2³¹ + elements whose heads lie 2³⁰ elements apart: head 2 starts
# past 2³¹, where 32-bit offsets wrap (the process used to crash or read other memory). The buffer is allocated,
# not touched, so only the pages the views use are ever mapped. Run in its own process: a wrapped offset can
# end it.
_LARGE_OFFSETS = textwrap.dedent("""
    import torch
    from polaformer.ops import dispatch, pacs_linear_attention, pola_linear_attention
    from polaformer.ops.naive import naive_pacs_linear_attention, naive_pola_linear_attention

    dispatch.set_attention_backend("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, n, d = 3, 16, 16
    head_stride = 2**30 + 4096
    buffer = torch.empty((heads - 1) * head_stride + 3 * n * d, dtype=torch.float16, device=device)
    q, k, v = (buffer.as_strided((1, heads, n, d), (heads * head_stride, head_stride, d, 1), i * n * d)
               for i in range(3))
    generator = torch.Generator().manual_seed(0)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=generator))
    plain = [t.double().cpu() for t in (q, k, v)]
    power = torch.full((1, heads, 1, d), 3.0, device=device)
    temps = torch.full((1, heads, 1, 2 * d), 0.5, device=device)

    def error(out, expected):
        return ((out.double().cpu() - expected).norm() / expected.norm()).item()

    leaves = [t.requires_grad_() for t in (q, k, v)]
    for name, out, expected in (
        ("pola", pola_linear_attention(*leaves, power), naive_pola_linear_attention(*plain, power.double().cpu())),
        ("pacs", pacs_linear_attention(*leaves, temps, temps),
         naive_pacs_linear_attention(*plain, temps.double().cpu(), temps.double().cpu())),
    ):
        grads = torch.autograd.grad(out.float().sum(), leaves)
        assert error(out, expected) < 5e-3, (name, error(out, expected))
        assert all(bool(torch.isfinite(g).all()) and g.abs().sum() > 0 for g in grads), name
    print("ok")
""")


def test_offsets_past_two_to_the_31_elements_do_not_wrap():
    # on a GPU the kernels run compiled; without one, in the interpreter (chosen before torch imports triton)
    env = dict(os.environ) if torch.cuda.is_available() else {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _LARGE_OFFSETS], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
