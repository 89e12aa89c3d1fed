"""The Triton chunked causal numerator against the torch chunked form and the masked O(N²) product, and the causal
Pola and PaCS ops through it against the torch backend: forward and every gradient. Without CUDA they run in
Triton's interpreter (see conftest.py) in float64 to 1e-9; on a CUDA device in float32 (and bf16) with
tolerances for their rounding."""
from __future__ import annotations

import pytest
import torch

from polaformer.backends.triton import causal as triton_causal
from polaformer.ops import causal_pacs_linear_attention, causal_pola_linear_attention, dispatch, rope_1d
from polaformer.ops.causal import CausalState, _chunked_numerator


def exact_dtype(device) -> torch.dtype:
    """float64 under the interpreter; float32 on a GPU, where float64 takes the torch formulation."""
    return torch.float64 if device.type == "cpu" else torch.float32


def assert_matches(actual, expected, name=""):
    """1e-9 in float64; on a GPU (float32 products) a relative RMS error below 1e-5."""
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=1e-9, msg=name)
        return
    expected = expected.detach().double()
    error = (actual.detach().double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
    assert error < 1e-5, (name, error.item())


def masked_numerator(q, k, v, initial):
    """``q_t·S₀ + Σ_{s≤t} (q_t·k_s) v_s`` and ``S₀ + Σ kᵀv`` as the full masked product."""
    n = q.shape[-2]
    seen = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return (q @ k.transpose(-2, -1)).masked_fill(~seen, 0.0) @ v + q @ initial, initial + k.transpose(-2, -1) @ v


@pytest.mark.parametrize("n, features, dv, chunk, final_grad", [
    pytest.param(37, 20, 5, 16, True, id="N37-F20-dv5-C16"),  # 3 chunks, the last partial; 2 feature tiles
    pytest.param(9, 6, 3, 3, False, id="N9-F6-dv3-C3"),  # one chunk (C rounded up to 16); only o used
])
def test_kernel_equals_torch_chunked_form_and_masked_product(device, n, features, dv, chunk, final_grad):
    dtype = exact_dtype(device)
    q, k = (torch.randn(2, 2, n, features, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(2, 2, n, dv, dtype=dtype, device=device)
    initial = torch.randn(2, 2, features, dv, dtype=dtype, device=device)
    leaves = [t.requires_grad_() for t in (q, k, v, initial)]
    grad_out = torch.randn(2, 2, n, dv, dtype=dtype, device=device)
    grad_final = torch.randn(2, 2, features, dv, dtype=dtype, device=device)

    def run(numerator):
        out, final = numerator(*leaves, chunk)
        loss = (out * grad_out).sum() + ((final * grad_final).sum() if final_grad else 0)
        return out, final, torch.autograd.grad(loss, leaves)

    out, final, grads = run(triton_causal.causal_numerator)
    assert out.dtype == dtype and out.shape == (2, 2, n, dv) and final.shape == initial.shape
    for reference in (_chunked_numerator, lambda *args: masked_numerator(*args[:4])):
        ref_out, ref_final, ref_grads = run(reference)
        assert_matches(out, ref_out, "out")
        assert_matches(final, ref_final, "final state")
        for name, grad, ref_grad in zip(("q", "k", "v", "initial state"), grads, ref_grads):
            assert_matches(grad, ref_grad, name)


def test_kernel_refuses_mismatched_shapes(device):
    q = torch.randn(1, 2, 8, 4, device=device)
    with pytest.raises(ValueError, match="initial_state must be"):
        triton_causal.causal_numerator(q, q, q, torch.zeros(1, 2, 4, 3, device=device))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The (batch, heads, tokens) of every call the ops make to the Triton numerator."""
    calls = []
    original = triton_causal.causal_numerator

    def spy(q, *args):
        calls.append(tuple(q.shape[:3]))
        return original(q, *args)

    monkeypatch.setattr(triton_causal, "causal_numerator", spy)
    return calls


def _pola_call(q, k, v, extra, **kwargs):
    return causal_pola_linear_attention(q, k, v, extra[0], chunk_size=16, **kwargs)


def _pacs_call(q, k, v, extra, **kwargs):
    return causal_pacs_linear_attention(q, k, v, extra[0], extra[1], *extra[2:], chunk_size=16, **kwargs)


def _op_inputs(op, b, n, dtype, device):
    d = 9  # Pola's features are 2d = 18 channels: two feature tiles under the interpreter
    q, k = (torch.randn(b, 2, n, d, dtype=dtype, device=device) for _ in range(2))
    if op == "pola":
        v = torch.randn(b, 2, n, 7, dtype=dtype, device=device)  # odd value width: streams of 4 and 3 channels
        extra = [1 + 2 * torch.rand(1, 2, 1, d, dtype=dtype, device=device)]
    else:
        v = torch.randn(b, 2, n, 8, dtype=dtype, device=device)
        extra = [torch.rand(1, 2, 1, 2 * d, dtype=dtype, device=device) for _ in range(2)]
    leaves = [q, k, v, *extra]
    if op == "pacs":  # RoPE tables: not learned
        extra += list(rope_1d(torch.linspace(0.1, 1.0, d, dtype=dtype).repeat_interleave(2), n))
        extra[2:] = [t.to(device) for t in extra[2:]]
    return [t.requires_grad_() for t in leaves], extra


def _run_on(backend, call, q, k, v, extra, leaves, grad_out, **kwargs):
    previous = dispatch.set_attention_backend(backend)
    try:
        result = call(q, k, v, extra, **kwargs)
    finally:
        dispatch.set_attention_backend(previous)
    out, state = result if isinstance(result, tuple) else (result, None)
    loss = (out * grad_out).sum() + (sum(kv.sum() for kv in state.kv) if state is not None else 0)
    return out, state, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("op", ["pola", "pacs"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_causal_ops_through_triton_equal_torch_backend(device, kernel_calls, op, layout):
    dtype = exact_dtype(device)
    call = _pola_call if op == "pola" else _pacs_call
    if layout == "padded":
        (q, k, v, *learned), extra = _op_inputs(op, 2, 21, dtype, device)
        mask = torch.zeros(2, 21, dtype=torch.bool)
        mask[0, -4:] = True
        mask[1, :3] = True
        mask[1, 17] = True
        features = 2 * q.shape[-1]
        kv0 = tuple(torch.randn(2, 2, features, w, dtype=dtype, device=device, requires_grad=True)
                    for w in ((v.shape[-1] + 1) // 2, v.shape[-1] // 2))
        state = CausalState(kv0, torch.rand(2, 2, features, dtype=dtype, device=device) + 1,
                            torch.full((2, 1, 1), 5.0, dtype=dtype, device=device))
        kwargs = dict(key_padding_mask=mask.to(device), initial_state=state, return_state=True)
        leaves = [q, k, v, *learned, *kv0]
        expected_calls = [(2, 2, 21)] * 2
    else:
        (q, k, v, *learned), extra = _op_inputs(op, 1, 30, dtype, device)
        kwargs = dict(cu_seqlens=torch.tensor([0, 5, 5, 30], dtype=torch.int32, device=device))
        leaves = [q, k, v, *learned]
        expected_calls = [(1, 2, 5)] * 2 + [(1, 2, 25)] * 2  # each sequence alone, two streams each
    grad_out = torch.randn(q.shape[:3] + v.shape[-1:], dtype=dtype, device=device)
    out, state, grads = _run_on("triton", call, q, k, v, extra, leaves, grad_out, **kwargs)
    assert kernel_calls == expected_calls
    ref_out, ref_state, ref_grads = _run_on("torch", call, q, k, v, extra, leaves, grad_out, **kwargs)
    assert len(kernel_calls) == len(expected_calls)
    assert_matches(out, ref_out, "out")
    if state is not None:
        for kv, ref_kv in zip(state.kv, ref_state.kv):
            assert_matches(kv, ref_kv, "final state")
    for i, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert_matches(grad, ref_grad, f"gradient of input {i}")


def test_bf16_inputs_take_tf32_products_within_tolerance(device, kernel_calls):
    """Half-precision inputs: features and products in fp32 (TF32 dots on a GPU) against float64."""
    (q, k, v, power), extra = _op_inputs("pola", 1, 40, torch.bfloat16, device)
    grad_out = torch.randn(1, 2, 40, 7, device=device)
    out, _, grads = _run_on("triton", _pola_call, q, k, v, extra, [q, k, v, power], grad_out.bfloat16())
    assert out.dtype == torch.bfloat16 and len(kernel_calls) == 2
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, power)]
    ref_out, _, ref_grads = _run_on("torch", _pola_call, *exact[:3], exact[3:], exact, grad_out.double())
    for name, actual, expected in zip(("out", "q", "k", "v", "power"), (out, *grads), (ref_out, *ref_grads)):
        expected = expected.detach().cpu()
        error = (actual.detach().cpu().double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
        assert error < 1e-2, (name, error.item())


def test_auto_backend_sends_gpu_tensors_to_the_kernel(monkeypatch, device, kernel_calls):
    """Under ``auto`` a GPU tensor's numerator goes to the kernel, a float64 one to torch (CPU tensors count as
    GPU tensors here, and the interpreter runs them)."""
    monkeypatch.setattr(dispatch, "on_gpu", lambda x: True)
    (q, k, v, power), _ = _op_inputs("pola", 1, 12, torch.float32, device)
    previous = dispatch.set_attention_backend("auto")
    try:
        out = causal_pola_linear_attention(q, k, v, power)
        assert kernel_calls == [(1, 2, 12)] * 2
        exact = causal_pola_linear_attention(q.double(), k.double(), v.double(), power.double())
    finally:
        dispatch.set_attention_backend(previous)
    assert len(kernel_calls) == 2
    assert_matches(out, exact.float(), "out")
