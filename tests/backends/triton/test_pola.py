"""The fused Triton Pola kernels against the float64 O(N²) reference (ops/naive.py): forward and every
gradient, over a covering set of shapes, masks, packed batches, dtypes and magnitudes. Without CUDA they run
in Triton's interpreter (see conftest.py), which does not check bounds: the buffers the kernels write are
views into larger sentinel-filled buffers whose margins are checked afterwards."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import dispatch, naive_pola_linear_attention, pola_linear_attention
from precision import half_tolerance

SENTINEL = 1234.5


def rms_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS(actual − expected) / RMS(expected), in float64."""
    expected = expected.detach().cpu().double()
    diff = actual.detach().cpu().double() - expected
    scale = expected.pow(2).mean().sqrt().clamp_min(1e-300)
    return (diff.pow(2).mean().sqrt() / scale).item()


def make_inputs(b, h, n, m, d, dv, dtype, device, magnitude=1.0, per_batch_power=False):
    q = (torch.randn(b, h, n, d, dtype=torch.float64) * magnitude).to(device=device, dtype=dtype)
    k = (torch.randn(b, h, m, d, dtype=torch.float64) * magnitude).to(device=device, dtype=dtype)
    v = torch.randn(b, h, m, dv, dtype=torch.float64).to(device=device, dtype=dtype)
    power = 1 + 3 * torch.rand(b if per_batch_power else 1, h, 1, d, dtype=torch.float64)
    return q, k, v, power.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)


def reference(q, k, v, power, grad_out, **kwargs):
    """Output and gradients (q, k, v, power) of the float64 naive reference on the same (rounded) inputs."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, power)]
    out = naive_pola_linear_attention(*leaves, **{name: t.cpu() for name, t in kwargs.items()})
    return out, torch.autograd.grad(out, leaves, grad_out.cpu().double())


def kernel_run(q, k, v, power, grad_out, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, power)]
    out = pola_linear_attention(*leaves, **kwargs)
    return out, torch.autograd.grad(out, leaves, grad_out)


CASES = [
    # (B, N, M, d, dv, mask): N ≠ M, head widths 48 and 40, odd value widths, N = 1, several blocks and chunks.
    pytest.param(1, 1, 16, 8, 6, False, id="N1-M16"),
    pytest.param(2, 17, 17, 48, 7, False, id="N17-d48-dv7"),
    pytest.param(2, 64, 16, 40, 16, True, id="N64-M16-d40-mask"),
    pytest.param(1, 100, 100, 16, 9, False, id="N100-dv9"),
    pytest.param(2, 100, 16, 32, 8, True, id="N100-M16-mask"),
]


@pytest.mark.parametrize("b, n, m, d, dv, masked", CASES)
def test_fp32_forward_and_grads_match_reference(triton_backend, device, b, n, m, d, dv, masked):
    q, k, v, power = make_inputs(b, 2, n, m, d, dv, torch.float32, device, per_batch_power=masked)
    kwargs = {}
    if masked:
        mask = torch.rand(b, m) < 0.3
        mask[-1] = True  # a sequence with no valid key: zero output and zero gradients
        kwargs["key_padding_mask"] = mask.to(device)
    grad_out = torch.randn(b, 2, n, dv, device=device)
    out, grads = kernel_run(q, k, v, power, grad_out, **kwargs)
    ref_out, ref_grads = reference(q, k, v, power, grad_out, **kwargs)
    assert out.dtype == v.dtype and out.shape == ref_out.shape
    assert rms_ratio(out, ref_out) < 1e-5
    for name, grad, ref_grad in zip("qkvp", grads, ref_grads):
        assert grad.shape == ref_grad.shape, name
        assert rms_ratio(grad, ref_grad) < 1e-5, name
    if masked:
        assert torch.all(out[-1] == 0) and all(torch.all(g[-1] == 0) for g in grads[:3])


def test_the_gpu_tile_of_narrow_heads_matches_reference(triton_backend, device, monkeypatch):
    """The 64-token, four-warp tile a GPU takes for heads of 32 channels, run wherever the tests run: three
    blocks of queries and keys, the last one partial, with a padding mask."""
    from polaformer.backends.triton import common
    from polaformer.ops.pola import triton as pola

    monkeypatch.setattr(pola, "pola_tile", lambda rows, columns, on_gpu: common.pola_tile(rows, columns, True))
    q, k, v, power = make_inputs(2, 2, 150, 140, 32, 32, torch.float32, device)
    mask = (torch.rand(2, 140) < 0.3).to(device)
    grad_out = torch.randn(2, 2, 150, 32, device=device)
    out, grads = kernel_run(q, k, v, power, grad_out, key_padding_mask=mask)
    ref_out, ref_grads = reference(q, k, v, power, grad_out, key_padding_mask=mask)
    assert rms_ratio(out, ref_out) < 1e-5
    for name, grad, ref_grad in zip("qkvp", grads, ref_grads):
        assert rms_ratio(grad, ref_grad) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(triton_backend, device, dtype):
    q, k, v, power = make_inputs(2, 2, 33, 16, 24, 10, dtype, device)
    grad_out = torch.randn(2, 2, 33, 10, device=device).to(dtype)
    out, grads = kernel_run(q, k, v, power, grad_out)
    ref_out, ref_grads = reference(q, k, v, power, grad_out)
    assert out.dtype == dtype
    assert rms_ratio(out, ref_out) < half_tolerance(dtype)
    for name, grad, ref_grad in zip("qkvp", grads, ref_grads):
        assert rms_ratio(grad, ref_grad) < half_tolerance(dtype), name


def test_exact_zeros_and_large_magnitudes(triton_backend, device):
    """Zero inputs have zero features and zero gradients; float16 inputs near its maximum raised to p ≈ 4
    overflow no fp32 product, thanks to the power-of-two row scale."""
    q, k, v, power = make_inputs(1, 2, 20, 20, 16, 8, torch.float16, device, magnitude=2e4)
    q[0, 0, 3] = 0  # a query row of zeros attends with normaliser eps only
    q[0, 1, :, :4] = 0
    k[0, 0, :, 5] = 0
    power[..., :8] = 4.0
    grad_out = torch.randn(1, 2, 20, 8, device=device).to(torch.float16)
    out, grads = kernel_run(q, k, v, power, grad_out)
    ref_out, ref_grads = reference(q, k, v, power, grad_out)
    assert torch.isfinite(out).all()
    assert rms_ratio(out, ref_out) < half_tolerance(torch.float16)
    assert torch.all(out[0, 0, 3] == 0)
    assert torch.all(grads[0][0, 1, :, :4] == 0) and torch.all(grads[1][0, 0, :, 5] == 0)
    for name, grad, ref_grad in zip("qkv", grads[:3], ref_grads[:3]):
        assert rms_ratio(grad, ref_grad) < half_tolerance(torch.float16), name


def _per_sequence_reference(q, k, v, power, grad_out, query_offsets, key_offsets):
    """Packed output and gradients from the reference run on each sequence alone."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, power)]
    pieces = []
    for s in range(len(query_offsets) - 1):
        qs, qe, ks, ke = query_offsets[s], query_offsets[s + 1], key_offsets[s], key_offsets[s + 1]
        sq, sk, sv = leaves[0][:, :, qs:qe], leaves[1][:, :, ks:ke], leaves[2][:, :, ks:ke]
        if ke == ks:  # no keys: the op's output is zero
            pieces.append(sq.new_zeros(1, q.shape[1], qe - qs, v.shape[-1]))
        else:
            pieces.append(naive_pola_linear_attention(sq, sk, sv, leaves[3]))
    out = torch.cat(pieces, dim=2)
    return out, torch.autograd.grad(out, leaves, grad_out.cpu().double(), allow_unused=True)


