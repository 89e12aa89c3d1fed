"""Key padding masks in the ops: fused vs naive in float64 (forward and backward), and padding invariance.

Tolerances (tests/README.md, tests/tolerances.py): float64 fused against naive at 1e-9 of the largest entry, far above
reorder_rtol(n, float64) for these sums (n ≤ 400: 9e-14·κ); the float32 padding invariance is linear_attention_atol's
bound with the padding's longer sums."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from polaformer.ops import (
    elu_feature,
    learnable_power,
    linear_attention,
    linear_attention_weights,
    naive_pacs_linear_attention,
    naive_pola_linear_attention,
    pacs_linear_attention,
    pola_linear_attention,
    rope_2d,
    rope_angles,
)
from tolerances import linear_attention_atol

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64


def assert_close(a, b, rel=1e-9):
    tol = rel * max(1.0, b.abs().max().item())
    err = (a - b).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3e} > {tol:.3e}"


def inputs(b, h, n, m, d, dv, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    def make(*s):
        return torch.randn(*s, generator=gen, dtype=dtype).requires_grad_()
    return make(b, h, n, d), make(b, h, m, d), make(b, h, m, dv), make(1, h, 1, d)


def padding_mask(lengths, m):
    """Right padding: True beyond each sequence's length."""
    return torch.arange(m)[None, :] >= torch.tensor(lengths)[:, None]


def compare_masked_pola(q, k, v, w, mask, alpha=4.0):
    def power():
        return learnable_power(w, alpha)
    fast = pola_linear_attention(q, k, v, power(), key_padding_mask=mask)
    ref = naive_pola_linear_attention(q, k, v, power(), key_padding_mask=mask)
    assert_close(fast, ref)
    grad = torch.randn_like(ref)
    for name, a, b in zip("qkvw", torch.autograd.grad(fast, (q, k, v, w), grad),
                          torch.autograd.grad(ref, (q, k, v, w), grad)):
        assert a.shape == b.shape, name
        assert_close(a, b)


@pytest.mark.parametrize(
    "b,h,n,m,d,dv,lengths",
    [
        (2, 2, 9, 9, 4, 4, [9, 4]),  # self-attention, one padded sequence
        (3, 2, 7, 12, 6, 10, [12, 1, 7]),  # M != N, dv != d, a single valid key
        (3, 1, 12, 5, 4, 2, [3, 5, 2]),  # more queries than keys
    ],
)
def test_masked_fused_pola_matches_naive(b, h, n, m, d, dv, lengths):
    q, k, v, w = inputs(b, h, n, m, d, dv, seed=n + 7 * m)
    compare_masked_pola(q, k, v, w, padding_mask(lengths, m))


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3), h=st.integers(1, 3), n=st.integers(1, 24), m=st.integers(1, 24),
    d=st.integers(1, 5), half_dv=st.integers(1, 4), seed=st.integers(0, 2**16), data=st.data(),
)
def test_masked_fused_pola_matches_naive_random_masks(b, h, n, m, d, half_dv, seed, data):
    # Arbitrary masks, not only right padding; some rows may be fully masked.
    bits = data.draw(st.lists(st.booleans(), min_size=b * m, max_size=b * m))
    mask = torch.tensor(bits).reshape(b, m)
    compare_masked_pola(*inputs(b, h, n, m, d, 2 * half_dv, seed), mask)


def test_masked_fused_pola_gradcheck():
    q, k, v, w = inputs(2, 2, 4, 5, 3, 4, seed=3)
    mask = padding_mask([5, 2], 5)
    assert torch.autograd.gradcheck(
        lambda q, k, v, w: pola_linear_attention(q, k, v, learnable_power(w, 3.0), key_padding_mask=mask),
        (q, k, v, w),
    )


