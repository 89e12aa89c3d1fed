"""Causal Pola and PaCS attention: the masked O(N²) reference, the chunked-parallel form and the recurrent form
agree in float64, forward and every gradient, with key padding and packed sequences; no token sees the future.

Tolerances (tests/README.md, tests/tolerances.py): the float64 forms (1e-9 and 1e-12) are far above reorder_rtol(n,
float64) for these sums (at most 40 tokens x 8 channels: n·u = 4e-14); the bfloat16 one is linear_attention_atol's
bound for inputs rounded to bfloat16."""
from __future__ import annotations

import pytest
import torch

from polaformer.ops import (
    causal_linear_attention,
    causal_pacs_linear_attention,
    causal_pacs_step,
    causal_pola_linear_attention,
    causal_pola_step,
    naive_pacs_linear_attention,
    naive_pola_linear_attention,
    pacs_linear_attention,
    pola_linear_attention,
    rope_1d,
)
from polaformer.ops.causal import naive_causal_linear_attention
from tolerances import linear_attention_atol

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

B, H, N, D = 2, 2, 11, 4


def _pola_inputs(seed=0, dv=6):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, N, dv, generator=g, dtype=torch.float64)
    power = 1 + 3 * torch.rand(1, H, 1, D, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, power)]


def _pacs_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    ts, to = (torch.rand(1, H, 1, 2 * D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v, ts, to)]


def _tables():
    return rope_1d(torch.linspace(0.1, 1.0, D, dtype=torch.float64).repeat_interleave(2), N)


def _padding():
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, -3:] = True  # right padding
    mask[1, :2] = True  # left padding, and a gap
    mask[1, 5] = True
    return mask


def _assert_same(forms, inputs):
    """Every form's output and gradients equal the first's to 1e-9."""
    grad_out = torch.randn_like(forms[0]())
    results = []
    for form in forms:
        out = form()
        results.append((out, torch.autograd.grad(out, inputs, grad_out)))
    (ref, ref_grads), *others = results
    for out, grads in others:
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("masked", [False, True])
def test_pola_three_forms_agree(masked):
    q, k, v, p = inputs = _pola_inputs(dv=5)  # odd value width: ceil/floor split as torch.chunk
    mask = _padding() if masked else None
    _assert_same([
        lambda: naive_pola_linear_attention(q, k, v, p, key_padding_mask=mask, causal=True),
        lambda: causal_pola_linear_attention(q, k, v, p, chunk_size=4, key_padding_mask=mask),
        lambda: causal_pola_linear_attention(q, k, v, p, chunk_size=64, key_padding_mask=mask),
        lambda: causal_pola_step(q, k, v, p, key_padding_mask=mask)[0],
        lambda: pola_linear_attention(q, k, v, p, key_padding_mask=mask, causal=True),
    ], inputs)


@pytest.mark.parametrize("rope, masked", [(False, False), (True, False), (True, True)])
def test_pacs_three_forms_agree(rope, masked):
    q, k, v, ts, to = inputs = _pacs_inputs()
    sin, cos = _tables() if rope else (None, None)
    mask = _padding() if masked else None
    _assert_same([
        lambda: naive_pacs_linear_attention(q, k, v, ts, to, sin, cos, key_padding_mask=mask, causal=True),
        lambda: causal_pacs_linear_attention(q, k, v, ts, to, sin, cos, chunk_size=3, key_padding_mask=mask),
        lambda: causal_pacs_step(q, k, v, ts, to, sin, cos, key_padding_mask=mask)[0],
        lambda: pacs_linear_attention(q, k, v, ts, to, sin, cos, key_padding_mask=mask, causal=True),
    ], inputs)


def test_padded_batch_gives_each_sequence_its_unpadded_output():
    q, k, v, p = _pola_inputs()
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, 7:] = True
    out = causal_pola_linear_attention(q, k, v, p, chunk_size=4, key_padding_mask=mask)
    alone = causal_pola_linear_attention(q[1:, :, :7], k[1:, :, :7], v[1:, :, :7], p, chunk_size=4)
    torch.testing.assert_close(out[1:, :, :7], alone, atol=1e-12, rtol=1e-12)


def test_packed_sequences_equal_separate_calls_with_gradients():
    q, k, v, p = inputs = _pola_inputs()
    lengths = [3, 0, 8]
    offsets = torch.tensor([0, 3, 3, 11], dtype=torch.int32)
    packed = [t[:1] for t in (q, k, v)]
    pieces = []
    start = 0
    for n in lengths:
        if n:
            pieces.append(naive_pola_linear_attention(*(t[:, :, start:start + n] for t in packed), p, causal=True))
        start += n
    _assert_same([
        lambda: torch.cat(pieces, dim=2),
        lambda: causal_pola_linear_attention(*packed, p, chunk_size=2, cu_seqlens=offsets),
        lambda: pola_linear_attention(*packed, p, cu_seqlens=offsets, causal=True),
    ], inputs)
    ts, to = torch.rand(2, 1, H, 1, 2 * D, dtype=torch.float64)
    sin, cos = _tables()
    out = causal_pacs_linear_attention(*packed, ts, to, sin, cos, cu_seqlens=offsets)
    second = naive_pacs_linear_attention(*(t[:, :, 3:] for t in packed), ts, to, *rope_1d(
        torch.linspace(0.1, 1.0, D, dtype=torch.float64).repeat_interleave(2), 8, start=3), causal=True)
    torch.testing.assert_close(out[:, :, 3:], second, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_no_future_token_changes_an_earlier_output(op):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    t = 23

    def run(q, k, v):
        if op == "pola":
            return causal_pola_linear_attention(q, k, v, 3.0, chunk_size=16)
        temps = torch.full((1, 2, 1, 16), 0.5)
        sin, cos = rope_1d(torch.linspace(0.1, 1.0, 8).repeat_interleave(2), 40)
        return causal_pacs_linear_attention(q, k, v, temps, temps, sin, cos, chunk_size=16)

    base = run(q, k, v)
    for x in (q, k, v):
        x[:, :, t] += 10.0  # large, inside float32's range for the exp features
    moved = run(q, k, v)
    assert torch.equal(base[:, :, :t], moved[:, :, :t])
    assert not torch.equal(base[:, :, t], moved[:, :, t])


def test_state_continues_a_prefix_in_either_form():
    q, k, v, p = (t.detach() for t in _pola_inputs())
    whole = causal_pola_linear_attention(q, k, v, p, chunk_size=4)
    head, state = causal_pola_linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], p, return_state=True)
    steps = []
    for t in range(6, N):
        out, state = causal_pola_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], p, state)
        steps.append(out)
    torch.testing.assert_close(torch.cat([head, *steps], dim=2), whole, atol=1e-12, rtol=1e-12)
    tail = causal_pola_linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], p,
                                        initial_state=causal_pola_step(q[:, :, :6], k[:, :, :6], v[:, :, :6], p)[1])
    torch.testing.assert_close(tail, whole[:, :, 6:], atol=1e-12, rtol=1e-12)


