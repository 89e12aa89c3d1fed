"""The layer ops on the Triton kernels (``pola_layer_attention``, ``pacs_layer_attention``): the layers' raw
parameters (softplus scale, the exponent's and the temperatures' weights), key positions, the local branch and the
gate fused into the kernels, against the float64 O(N²) reference (ops/naive.py) forward and for every gradient,
the parameters' included; and in bf16 within the dtype's rounding. In Triton's interpreter without CUDA."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import (
    linear_attention_weights,
    naive_pacs_layer_attention,
    naive_pola_layer_attention,
    pacs_layer_attention,
    pola_layer_attention,
    power_feature,
    rope_2d,
    rope_angles,
)
from precision import half_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float64 kernels against the float64 reference: the two differ by rounding only
EXACT = 1e-12


def rms_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    diff = actual.detach().double().cpu() - expected
    return (diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def _leaves(shapes: dict, dtype, scale: float = 1.0) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {name: None if shape is None else
            (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(DEVICE, dtype).requires_grad_()
            for name, shape in shapes.items()}


def _compare(op, reference, tensors: dict, options: dict, tolerance: float):
    """Forward and the gradient of every tensor of ``tensors`` (keyword arguments of both ops), op against the
    float64 reference on the same (rounded) values."""
    names = [name for name, t in tensors.items() if t is not None]
    out = op(**tensors, **options)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, [tensors[n] for n in names], grad_out.to(out))
    exact = {n: t.detach().double().cpu().requires_grad_() for n, t in tensors.items() if t is not None}
    cpu_options = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in options.items()}
    expected = reference(**{**tensors, **exact}, **cpu_options)
    expected_grads = torch.autograd.grad(expected, [exact[n] for n in names], grad_out)
    assert out.dtype == tensors["v"].dtype and out.shape == expected.shape
    assert rms_ratio(out, expected) < tolerance
    for name, grad, want in zip(names, grads, expected_grads):
        assert grad.shape == tensors[name].shape and grad.dtype == tensors[name].dtype, name
        assert rms_ratio(grad, want) < tolerance, name


POLA_CASES = {
    # b, h, n, m, d, dv, key positions, local rows, gate, mask: a class token (no local row), per-key positions
    "deit-like": dict(shape=(2, 2, 21, 21, 8, 8), positions=(1, 2, 21, 8), local=20, gate=True, mask=True),
    "pvt-like": dict(shape=(2, 1, 20, 5, 16, 16), positions=(1, 1, 5, 16), local=20, gate=True, mask=False),
    "one-row-positions": dict(shape=(1, 2, 17, 17, 6, 7), positions=(1, 2, 1, 6), local=None, gate=True,
                              mask=False),
    "local-no-gate": dict(shape=(2, 2, 18, 18, 8, 6), positions=None, local=18, gate=False, mask=False),
}


def _pola_tensors(case, dtype, per_batch=False):
    b, h, n, m, d, dv = case["shape"]
    params = (b if per_batch else 1, h, 1, d)
    return _leaves(dict(q=(b, h, n, d), k=(b, h, m, d), v=(b, h, m, dv), scale=params, power=params,
                        key_positions=case["positions"],
                        local=None if case["local"] is None else (b, h, case["local"], dv),
                        gate=(b, h, n, dv) if case["gate"] else None), dtype)


@pytest.mark.parametrize("case", POLA_CASES)
def test_pola_layer_op_matches_reference_in_float64(triton_backend, case):
    config = POLA_CASES[case]
    tensors = _pola_tensors(config, torch.float64, per_batch=case == "local-no-gate")
    options = dict(alpha=3.0, eps=1e-6)
    if config["mask"]:
        mask = torch.rand(config["shape"][0], config["shape"][3], generator=torch.Generator().manual_seed(2)) < 0.3
        mask[-1] = True  # a sequence without keys: zero attention, only the local branch and gate
        options["key_padding_mask"] = mask.to(DEVICE)
    _compare(pola_layer_attention, naive_pola_layer_attention, tensors, options, EXACT)


def test_pola_layer_op_packed_matches_each_sequence_alone(triton_backend):
    offsets = [0, 7, 7, 30]
    tensors = _leaves(dict(q=(1, 2, 30, 8), k=(1, 2, 30, 8), v=(1, 2, 30, 6), scale=(1, 2, 1, 8),
                           power=(1, 2, 1, 8), local=(1, 2, 30, 6), gate=(1, 2, 30, 6)), torch.float64)

    def reference(q, k, v, scale, power, local, gate, alpha, eps, cu_seqlens):
        parts = [naive_pola_layer_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], scale, power, alpha, None,
                                            eps, local=local[:, :, a:e], gate=gate[:, :, a:e])
                 for a, e in zip(offsets, offsets[1:]) if e > a]
        return torch.cat(parts, dim=2)

    options = dict(alpha=4.0, eps=1e-6, cu_seqlens=torch.tensor(offsets, device=DEVICE))
    _compare(pola_layer_attention, reference, tensors, options, EXACT)


def _parameter_term_sums(q, k, v, scale, power, alpha, key_positions, local, gate, grad_out):
    """Σ over tokens of |each token's term| of the scale's and the exponent's weight gradients, in float64: the
    scale's terms are ``dL/dx · x`` of the scaled queries and keys (times ``-σ(w)/softplus(w)``), the exponent's
    ``Σ_halves dL/dφ · φ · ln|x|`` of their features (times ``α·σ'(w)``). Each term carries at most
    ``ROUNDINGS`` roundings; their sum cancels, so its error is bounded by these sums, not by the result."""
    divisor = torch.nn.functional.softplus(scale)
    xs = [(q / divisor).detach().requires_grad_(), ((k + key_positions) / divisor).detach().requires_grad_()]
    p = 1 + alpha * torch.sigmoid(power)
    features = [power_feature(x, p) for x in xs]
    for phi in features:
        phi.retain_grad()
    d = q.shape[-1]
    swapped = torch.cat([features[0][..., d:], features[0][..., :d]], -1)
    same, opposite = (linear_attention_weights(phi_q, features[1]) for phi_q in (features[0], swapped))
    halves = v.shape[-1] - v.shape[-1] // 2
    out = torch.cat([same @ v[..., :halves], opposite @ v[..., halves:]], -1)
    out = (out + torch.nn.functional.pad(local, (0, 0, 1, 0))) * gate
    out.backward(grad_out)
    scale_terms = sum((x.grad * x).abs().sum((0, 2), keepdim=True) for x in xs)
    power_terms = sum(((phi.grad * phi)[..., :d] + (phi.grad * phi)[..., d:]).mul(x.abs().log()).abs()
                      .sum((0, 2), keepdim=True) for x, phi in zip(xs, features))
    slope = torch.sigmoid(power) * (1 - torch.sigmoid(power))
    return scale_terms * torch.sigmoid(scale) / divisor, power_terms * alpha * slope


def test_pola_layer_op_in_bf16(triton_backend):
    """bf16 projections and fp32 parameters (a layer under autocast, its scale near the initial softplus(0)):
    outputs and per-token gradients within ROUNDINGS unit roundoffs; the parameters' gradients, sums over every
    token, within that many roundoffs of the sum of their terms' magnitudes."""
    config = POLA_CASES["deit-like"]
    tensors = _pola_tensors(config, torch.bfloat16)
    for name, spread in (("scale", 0.3), ("power", 1.0), ("key_positions", 1.0)):
        tensors[name] = (tensors[name].detach().float() * spread).requires_grad_()
    names = list(tensors)
    out = pola_layer_attention(**tensors, alpha=4.0)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = dict(zip(names, torch.autograd.grad(out, list(tensors.values()), grad_out.to(out))))
    exact = {n: t.detach().double().cpu().requires_grad_() for n, t in tensors.items()}
    expected = naive_pola_layer_attention(**exact, alpha=4.0)
    expected_grads = dict(zip(names, torch.autograd.grad(expected, list(exact.values()), grad_out)))
    tolerance = half_tolerance(torch.bfloat16)
    assert rms_ratio(out, expected) < tolerance
    for name in ("q", "k", "v", "key_positions", "local", "gate"):
        assert rms_ratio(grads[name], expected_grads[name]) < tolerance, name
    term_sums = _parameter_term_sums(*(exact[n].detach() for n in ("q", "k", "v", "scale", "power")), 4.0,
                                     *(exact[n].detach() for n in ("key_positions", "local", "gate")), grad_out)
    for name, sums in zip(("scale", "power"), term_sums):
        error = grads[name].double().cpu() - expected_grads[name]
        assert error.pow(2).mean().sqrt() < tolerance * sums.pow(2).mean().sqrt(), name


def test_pola_layer_op_gradcheck(triton_backend):
    tensors = _pola_tensors(dict(shape=(1, 1, 5, 4, 4, 3), positions=(1, 1, 4, 4), local=4, gate=True),
                            torch.float64)
    names = list(tensors)
    assert torch.autograd.gradcheck(lambda *x: pola_layer_attention(**dict(zip(names, x)), alpha=2.0),
                                    tuple(tensors.values()), fast_mode=True)


def _pacs_tensors(b, h, n, d, dtype, local_rows=None, gate=True):
    return _leaves(dict(q=(b, h, n, d), k=(b, h, n, d), v=(b, h, n, d), same=(1, h, 1, 2 * d),
                        opposite=(h, 1, 2 * d), local=None if local_rows is None else (b, h, local_rows, d),
                        gate=(b, h, n, d) if gate else None), dtype)


@pytest.mark.parametrize("variant", ["rope", "mask", "packed"])
def test_pacs_layer_op_matches_reference_in_float64(triton_backend, variant):
    tensors = _pacs_tensors(2 if variant != "packed" else 1, 2, 16, 8, torch.float64, local_rows=15)
    options = dict(eps=1e-6)
    if variant == "rope":
        options["sin"], options["cos"] = (t.to(DEVICE, torch.float64) for t in rope_2d(rope_angles(16, 1), 4, 4))
    elif variant == "mask":
        options["key_padding_mask"] = (torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.3).to(DEVICE)
    if variant != "packed":
        _compare(pacs_layer_attention, naive_pacs_layer_attention, tensors, options, EXACT)
        return
    tensors["local"] = tensors["local"].detach()[:, :, :1].expand(1, 2, 16, 8).clone().requires_grad_()
    offsets = [0, 9, 16]

    def reference(q, k, v, same, opposite, local, gate, eps, cu_seqlens):
        return torch.cat([naive_pacs_layer_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], same, opposite,
                                                     eps=eps, local=local[:, :, a:e], gate=gate[:, :, a:e])
                          for a, e in zip(offsets, offsets[1:])], dim=2)

    _compare(pacs_layer_attention, reference, tensors, dict(options, cu_seqlens=torch.tensor(offsets, device=DEVICE)),
             EXACT)


def test_pacs_layer_op_in_bf16_with_local_branch_only(triton_backend):
    tensors = _pacs_tensors(2, 1, 16, 8, torch.bfloat16, local_rows=16, gate=False)
    for name in ("same", "opposite"):
        tensors[name] = tensors[name].detach().float().requires_grad_()
    sin, cos = (t.to(DEVICE) for t in rope_2d(rope_angles(16, 1), 4, 4))
    _compare(pacs_layer_attention, naive_pacs_layer_attention, tensors, dict(sin=sin, cos=cos),
             half_tolerance(torch.bfloat16))
