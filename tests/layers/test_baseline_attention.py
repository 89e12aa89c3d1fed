"""Baseline token mixers (polaformer.layers.baseline_attention): interface, masking, exactness.

Tolerances (tests/README.md, tests/tolerances.py): float64 against the plain formulas at 1e-9 to 1e-12, above
reorder_rtol(n, float64) for their sums (at most a few hundred terms: 1e-13·κ); the Performer projection's
orthogonality at 1e-6 is float32 QR's rounding (n·u for 16 columns: 1e-6); its softmax approximation (0.03) is the
random-feature estimate's own error, not rounding."""
import math

import pytest
import torch
import torch.nn.functional as F

from polaformer.layers import (
    CosformerAttention,
    FocusedLinearAttention,
    KernelizedAttention,
    LinearAttention,
    LinformerAttention,
    NystromAttention,
    PerformerAttention,
    SkyformerAttention,
    SoftmaxAttention,
    iterative_pinv,
)
from token_mixer_helpers import (
    DIM,
    HEAD_DIM,
    HEADS,
    MAX_LEN,
    check_finite_outputs_and_gradients,
    check_input_errors,
    check_padded_contents_never_reach_valid_outputs,
    check_right_padding_gives_the_unpadded_output,
    padded_batch,
    randomize_zero_init,
)

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

BASELINES = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "kernelized": KernelizedAttention,
    "performer": PerformerAttention,
    "nystrom": NystromAttention,
    "linformer": LinformerAttention,
    "cosformer": CosformerAttention,
    "skyformer": SkyformerAttention,
    "focused": FocusedLinearAttention,
}
# Small settings so the approximations are really in use at test lengths (N = 14..18).
SMALL = {
    "performer": {"nb_features": 32, "seed": 0},
    "nystrom": {"num_landmarks": 4},
    "linformer": {"linformer_k": 6},
    "skyformer": {"nb_features": 8},
}
ALL = list(BASELINES)
# Right padding gives exactly the unpadded output (see each class's docstring).
PADDING_INVARIANT = [name for name in ALL if name != "nystrom"]


def make(name, dtype=torch.float64, **options):
    options = {**SMALL.get(name, {}), **options}
    layer = BASELINES[name](DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, **options).to(dtype)
    return randomize_zero_init(layer)


def heads(*shape_n, dtype=torch.float64, scale=1.0):
    return [scale * torch.randn(2, HEADS, n, HEAD_DIM, dtype=dtype) for n in shape_n]


def key_mask(pad):
    return pad[:, None, None, :]


# ----------------------------------------------------------------------------- interface


@pytest.mark.parametrize("name", ALL)
def test_shape_finite_outputs_and_gradients(name):
    check_finite_outputs_and_gradients(make(name, torch.float32))


@pytest.mark.parametrize("name", PADDING_INVARIANT)
def test_right_padding_gives_the_unpadded_output(name):
    check_right_padding_gives_the_unpadded_output(make(name))


@pytest.mark.parametrize("name", ALL)
def test_padded_contents_never_reach_valid_outputs(name):
    check_padded_contents_never_reach_valid_outputs(make(name))


def test_forward_input_checks():
    check_input_errors(make("softmax"))


def test_mask_by_keyword_and_half_precision_input():
    layer = make("cosformer")
    x, pad = padded_batch([12, 5], 12)
    torch.testing.assert_close(layer(x, key_padding_mask=pad), layer(x, pad), atol=0, rtol=0)
    # the core runs in float32 under a bfloat16 input and the output comes back in bfloat16
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16), pad)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("name", [n for n in ALL if n != "linformer"])
def test_max_seq_len_is_optional_except_for_linformer(name):
    layer = BASELINES[name](DIM, HEADS, HEAD_DIM, **SMALL.get(name, {}))
    assert layer(torch.randn(1, 3 * MAX_LEN, DIM)).shape == (1, 3 * MAX_LEN, DIM)


