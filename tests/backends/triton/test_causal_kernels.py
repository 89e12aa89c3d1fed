"""The fused causal Triton kernels (features, key sums, normaliser and both streams in the kernels) against the
float64 masked O(N²) references of ops/naive.py, forward and every gradient: key padding masks (a
non-contiguous one), packed batches of unequal lengths with an empty sequence, RoPE, an initial and a final
state, fp32/bf16 inputs, and a float64 gradcheck. Without CUDA they run in Triton's interpreter (conftest.py) in
float64; on a CUDA device in float32 against tolerances.

Tolerances (tests/README.md, tests/tolerances.py): under the interpreter in float64 at 1e-9 of the largest entry, far
above reorder_rtol(n, float64) for these sums; on a GPU in float32 products, a relative RMS error below 1e-4,
probable_rtol of the chunk sums."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import (
    causal_linear_attention,
    causal_pacs_linear_attention,
    causal_pola_linear_attention,
    dispatch,
    naive_pacs_linear_attention,
    naive_pola_linear_attention,
    pola_linear_attention,
    rope_1d,
)
from polaformer.ops.causal import CausalState, naive_causal_linear_attention, triton as triton_causal

D = 5  # odd: RoPE's last pair straddles the two feature halves; 2d = 10 channels padded to 16


def exact_dtype(device) -> torch.dtype:
    """float64 under the interpreter; float32 on a GPU, where float64 takes the torch formulation."""
    return torch.float64 if device.type == "cpu" else torch.float32


def assert_matches(actual, expected, name=""):
    """Within 1e-9 of the reference's largest entry in float64 (its gradients sum terms far larger than the
    result); on a GPU (float32 products) a relative RMS error below 1e-4."""
    expected = expected.detach().to(actual.dtype) if actual.dtype == torch.float64 else expected.detach().double()
    if actual.dtype == torch.float64:
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(actual, expected, atol=1e-9 * scale, rtol=1e-9, msg=name)
        return
    error = (actual.detach().double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
    assert error < 1e-4, (name, error.item())


def _angles(dtype, device):
    return torch.linspace(0.1, 1.0, D, dtype=dtype, device=device).repeat_interleave(2)


def _inputs(op, batch, n, dtype, device, rope=False, heads=2):
    """(learned leaves [q, k, v, params…], tables or None)."""
    q, k = (torch.randn(batch, heads, n, D, dtype=dtype, device=device) for _ in range(2))
    if op == "pola":
        v = torch.randn(batch, heads, n, 7, dtype=dtype, device=device)  # odd: streams of 4 and 3 channels
        params = [1 + 2 * torch.rand(1, heads, 1, D, dtype=dtype, device=device)]
    else:
        v = torch.randn(batch, heads, n, 8, dtype=dtype, device=device)
        params = [torch.rand(1, heads, 1, 2 * D, dtype=dtype, device=device) for _ in range(2)]
    tables = rope_1d(_angles(dtype, device), n) if rope else None
    return [t.requires_grad_() for t in (q, k, v, *params)], tables


def _call(op, q, k, v, params, tables, **kwargs):
    if op == "pola":
        return causal_pola_linear_attention(q, k, v, params[0], chunk_size=16, **kwargs)
    return causal_pacs_linear_attention(q, k, v, *params, *(tables or (None, None)), chunk_size=16, **kwargs)


def _reference(op, q, k, v, params, tables, mask=None, eps=1e-6):
    if op == "pola":
        return naive_pola_linear_attention(q, k, v, params[0], eps, key_padding_mask=mask, causal=True)
    return naive_pacs_linear_attention(q, k, v, *params, *(tables or (None, None)), eps=eps, key_padding_mask=mask,
                                       causal=True)


def _compare(actual_out, expected_out, leaves):
    """Output and the gradients of every leaf for one random output gradient."""
    grad_out = torch.randn_like(expected_out)
    assert actual_out.dtype == expected_out.dtype and actual_out.shape == expected_out.shape
    assert_matches(actual_out, expected_out, "out")
    grads = torch.autograd.grad(actual_out, leaves, grad_out)
    ref_grads = torch.autograd.grad(expected_out, leaves, grad_out)
    for i, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert_matches(grad, ref_grad, f"gradient of leaf {i}")


def _compare_to_float64(actual_out, reference, leaves):
    """On a GPU (float32 kernels): output and gradients within 1e-4 relative RMS of ``reference`` evaluated on
    float64 copies of ``leaves``, for one random output gradient."""
    exact_leaves = [leaf.detach().double().requires_grad_() for leaf in leaves]
    exact = reference(exact_leaves)
    grad_out = torch.randn_like(exact)
    pairs = [(actual_out, exact), *zip(torch.autograd.grad(actual_out, leaves, grad_out.to(actual_out.dtype)),
                                        torch.autograd.grad(exact, exact_leaves, grad_out))]
    for i, (actual, expected) in enumerate(pairs):
        expected = expected.detach()
        error = ((actual.detach().double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()
        assert error < 1e-4, ("out" if i == 0 else f"gradient of leaf {i - 1}", error)


@pytest.mark.parametrize("op, rope", [("pola", False), ("pacs", True)])
def test_padded_batch_equals_masked_reference(device, triton_backend, op, rope):
    """37 tokens: chunks of 16, the last partial; the mask a strided view, the second sequence's first keys
    padded (its first queries see no key)."""
    n = 37
    (q, k, v, *params), tables = _inputs(op, 2, n, exact_dtype(device), device, rope)
    mask = (torch.rand(2, 2 * n, device=device) < 0.3)[:, ::2]
    mask[1, :3] = True
    assert not mask.is_contiguous()
    if device.type == "cpu":
        out = _call(op, q, k, v, params, tables, key_padding_mask=mask)
        _compare(out, _reference(op, q, k, v, params, tables, mask), [q, k, v, *params])
        return
    # float32: a query whose few visible keys share no sign with it has a normaliser of eps alone, and with RoPE
    # its numerator cancels O(1) terms, so at eps = 1e-6 no float32 computation (the torch formulation's
    # included) gets that row right; a larger eps keeps every row well conditioned.
    eps = 1e-2
    out = _call(op, q, k, v, params, tables, key_padding_mask=mask, eps=eps)
    exact_tables = tables and tuple(t.double() for t in tables)
    _compare_to_float64(out, lambda leaves: _reference(op, *leaves[:3], leaves[3:], exact_tables, mask, eps),
                        [q, k, v, *params])


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_packed_batch_equals_each_sequence_alone(device, triton_backend, op):
    """Sequences of 5, 0, 35 and 1 tokens packed: the 35 span chunk boundaries that are not the packed axis's;
    PaCS with each sequence's own RoPE positions."""
    lengths = [5, 0, 35, 1]
    (q, k, v, *params), _ = _inputs(op, 1, sum(lengths), exact_dtype(device), device)
    offsets = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32, device=device)
    tables = None
    if op == "pacs":
        parts = [rope_1d(_angles(q.dtype, device), n) for n in lengths]
        tables = tuple(torch.cat([part[i] for part in parts]) for i in range(2))
    out = _call(op, q, k, v, params, tables, cu_seqlens=offsets)
    pieces, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        if n:
            pieces.append(_reference(op, q[:, :, rows], k[:, :, rows], v[:, :, rows], params,
                                     tables and tuple(t[rows] for t in tables)))
        start += n
    _compare(out, torch.cat(pieces, dim=2), [q, k, v, *params])