def test_an_all_false_mask_equals_no_mask():
    q, k, v, w = inputs(2, 2, 6, 6, 4, 4, seed=4)
    p = learnable_power(w, 4.0)
    unmasked = pola_linear_attention(q, k, v, p)
    masked = pola_linear_attention(q, k, v, p, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    assert_close(masked, unmasked, rel=1e-14)


def test_fully_padded_sequence_gives_zeros_and_zero_gradients():
    q, k, v, w = inputs(2, 2, 5, 5, 4, 4, seed=5)
    mask = padding_mask([5, 0], 5)
    out = pola_linear_attention(q, k, v, learnable_power(w, 4.0), key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and out[0].abs().sum() > 0
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (gq[1] == 0).all() and (gk[1] == 0).all() and (gv[1] == 0).all()


def test_padded_keys_with_junk_values_do_not_change_the_output():
    q, k, v, w = inputs(2, 2, 8, 8, 4, 6, seed=6)
    mask = padding_mask([8, 3], 8)
    p = learnable_power(w, 4.0)
    out = pola_linear_attention(q, k, v, p, key_padding_mask=mask)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[1, :, 3:] = 1e3 * torch.randn_like(k2[1, :, 3:])
    v2[1, :, 3:] = 1e6
    assert_close(pola_linear_attention(q, k2, v2, p, key_padding_mask=mask), out, rel=1e-14)


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_padded_batch_gives_each_sequence_its_unpadded_output_fp32(op):
    """The user's case: right-pad a batch of variable-length sequences; real tokens are untouched."""
    gen = torch.Generator().manual_seed(0)
    lengths, h, d, dv = [37, 5, 20], 2, 8, 8
    longest = max(lengths)
    seqs = [[torch.randn(1, h, n, c, generator=gen) for c in (d, d, dv)] for n in lengths]
    w = torch.randn(1, h, 1, d, generator=gen)
    s1, s2 = torch.rand(1, h, 1, 2 * d, generator=gen), torch.rand(1, h, 1, 2 * d, generator=gen)

    def run(q, k, v, mask=None):
        if op == "pola":
            return pola_linear_attention(q, k, v, learnable_power(w, 4.0), key_padding_mask=mask)
        return pacs_linear_attention(q, k, v, s1, s2, key_padding_mask=mask)

    def pad(t):
        return torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[-2]), value=3.0)  # junk, not zeros
    batch = [torch.cat([pad(s[i]) for s in seqs]) for i in range(3)]
    out = run(*batch, padding_mask(lengths, longest))
    for i, (n, s) in enumerate(zip(lengths, seqs)):
        # the padding adds exact zeros: only the blocking of the sums over the longest keys differs
        atol = linear_attention_atol(s[2].abs().max().item(), keys=longest, channels=2 * d)
        torch.testing.assert_close(out[i : i + 1, :, :n], run(*s), rtol=0, atol=atol)


@pytest.mark.parametrize("with_rope", [False, True])
def test_masked_pacs_matches_naive(with_rope):
    gen = torch.Generator().manual_seed(9)
    b, h, n, d, dv = 3, 2, 12, 4, 6
    def make(*s):
        return torch.randn(*s, generator=gen, dtype=F64).requires_grad_()
    q, k, v, s1, s2 = make(b, h, n, d), make(b, h, n, d), make(b, h, n, dv), make(1, h, 1, 2 * d), make(1, h, 1, 2 * d)
    sin = cos = None
    if with_rope:
        sin, cos = rope_2d(rope_angles(2 * d * h, h, dtype=F64), 3, 4)
    mask = torch.rand(b, n, generator=gen) < 0.4
    mask[2] = True  # one sequence without keys
    def args():
        return (q, k, v, torch.sigmoid(s1), torch.sigmoid(s2), sin, cos)
    fast = pacs_linear_attention(*args(), key_padding_mask=mask)
    ref = naive_pacs_linear_attention(*args(), key_padding_mask=mask)
    assert_close(fast, ref)
    assert (fast[2] == 0).all()
    grad = torch.randn_like(ref)
    leaves = (q, k, v, s1, s2)
    for a, b_ in zip(torch.autograd.grad(fast, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        assert_close(a, b_)


def test_masked_linear_attention_matches_its_weights():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=gen, dtype=F64) for _ in range(3))
    mask = padding_mask([9, 4], 9)
    phi_q, phi_k = elu_feature(q), elu_feature(k)
    weights = linear_attention_weights(phi_q, phi_k, key_padding_mask=mask)
    assert (weights[1, :, :, 4:] == 0).all()
    torch.testing.assert_close(
        linear_attention(phi_q, phi_k, v, key_padding_mask=mask), weights @ v, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "mask,message",
    [
        (torch.zeros(2, 6, dtype=torch.bool), r"\(batch, keys\) = \(2, 5\)"),
        (torch.zeros(2, 5), "bool"),
        (torch.zeros(5, dtype=torch.bool), r"\(batch, keys\)"),
    ],
)
def test_bad_masks_raise_clear_errors(mask, message):
    q, k, v, w = inputs(2, 1, 4, 5, 2, 2, seed=0)
    with pytest.raises(ValueError, match=message):
        pola_linear_attention(q, k, v, learnable_power(w, 4.0), key_padding_mask=mask)
    with pytest.raises(ValueError, match=message):
        pacs_linear_attention(q, k, v, torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), key_padding_mask=mask)