def test_constructor_errors():
    with pytest.raises(TypeError, match="max_seq_len"):
        LinformerAttention(DIM, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="max_seq_len must be a positive int, got None"):
        LinformerAttention(DIM, HEADS, HEAD_DIM, max_seq_len=None)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        SoftmaxAttention(DIM, HEADS, 0)
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        SoftmaxAttention(DIM, HEADS, HEAD_DIM, max_seq_len=0)
    with pytest.raises(ValueError, match="conv_kernel_size must be an odd positive int"):
        NystromAttention(DIM, HEADS, HEAD_DIM, conv_kernel_size=4)
    with pytest.raises(ValueError, match="kernel_size must be an odd positive int"):
        FocusedLinearAttention(DIM, HEADS, HEAD_DIM, kernel_size=2)
    with pytest.raises(ValueError, match="nb_features must be an int >= 2, got 1"):
        SkyformerAttention(DIM, HEADS, HEAD_DIM, nb_features=1)
    for cls, option in ((PerformerAttention, "nb_features"), (NystromAttention, "num_landmarks"),
                        (LinformerAttention, "linformer_k")):
        with pytest.raises(ValueError, match=f"{option} must be a positive int"):
            cls(DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, **{option: 0})


def test_nystrom_depends_on_the_padded_length():
    """Documented limitation: landmarks average stretches of the padded sequence."""
    layer = make("nystrom")
    x, pad = padded_batch([10], 18)
    with torch.no_grad():
        padded, alone = layer(x, pad)[0, :10], layer(x[:, :10])[0]
    assert (padded - alone).abs().max() > 1e-6


# ----------------------------------------------------------------------------- exactness of the cores


def test_softmax_matches_manual_softmax():
    core = make("softmax").core
    q, k, v = heads(12, 12, 12)
    pad = torch.tensor([[False] * 12, [False] * 7 + [True] * 5])
    scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(key_mask(pad), float("-inf"))
    torch.testing.assert_close(core(q, k, v, pad), torch.softmax(scores, -1) @ v, atol=1e-12, rtol=0)


def test_linear_matches_explicit_weights():
    core = make("linear").core
    q, k, v = heads(12, 12, 12)
    pad = torch.tensor([[False] * 12, [False] * 5 + [True] * 7])
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    n = (~pad).sum(-1).to(q.dtype)[:, None, None, None]
    sims = (phi_q @ phi_k.transpose(-2, -1)).masked_fill(key_mask(pad), 0.0)
    weights = (sims / n) / (sims.sum(-1, keepdim=True) / n + 1e-6)
    torch.testing.assert_close(core(q, k, v, pad), weights @ v, atol=1e-12, rtol=0)


def test_kernelized_matches_gaussian_kernel():
    core = make("kernelized").core
    q, k, v = heads(10, 10, 10)
    pad = torch.tensor([[False] * 10, [False] * 4 + [True] * 6])
    sq_dist = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
    weights = torch.exp(-sq_dist / (2 * math.sqrt(HEAD_DIM))).masked_fill(key_mask(pad), 0.0)
    torch.testing.assert_close(core(q, k, v, pad), weights @ v, atol=1e-12, rtol=0)


def test_performer_matches_its_quadratic_form_and_stabilisers_cancel():
    core = make("performer", nb_features=64).core
    core.kernel_eps = 0.0  # then both stabilisers cancel exactly in the ratio
    q, k, v = heads(10, 10, 10, scale=2.0)
    pad = torch.tensor([[False] * 10, [False] * 6 + [True] * 4])
    w = core.projection_matrix
    c = HEAD_DIM**-0.25

    def phi(x):
        x = x * c
        return torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(w.shape[0])

    sims = (phi(q) @ phi(k).transpose(-2, -1)).masked_fill(key_mask(pad), 0.0)
    ref = (sims / sims.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(core(q, k, v, pad), ref, atol=1e-10, rtol=1e-10)


def test_performer_approximates_softmax_with_many_features():
    # Small |q|, |k| keep the estimator's relative variance per feature, e^{|q+k|²/√d} − 1, near 1,
    # so with 4096 features the weights are within ~2 %; observed errors are 0.006–0.012.
    layer = make("performer", nb_features=4096, seed=3)
    q, k, v = heads(12, 12, 12, scale=0.3)
    ref = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v
    assert (layer.core(q, k, v, None) - ref).abs().max() < 0.03


def test_performer_features_are_seeded_orthogonal_buffers():
    a, b = make("performer", seed=7), make("performer", seed=7)
    w = a.core.projection_matrix.clone()
    assert "core.projection_matrix" in a.state_dict()
    torch.testing.assert_close(w, b.core.projection_matrix)
    block = w[:HEAD_DIM] / w[:HEAD_DIM].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(HEAD_DIM, dtype=w.dtype), atol=1e-6, rtol=0)
    a.redraw_features(seed=8)
    assert not torch.allclose(a.core.projection_matrix, w)