@pytest.mark.parametrize("separate_keys", [False, True])
def test_packed_sequences_match_each_sequence_alone(triton_backend, device, separate_keys):
    query_offsets = [0, 5, 5, 40, 57]  # an empty sequence, one spanning several blocks
    key_offsets = [0, 3, 4, 20, 20] if separate_keys else query_offsets  # keys fewer than queries, one empty
    q, _, _, power = make_inputs(1, 2, query_offsets[-1], 1, 16, 7, torch.float32, device)
    _, k, v, _ = make_inputs(1, 2, 1, key_offsets[-1], 16, 7, torch.float32, device)
    grad_out = torch.randn(1, 2, query_offsets[-1], 7, device=device)
    kwargs = {"cu_seqlens": torch.tensor(query_offsets, dtype=torch.int32, device=device)}
    if separate_keys:
        kwargs["cu_seqlens_k"] = torch.tensor(key_offsets, dtype=torch.int64, device=device)
    out, grads = kernel_run(q, k, v, power, grad_out, **kwargs)
    ref_out, ref_grads = _per_sequence_reference(q, k, v, power, grad_out, query_offsets, key_offsets)
    assert rms_ratio(out, ref_out) < 1e-5
    for name, grad, ref_grad in zip("qkvp", grads, ref_grads):
        assert rms_ratio(grad, ref_grad) < 1e-5, name


