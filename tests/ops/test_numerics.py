"""Both bidirectional ops at large magnitudes: finite, and equal to an O(N²) float64 reference computed in the
log domain (the plain naive reference overflows float64 itself past |x| ≈ 700), forward and gradients, on the
torch and native CPU backends and the Triton kernels (CUDA, or the interpreter on CPU tensors), float32 and
float16 inputs.

Tolerances (tests/README.md, tests/tolerances.py): relative to each result's largest entry, 2e-3 (float32) and 1e-2
(float16) against the float64 log-domain reference. The features' own rounding at these magnitudes is an absolute
error u·|log φ| in the exponent (p·u·ln|x| for a power, u·|s·x| for PaCS), which a normalised output turns into at
most twice that times max|v|: below 1e-4 for the powers in float32 at 1e30, and up to the values' own rounding where
PaCS's weights saturate (one key per row); float16's u is 4.9e-4, and its inputs' rounding moves a feature by p·u =
1.5e-3."""
import pytest
import torch

from polaformer.ops import pacs_linear_attention, pola_linear_attention, rope_2d, rope_angles
from polaformer.ops.dispatch import set_attention_backend

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64
MAGNITUDES = {torch.float32: [1e2, 1e4, 1e8, 1e16, 1e30], torch.float16: [1e2, 1e4]}
CASES = [(dtype, mag) for dtype, mags in MAGNITUDES.items() for mag in mags]


def _log_positive(x, log_f):
    """``log f(x)`` where x > 0, -inf elsewhere (f(0) = 0), with finite gradients."""
    positive = x > 0
    return torch.where(positive, log_f(torch.where(positive, x, 1.0)), -torch.inf)


def _log_features(x, log_f):
    """``log φ`` of the features ``[f(x⁺) ; f(x⁻)]``."""
    return torch.cat([_log_positive(x, log_f), _log_positive(-x, log_f)], -1)


def _weighted_sum(log_q, log_k, v, eps, mixing=None):
    """``Σ_j w(t, j)·v_j / (Σ_j w_den(t, j) + M·eps)`` with ``w_den = Σ_c e^(log φq_c + log φk_c)``, every
    exponent shifted by the row's largest normaliser term. ``mixing`` (N, M, P, 2, 2), RoPE's coupling of the
    channel pairs in the numerator; None: the numerator weights are the normaliser's."""
    b, h, n, two_d = log_q.shape
    m = log_k.shape[-2]
    exponents = log_q[..., :, None, :] + log_k[..., None, :, :]  # (B, H, N, M, 2d)
    row_max = exponents.detach().amax(dim=(3, 4), keepdim=True).clamp_min(0)
    w_den = torch.exp(exponents - row_max).sum(-1)
    w_num = w_den
    if mixing is not None:
        pairs = log_q.reshape(b, h, n, 1, two_d // 2, 2, 1) + log_k.reshape(b, h, 1, m, two_d // 2, 1, 2)
        w_num = (torch.exp(pairs - row_max[..., None, None]) * mixing).sum(dim=(4, 5, 6))
    return (w_num @ v) / (w_den.sum(-1, keepdim=True) + m * eps * torch.exp(-row_max[..., 0]))


def _pacs_reference(q, k, v, temp_same, temp_opposite, sin=None, cos=None, eps=1e-6):
    """float64 PaCS attention: features ``exp(x) − 1``, so ``log φ = x + log(1 − e^-x)``."""
    def log_exp_minus_one(x):
        return x + torch.log(-torch.expm1(-x))
    log_k = _log_features(k, log_exp_minus_one)
    mixing = None
    if sin is not None:  # (R_t a)·(R_j b) = aᵀ R(θ_j − θ_t) b per channel pair
        s_t, c_t = sin[:, None, 0::2], cos[:, None, 0::2]
        s_j, c_j = sin[None, :, 0::2], cos[None, :, 0::2]
        cos_d, sin_d = c_j * c_t + s_j * s_t, s_j * c_t - c_j * s_t
        mixing = torch.stack([torch.stack([cos_d, -sin_d], -1), torch.stack([sin_d, cos_d], -1)], -2)
    half = v.shape[-1] // 2
    outs = []
    for temps, swap, values in ((temp_same, False, v[..., :half]), (temp_opposite, True, v[..., half:])):
        q_halves = torch.cat([torch.relu(-q), torch.relu(q)] if swap else [torch.relu(q), torch.relu(-q)], -1)
        log_q = _log_positive(q_halves * temps, log_exp_minus_one)
        outs.append(_weighted_sum(log_q, log_k, values, eps, mixing))
    return torch.cat(outs, -1)


def _pola_reference(q, k, v, power, eps=1e-6):
    """float64 PolaFormer attention: features ``|x|ᵖ``, so ``log φ = p·log|x|`` per channel."""
    def log_power(x):
        return power * torch.log(x)
    log_q, log_k = _log_features(q, log_power), _log_features(k, log_power)
    d = q.shape[-1]
    def swap(t):
        return torch.cat([t[..., d:], t[..., :d]], -1)
    half = (v.shape[-1] + 1) // 2
    return torch.cat([_weighted_sum(log_q, log_k, v[..., :half], eps),
                      _weighted_sum(swap(log_q), log_k, v[..., half:], eps)], -1)


@pytest.fixture(params=["torch", "native", "triton"])
def backend(request):
    """The backend in force and the device its inputs live on (CUDA for Triton where present)."""
    previous = set_attention_backend(request.param)
    yield "cuda" if request.param == "triton" and torch.cuda.is_available() else "cpu"
    set_attention_backend(previous)


def _inputs(magnitude, dtype, seed, d=4, dv=6, n=5, m=6):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 2, n, d, generator=gen, dtype=F64) * magnitude).to(dtype)
    k = (torch.randn(1, 2, m, d, generator=gen, dtype=F64) * magnitude).to(dtype)
    v = torch.randn(1, 2, m, dv, generator=gen).to(dtype)
    return q, k, v, gen