def test_plain_causal_linear_attention_matches_its_weights():
    g = torch.Generator().manual_seed(1)
    phi_q, phi_k = (torch.rand(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, N, 3, generator=g, dtype=torch.float64)
    ref = naive_causal_linear_attention(phi_q, phi_k, v)
    torch.testing.assert_close(causal_linear_attention(phi_q, phi_k, v, chunk_size=5)[0], ref)
    torch.testing.assert_close(causal_linear_attention(phi_q, phi_k, v, recurrent=True)[0], ref)


def test_half_precision_and_autocast_accumulate_in_float32():
    q, k, v, p = (t.detach().bfloat16().float() for t in _pola_inputs())  # values bfloat16 holds exactly
    ref = causal_pola_linear_attention(q, k, v, p)
    half = causal_pola_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), p)
    assert half.dtype == torch.bfloat16
    # the same float32 computation, then the output rounded once to bfloat16 (sums of bfloat16 would be off by up
    # to the 11 tokens' roundings)
    torch.testing.assert_close(half.float(), ref, rtol=0, atol=linear_attention_atol(v.abs().max().item(),
                                                                                     torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert causal_pola_linear_attention(q, k, v, p).dtype == torch.float32


def test_bad_arguments_are_refused_clearly():
    q, k, v, p = (t.detach() for t in _pola_inputs())
    with pytest.raises(ValueError, match="same batch, heads and tokens"):
        causal_pola_linear_attention(q, k[:, :, :5], v[:, :, :5], p)
    with pytest.raises(ValueError, match="chunk_size"):
        causal_pola_linear_attention(q, k, v, p, chunk_size=0)
    with pytest.raises(ValueError, match="cu_seqlens only"):
        causal_pola_linear_attention(q[:1], k[:1], v[:1], p, cu_seqlens=torch.tensor([0, N]),
                                     cu_seqlens_k=torch.tensor([0, 2, N]))
    with pytest.raises(ValueError, match="key_padding_mask"):
        causal_pola_linear_attention(q, k, v, p, key_padding_mask=torch.zeros(B, N))
    with pytest.raises(ValueError, match="int32/int64"):
        causal_pola_linear_attention(q[:1], k[:1], v[:1], p, cu_seqlens=torch.tensor([0.0, N]))
    with pytest.raises(ValueError, match="end at the packed token count"):
        causal_pola_linear_attention(q[:1], k[:1], v[:1], p, cu_seqlens=torch.tensor([0, N - 1]))
    for form in (causal_pola_linear_attention, lambda *qkvp: causal_pola_step(*qkvp)[0]):
        with pytest.raises(ValueError, match="power must be >= 1"):
            form(q, k, v, torch.full_like(p, 0.5))


def test_overflow_is_refused_in_one_line_not_returned_as_nan():
    """The causal forms have no log-domain redo: finite float32 inputs whose features overflow end in an
    error naming the overflow; float64 takes the same inputs, and NaN inputs still pass through as NaN."""
    g = torch.Generator().manual_seed(0)
    q, k = (60 * torch.randn(1, H, N, D, generator=g) for _ in range(2))
    v = torch.randn(1, H, N, 6, generator=g)
    temps = [torch.full((1, H, 1, 2 * D), 0.5) for _ in range(2)]
    power = torch.full((1, H, 1, D), 3.0)
    calls = {
        "PaCS": (lambda *x: causal_pacs_linear_attention(*x, *temps), lambda *x: causal_pacs_step(*x, *temps)[0]),
        "Pola": (lambda *x: causal_pola_linear_attention(*x, power), lambda *x: causal_pola_step(*x, power)[0]),
    }
    for name, forms in calls.items():
        scale = 1.0 if name == "PaCS" else 1e6  # the power map overflows only at far larger magnitudes
        for form in forms:
            with pytest.raises(FloatingPointError, match=f"causal {name} attention .*overflowed float32.*float64"):
                form(q * scale, k * scale, v)
            assert form(*(t.double() for t in (q * scale, k * scale, v))).isfinite().all()
    with_nan = q.clone()
    with_nan[0, 0, 3, 0] = float("nan")
    assert causal_pacs_linear_attention(with_nan, k, v, *temps).isnan().any()  # garbage in, no false alarm