def _run(backend, fn):
    previous = dispatch.set_attention_backend(backend)
    try:
        return fn()
    finally:
        dispatch.set_attention_backend(previous)


@pytest.mark.parametrize("op", ["pola", "linear"])
def test_initial_and_final_state_equal_the_torch_form(device, op):
    """A state carried in (its kv and key sum learned) and out (its gradients used), with padding: the kernels
    and the torch chunked form agree on the output, the final state and every gradient."""
    dtype, n = exact_dtype(device), 21
    mask = torch.zeros(2, n, dtype=torch.bool, device=device)
    mask[0, -4:] = True
    mask[1, 17] = True
    if op == "pola":
        (q, k, v, power), _ = _inputs("pola", 2, n, dtype, device)
        widths, learned = (4, 3), [q, k, v, power]
    else:  # given non-negative features, one stream
        q, k = (torch.rand(2, 2, n, 6, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 2, n, 5, dtype=dtype, device=device, requires_grad=True)
        widths, learned = (5,), [q, k, v]
    features = q.shape[-1] * (2 if op == "pola" else 1)
    kv = tuple(torch.randn(2, 2, features, w, dtype=dtype, device=device, requires_grad=True) for w in widths)
    key_sum = (torch.rand(2, 2, features, dtype=dtype, device=device) + 1).requires_grad_()
    state = CausalState(kv, key_sum, torch.full((2, 1, 1), 5.0, dtype=dtype, device=device))
    grad_out = torch.randn(2, 2, n, v.shape[-1], dtype=dtype, device=device)

    def run():
        if op == "pola":
            out, final = causal_pola_linear_attention(q, k, v, power, chunk_size=16, key_padding_mask=mask,
                                                      initial_state=state, return_state=True)
        else:
            out, final = causal_linear_attention(q, k, v, chunk_size=16, initial_state=state)
        loss = (out * grad_out).sum() + sum((i + 1) * s.sum() for i, s in enumerate(final.kv)) + final.key_sum.sum()
        return out, final, torch.autograd.grad(loss, [*learned, *kv, key_sum])

    out, final, grads = _run("triton", run)
    ref_out, ref_final, ref_grads = _run("torch", run)
    assert_matches(out, ref_out, "out")
    for name, actual, expected in zip(("kv", "kv", "key sum", "count"), (*final.kv, final.key_sum, final.count),
                                      (*ref_final.kv, ref_final.key_sum, ref_final.count)):
        assert actual.shape == expected.shape
        assert_matches(actual, expected, f"final {name}")
    for i, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert_matches(grad, ref_grad, f"gradient {i}")
    if op == "linear":  # and the definition itself, from an empty state
        exact = naive_causal_linear_attention(q, k, v)
        assert_matches(_run("triton", lambda: causal_linear_attention(q, k, v, chunk_size=16)[0]), exact, "weights")


@pytest.mark.parametrize("dtype, rope, tolerance", [(torch.float32, False, 1e-5), (torch.bfloat16, True, 1e-2)])
def test_low_precision_inputs_accumulate_in_fp32(device, triton_backend, dtype, rope, tolerance):
    """fp32 and bf16 inputs (TF32 dots for bf16 on a GPU) against float64, output in the inputs' dtype."""
    (q, k, v, ts, to), tables = _inputs("pacs", 1, 40, dtype, device, rope, heads=1)
    out = _call("pacs", q, k, v, [ts, to], tables)
    assert out.dtype == dtype
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, ts, to)]
    ref = _reference("pacs", *exact[:3], exact[3:], tables and tuple(t.double() for t in tables))
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, [q, k, v, ts, to], grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref, exact, grad_out)
    for name, actual, expected in zip(("out", "q", "k", "v", "ts", "to"), (out, *grads), (ref, *ref_grads)):
        expected = expected.detach()
        error = (actual.detach().double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
        assert error < tolerance, (name, error.item())


@pytest.mark.skipif(torch.cuda.is_available(), reason="float64 takes the torch formulation on a GPU")
def test_float64_gradcheck(triton_backend):
    """torch.autograd.gradcheck (fast mode) over q, k, v and the exponent of a masked two-chunk Pola call."""
    n = 18
    (q, k, v, power), _ = _inputs("pola", 1, n, torch.float64, torch.device("cpu"), heads=1)
    v = v[..., :3].detach().requires_grad_()
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 3] = True
    assert torch.autograd.gradcheck(
        lambda *leaves: _call("pola", *leaves[:3], leaves[3:], None, key_padding_mask=mask), (q, k, v, power),
        fast_mode=True)