def _check(op, reference, leaves, dtype, device, temperature=False):
    """Forward and gradients of ``op`` against ``reference`` in float64, relative to each result's largest
    entry. PaCS's temperature gradient is ``Σ ∂out/∂x·q`` with ``x = q·t``: float32's rounding of the
    saturated weights' gradient (which cancels exactly in float64) comes out multiplied by |q|, so that one
    is compared on its natural scale |q|·|v|, to 64 ulps of the products' precision: float32's, or TF32's
    (2⁻¹¹) for half-precision inputs, whose features the GPU kernels multiply in TF32 (docs/gpu.md)."""
    leaves = [t.detach().to(device).requires_grad_() for t in leaves]
    out = op(*leaves)
    assert out.dtype == dtype
    grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
    grads = torch.autograd.grad(out, leaves, grad_out.to(device))
    leaves64 = [t.detach().to("cpu", F64).requires_grad_() for t in leaves]
    ref = reference(*leaves64)
    refs = torch.autograd.grad(ref, leaves64, grad_out.to(F64))
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    names = ("out", "grad q", "grad k", "grad v", "grad temperatures" if temperature else "grad power")
    q_scale, v_scale = (leaves64[i].abs().max().item() for i in (0, 2))
    for name, a, b in zip(names, (out, *grads), (ref, *refs)):
        assert torch.isfinite(a).all(), name
        atol = tol * max(1.0, b.abs().max().item())
        if name == "grad temperatures":
            atol += 64 * (2**-24 if dtype == torch.float32 else 2**-11) * q_scale * v_scale
        torch.testing.assert_close(a.to("cpu", F64), b, rtol=tol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype, magnitude", CASES)
def test_pacs_is_finite_and_exact_at_large_magnitudes(backend, dtype, magnitude):
    q, k, v, gen = _inputs(magnitude, dtype, seed=1)
    temps = (0.25 + 0.5 * torch.rand(1, 2, 1, 8, generator=gen)).to(dtype)
    _check(lambda q, k, v, t: pacs_linear_attention(q, k, v, t, t.flip(-1)),
           lambda q, k, v, t: _pacs_reference(q, k, v, t, t.flip(-1)), (q, k, v, temps), dtype, backend, True)


# With RoPE the numerator pairs channels that its normaliser does not, so the true output grows like e^|x|
# (past float32 from |x| ≈ 50 on): a magnitude where the plain path overflows but the output fits.
@pytest.mark.parametrize("magnitude", [30])
def test_pacs_with_rope_is_finite_and_exact_at_large_magnitudes(backend, magnitude):
    q, k, v, gen = _inputs(magnitude, torch.float32, seed=2, n=6, m=6)
    temps = 0.25 + 0.5 * torch.rand(1, 2, 1, 8, generator=gen)
    sin, cos = rope_2d(rope_angles(16, 2, dtype=F64), 2, 3)
    sin32, cos32 = sin.float().to(backend), cos.float().to(backend)
    _check(lambda q, k, v, t: pacs_linear_attention(q, k, v, t, t.flip(-1), sin32, cos32),
           lambda q, k, v, t: _pacs_reference(q, k, v, t, t.flip(-1), sin, cos), (q, k, v, temps), torch.float32,
           backend, True)


@pytest.mark.parametrize("dtype, magnitude", CASES)
def test_pola_is_finite_and_exact_at_large_magnitudes(backend, dtype, magnitude):
    q, k, v, gen = _inputs(magnitude, dtype, seed=3, dv=5)
    power = (1 + 2 * torch.rand(1, 2, 1, 4, generator=gen)).to(dtype)
    power[..., 0] = 3.0
    _check(pola_linear_attention, _pola_reference, (q, k, v, power), dtype, backend)


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_padded_keys_of_any_magnitude_do_not_shift_the_real_ones(backend, op):
    """Padded keys hold 1e30 (finite, as the mask contract asks): the per-channel key shift ignores them."""
    q, k, v, gen = _inputs(1e2, torch.float32, seed=4)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, 4:] = True
    k[:, :, 4:] = 1e30
    q, k, v, mask = (t.to(backend) for t in (q, k, v, mask))
    k.requires_grad_()
    if op == "pola":
        power = torch.full((1, 2, 1, 4), 3.0, device=backend)
        out = pola_linear_attention(q, k, v, power, key_padding_mask=mask)
        ref = _pola_reference(*(t.detach().cpu().double() for t in (q, k[:, :, :4], v[:, :, :4], power)))
    else:
        temps = (0.25 + 0.5 * torch.rand(1, 2, 1, 8, generator=gen)).to(backend)
        out = pacs_linear_attention(q, k, v, temps, temps, key_padding_mask=mask)
        ref = _pacs_reference(*(t.detach().cpu().double() for t in (q, k[:, :, :4], v[:, :, :4], temps, temps)))
    torch.testing.assert_close(out.detach().cpu().double(), ref, rtol=2e-3, atol=2e-3)
    (grad_k,) = torch.autograd.grad(out.sum(), k)
    assert torch.isfinite(grad_k).all()
    assert not grad_k[:, :, 4:].any()