def test_gradcheck_float64(triton_backend, device):
    """The kernels run in float64 too (fp64 accumulators), so autograd's numerical check applies."""
    q, k, v, power = make_inputs(2, 1, 5, 3, 4, 3, torch.float64, device)
    mask = torch.tensor([[False, True, False], [True, True, True]], device=device)
    leaves = [t.requires_grad_() for t in (q, k, v, power)]
    assert torch.autograd.gradcheck(lambda *x: pola_linear_attention(*x, key_padding_mask=mask), leaves,
                                    fast_mode=True)


def _guarded(shape, dtype, device, transpose_tokens=False):
    """A view of ``shape`` inside a sentinel-filled buffer with margins on every side (optionally with the
    tokens and heads axes laid out transposed), and the buffer."""
    b, h, n, c = shape
    if transpose_tokens:
        buffer = torch.full((b + 2, n + 2, h + 2, c + 3), SENTINEL, dtype=dtype, device=device)
        view = buffer[1:-1, 1:-1, 1:-1, 1:-2].transpose(1, 2)
    else:
        buffer = torch.full((b + 2, h + 2, n + 2, c + 3), SENTINEL, dtype=dtype, device=device)
        view = buffer[1:-1, 1:-1, 1:-1, 1:-2]
    return view, buffer


def _margins_intact(view, buffer):
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    inside.as_strided(view.shape, view.stride(), view.storage_offset())[...] = True
    return bool(torch.all(buffer[~inside] == SENTINEL))


@pytest.mark.parametrize("packed", [False, True])
def test_kernels_write_inside_their_buffers_and_deterministically(device, packed):
    from polaformer.ops.pola.triton import pola_backward, pola_forward

    b = 1 if packed else 2
    q, k, v, power = make_inputs(b, 2, 37, 21, 12, 5, torch.float32, device)
    kwargs = {}
    if packed:
        kwargs["cu_seqlens"] = torch.tensor([0, 16, 37], dtype=torch.int32, device=device)
        kwargs["cu_seqlens_k"] = torch.tensor([0, 1, 21], dtype=torch.int32, device=device)
    else:
        kwargs["key_padding_mask"] = torch.tensor([[False] * 20 + [True], [True] * 21], device=device)
    out, out_buffer = _guarded(q.shape[:3] + (5,), torch.float32, device, transpose_tokens=True)
    _, state, call = pola_forward(q, k, v, power, 1e-6, out=out, **kwargs)
    if packed:
        expected = _per_sequence_reference(q, k, v, power, torch.zeros_like(out), [0, 16, 37], [0, 1, 21])[0]
    else:
        expected = naive_pola_linear_attention(q.double(), k.double(), v.double(), power.double(), 1e-6, **kwargs)
    assert _margins_intact(out, out_buffer)
    assert rms_ratio(out, expected) < 1e-5

    grad_out = torch.randn_like(out)
    guarded = [_guarded(t.shape, torch.float32, device, transpose_tokens=i == 1) for i, t in enumerate((q, k, v))]
    grads = pola_backward(call, q, k, v, power, state, 1e-6, grad_out, *(view for view, _ in guarded))[:4]
    assert all(_margins_intact(view, buffer) for view, buffer in guarded)
    again = pola_backward(call, q, k, v, power, state, 1e-6, grad_out)[:4]
    assert all(torch.equal(first, second) for first, second in zip(grads, again))


def test_auto_backend_sends_cuda_tensors_to_the_kernels(monkeypatch, device):
    """Under ``auto`` a CUDA tensor reaches the Triton entry point; without CUDA, CPU tensors count as CUDA
    here (the interpreter runs the kernels on them)."""
    from polaformer.ops.pola import triton as pola

    calls = []
    original = pola.PolaAttention.apply

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(pola.PolaAttention, "apply", spy)
    monkeypatch.setattr(dispatch, "on_gpu", lambda x: True)
    previous = dispatch.set_attention_backend("auto")
    try:
        q, k, v, power = make_inputs(1, 1, 9, 4, 8, 4, torch.float32, device)
        out = pola_linear_attention(q, k, v, power.requires_grad_())
    finally:
        dispatch.set_attention_backend(previous)
    assert calls == [q.shape]
    assert rms_ratio(out, naive_pola_linear_attention(q.double(), k.double(), v.double(), power.double())) < 1e-5
    assert not dispatch.triton_allowed(q.double())  # float64 on a GPU: the torch formulation


def test_explicit_triton_backend_that_cannot_run_raises(triton_backend, monkeypatch):
    import polaformer.backends.triton as triton_package

    q, k, v, power = make_inputs(1, 1, 4, 4, 8, 4, torch.float32, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        pola_linear_attention(q, k, v, power)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_package, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        pola_linear_attention(q, k, v, power)