@pytest.fixture
def fused_calls(monkeypatch):
    """The feature map of every call the ops make to the fused kernels."""
    calls = []
    original = triton_causal.causal_attention

    def spy(feature, *args, **kwargs):
        calls.append(feature)
        return original(feature, *args, **kwargs)

    monkeypatch.setattr(triton_causal, "causal_attention", spy)
    return calls


def test_auto_backend_sends_gpu_tensors_to_the_kernels(monkeypatch, device, fused_calls):
    """Under ``auto`` a GPU tensor goes to the kernels (the bidirectional op's ``causal=True`` too), a float64
    one and a state whose count takes gradients to torch (CPU tensors count as GPU tensors here)."""
    monkeypatch.setattr(dispatch, "on_gpu", lambda x: True)
    (q, k, v, power), _ = _inputs("pola", 1, 12, torch.float32, device)
    previous = dispatch.set_attention_backend("auto")
    try:
        out = causal_pola_linear_attention(q, k, v, power)
        pola_linear_attention(q, k, v, power, causal=True)
        assert fused_calls == ["pola", "pola"]
        exact = causal_pola_linear_attention(q.double(), k.double(), v.double(), power.double())
        counted = CausalState((torch.zeros(1, 2, 2 * D, 4, device=device), torch.zeros(1, 2, 2 * D, 3, device=device)),
                              torch.zeros(1, 2, 2 * D, device=device), torch.zeros(1, 1, 1, device=device,
                                                                                   requires_grad=True))
        causal_pola_linear_attention(q, k, v, power, initial_state=counted)
    finally:
        dispatch.set_attention_backend(previous)
    assert fused_calls == ["pola", "pola"]
    assert_matches(out, exact.float(), "out")