def test_pola_keys_whose_sum_overflows_float32(backend):
    """Each |k|ᵖ fits float32 but the sum over 64 keys of |k|ᵖ·v does not (the Triton kernels once returned
    zeros and NaN there)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 16, 8, generator=gen)
    k = 1.67e8 * (1 - 0.01 * torch.rand(1, 1, 64, 8, generator=gen))
    v = torch.randn(1, 1, 64, 8, generator=gen)
    power = torch.full((1, 1, 1, 8), 4.5)
    _check(pola_linear_attention, _pola_reference, (q, k, v, power), torch.float32, backend)


@pytest.mark.parametrize("magnitude, keys", [(85.0, 64), (84.0, 1000)])
def test_pacs_keys_whose_exp_sum_overflows_float32(backend, magnitude, keys):
    """``e^|k|`` fits float32 but its sum over the keys does not (|k| above 88.7 − ln M; the Triton kernels once
    returned non-finite values there)."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 1, 8, 4, generator=gen)
    k = magnitude - 0.5 * torch.rand(1, 1, keys, 4, generator=gen)
    v = torch.randn(1, 1, keys, 4, generator=gen)
    temps = 0.25 + 0.5 * torch.rand(1, 1, 1, 8, generator=gen)
    _check(lambda q, k, v, t: pacs_linear_attention(q, k, v, t, t.flip(-1)),
           lambda q, k, v, t: _pacs_reference(q, k, v, t, t.flip(-1)), (q, k, v, temps), torch.float32, backend,
           True)