def test_nystrom_short_sequences_are_exact_softmax():
    core = make("nystrom", num_landmarks=16).core
    q, k, v = heads(12, 12, 12)
    pad = torch.tensor([[False] * 12, [False] * 8 + [True] * 4])
    scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(key_mask(pad), float("-inf"))
    valid = ~pad[:, None, :].expand(2, HEADS, 12)  # padded query rows are unspecified (zeroed q here)
    out, ref = core(q, k, v, pad), torch.softmax(scores, -1) @ v
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-12, rtol=0)


def test_nystrom_is_exact_when_landmarks_are_the_tokens():
    """Segments of identical tokens: the landmarks are the distinct tokens and Nyström is exact."""
    core = make("nystrom", num_landmarks=6, pinv_iterations=30).core
    q_l, k_l, v = heads(6, 6, 18)
    q, k = q_l.repeat_interleave(3, dim=2), k_l.repeat_interleave(3, dim=2)
    ref = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v
    torch.testing.assert_close(core(q, k, v, None), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("n", [18, 15])
def test_nystrom_matches_its_formula(n):
    landmarks = 6
    core = make("nystrom", num_landmarks=landmarks, pinv_iterations=40).core
    q, k, v = heads(n, n, n)
    c = HEAD_DIM**-0.25
    q, k = q * c, k * c
    # token j belongs to segment floor(j·L/n); for n = 18 these are the original's reshape segments
    segment = [j * landmarks // n for j in range(n)]
    avg = torch.zeros(landmarks, n, dtype=q.dtype)
    for j, s in enumerate(segment):
        avg[s, j] = 1.0
    avg /= avg.sum(-1, keepdim=True)
    if n % landmarks == 0:
        torch.testing.assert_close(avg @ q, q.reshape(2, HEADS, landmarks, n // landmarks, HEAD_DIM).mean(-2))
    q_l, k_l = avg @ q, avg @ k
    ref = (torch.softmax(q @ k_l.transpose(-2, -1), -1)
           @ torch.linalg.pinv(torch.softmax(q_l @ k_l.transpose(-2, -1), -1))
           @ torch.softmax(q_l @ k.transpose(-2, -1), -1) @ v)
    torch.testing.assert_close(core(q / c, k / c, v, None), ref, atol=1e-9, rtol=1e-9)


def test_iterative_pinv_inverts_a_stochastic_matrix():
    a = torch.softmax(torch.randn(3, 5, 5, dtype=torch.float64), -1) + torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(iterative_pinv(a, 20), torch.linalg.inv(a), atol=1e-10, rtol=0)


def test_linformer_matches_its_formula():
    layer = make("linformer", linformer_k=5)
    core = layer.core
    q, k, v = heads(11, 11, 11)
    pad = torch.tensor([[False] * 11, [False] * 6 + [True] * 5])
    e = core.E[..., :11]
    k_p = e @ k.masked_fill(pad[:, None, :, None], 0.0)
    v_p = e @ v.masked_fill(pad[:, None, :, None], 0.0)
    ref = torch.softmax(q @ k_p.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v_p
    torch.testing.assert_close(core(q, k, v, pad), ref, atol=1e-12, rtol=0)
    assert core.E.shape == (HEADS, 5, MAX_LEN) and core.E.requires_grad
    fixed = make("linformer", share_kv=False, learn_projection=False)
    assert {"core.E", "core.F"} <= set(fixed.state_dict())
    assert not any("core." in n for n, _ in fixed.named_parameters())


def test_cosformer_matches_explicit_cos_reweighting():
    core = make("cosformer").core
    q, k, v = heads(12, 12, 12)
    lengths = torch.tensor([12, 7])
    pad = torch.arange(12)[None, :] >= lengths[:, None]
    i = torch.arange(1, 13, dtype=q.dtype)
    m = lengths.to(q.dtype)[:, None, None, None]
    reweight = torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / m)  # cos(π/2·(i − j)/M)
    sims = (F.relu(q) @ F.relu(k).transpose(-2, -1) * reweight).masked_fill(key_mask(pad), 0.0)
    ref = sims @ v / sims.sum(-1, keepdim=True).clamp_min(1e-6)
    torch.testing.assert_close(core(q, k, v, pad), ref, atol=1e-12, rtol=1e-12)


def test_skyformer_matches_regularised_nystrom_of_the_gaussian_kernel():
    core = make("skyformer", nb_features=8, pinv_iterations=40).core
    q, k, v = heads(12, 12, 12)
    lengths = torch.tensor([12, 9])
    pad = torch.arange(12)[None, :] >= lengths[:, None]
    out = core(q, k, v, pad)
    idx = core.landmark_indices(lengths, 12)
    assert (idx[:, :4] < lengths[:, None]).all() and (idx[:, 4:] >= 12).all()
    assert (idx[:, 4:] < 12 + lengths[:, None]).all()
    c = HEAD_DIM**-0.25

    def gauss(a, b):
        return torch.exp(-0.5 * ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1))

    for b, n in enumerate(lengths.tolist()):
        x = torch.cat([q[b, :, :n], k[b, :, :n]], dim=1) * c  # valid tokens only
        sel = torch.where(idx[b] >= 12, idx[b] - 12 + n, idx[b])
        s = x[:, sel]
        kernel_qs, kernel_sk = gauss(x[:, :n], s), gauss(s, x[:, n:])
        reg = gauss(s, s) + 0.1 * torch.eye(8, dtype=q.dtype)
        ref = kernel_qs @ torch.linalg.solve(reg, kernel_sk) @ v[b, :, :n]
        torch.testing.assert_close(out[b, :, :n], ref, atol=1e-10, rtol=1e-10)


def test_skyformer_sampling_random_in_training_fixed_in_eval():
    layer = make("skyformer")
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer(x))
        layer.train()
        assert not torch.allclose(layer(x), layer(x))


def test_focused_matches_explicit_weights_plus_dwc():
    core = make("focused").core
    q, k, v = heads(12, 12, 12)
    pad = torch.tensor([[False] * 12, [False] * 5 + [True] * 7])
    s = F.softplus(core.scale)

    def phi(x):
        x = F.relu(x / s) + 1e-6
        y = x**3
        return y * x.norm(dim=-1, keepdim=True) / y.norm(dim=-1, keepdim=True)

    n = (~pad).sum(-1).to(q.dtype)[:, None, None, None]
    sims = (phi(q) @ phi(k).transpose(-2, -1)).masked_fill(key_mask(pad), 0.0)
    weights = (sims / n) / (sims.sum(-1, keepdim=True) / n + 1e-6)
    v0 = v.masked_fill(pad[:, None, :, None], 0.0)
    local = F.conv1d(v0.reshape(-1, 12, HEAD_DIM).transpose(1, 2), core.dwc.weight, core.dwc.bias,
                     padding=2, groups=HEAD_DIM).transpose(1, 2).reshape(v.shape)
    torch.testing.assert_close(core(q, k, v, pad), weights @ v + local, atol=1e-12, rtol=0)
    assert make("focused", kernel_size=0).core.dwc is None


@pytest.mark.parametrize("name", ["softmax", "kernelized"])
def test_attention_dropout_only_in_training(name):
    layer = make(name, dropout=0.5)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer(x))
        layer.train()
        assert not torch.allclose(layer(x), layer.eval()(x))
