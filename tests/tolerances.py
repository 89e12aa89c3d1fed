"""Tolerances of the tests that compare two computations, each derived from a stated bound (tests/README.md).

Two runs of the same float computation can differ only where they add in another order: other threads, SIMD
width or instruction set (torch's AVX-512, AVX2 and scalar kernels), batch blocking, process count, a fused kernel
against its reference. The bounds below are the textbook ones (N. J. Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., 2002, §2.2 and §3.1); a test names the one it uses and the lengths it puts in.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u, the relative error of one rounded operation: half the machine epsilon (2^-24 for float32, 2^-53 for
    float64, 2^-8 for bfloat16, 2^-11 for float16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_n = n·u / (1 - n·u): the relative error bound of n rounded operations in a row (Higham, Lemma 3.1);
    a sum or dot product of n + 1 terms, in any order, is within gamma_n·Σ|terms| of the exact value."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma_{n} is unbounded in {dtype}: n·u = {nu}")
    return nu / (1 - nu)


def reorder_rtol(n: int, dtype: torch.dtype = torch.float32, condition: float = 1.0) -> float:
    """How far two evaluations of one sum of ``n`` terms, added in different orders, can be apart, relative to
    the sum: each is within gamma_{n-1}·Σ|x| of the exact sum, so they are within 2·gamma_{n-1}·κ·|Σx| of each
    other, κ = Σ|x| / |Σx| the sum's ``condition`` (1 where the terms share a sign: a sum of losses, of counts)."""
    return 2 * gamma(max(n - 1, 1), dtype) * condition


def probable_rtol(n: int, dtype: torch.dtype = torch.float32, condition: float = 1.0, lam: float = 8.0) -> float:
    """The probabilistic counterpart of :func:`reorder_rtol` for random inputs: modelling the rounding errors as
    independent and mean-zero, a sum of ``n`` terms is within about lam·√n·u·Σ|x| of the exact one with
    probability at least 1 - 2n·exp(-lam²/2) (Higham and Mary, "A new approach to probabilistic rounding error
    analysis", SIAM J. Sci. Comput. 41(5), 2019; lam = 8: 1 - 2.5e-14·n), so two orders are within
    2·lam·√n·u·κ relative. The tests of kernels on random inputs whose worst case (n·u) would be far too loose for a
    float32 check use this one, and say so."""
    return 2 * lam * math.sqrt(n) * unit_roundoff(dtype) * condition


def forward_rtol(lengths: Iterable[int], dtype: torch.dtype = torch.float32, condition: float = 1.0) -> float:
    """How far two evaluations of one network's output can be apart, relative, where only the order of its sums
    differs: to first order the layers' bounds add, Σ_l reorder_rtol(n_l), with n_l the length of the reduction
    of layer l (a linear layer's input features, a conv's kernel area x input channels, the tokens an attention
    sums, a mean's count). ``condition``: the factor each layer may amplify an error by, taken as the stated
    assumption of the caller (1 for the small freshly initialised, normalised networks of the tests)."""
    return sum(reorder_rtol(n, dtype, condition) for n in lengths)


def linear_attention_atol(v_max: float, dtype: torch.dtype = torch.float32, *, feature_condition: float = 0.0,
                          roundings: int = 0, keys: int = 0, channels: int = 0) -> float:
    """How far the output of a linear attention with weights w_j >= 0 (Pola's powers, PaCS's exp - 1, per stream),
    o = Σ_j w_j·v_j / Σ_j w_j, can move between two evaluations in ``dtype``: when each weight moves by a
    relative δ_j, o moves by at most 2·max|δ|·max|v| (every |v_j - o| <= 2·max|v|). A weight moves by
    2·feature_condition·u where the inputs were rounded to ``dtype`` (query and key features: p for |x|^p, |x| for
    exp(x)), by ``roundings``·u for products stored in ``dtype`` (autocast's matmuls), and by
    reorder_rtol(channels) for its dot product of same-sign features; the numerator's and the normaliser's sums
    over ``keys`` add reorder_rtol(keys) each, and the output rounds once (2u with the values')."""
    u = unit_roundoff(dtype)
    weight = 2 * feature_condition * u + roundings * u + (reorder_rtol(channels, dtype) if channels > 1 else 0.0)
    sums = 2 * reorder_rtol(keys, dtype) if keys > 1 else 0.0
    return (2 * weight + sums + 2 * u) * v_max


def adam_update_bound(t: int, betas: tuple[float, float]) -> float:
    """The largest |update / lr| Adam or AdamW can make at its ``t``-th step, whatever the gradients: with
    bias-corrected moments m̂ = m / (1 - b1^t) and v̂ = v / (1 - b2^t), Cauchy-Schwarz on m's weighted sum
    of gradients gives |m̂| / √v̂ <= (1 - b1) / (1 - b1^t) · √((1 - b2^t) / (1 - b2)) · √(Σ_{k<t} (b1²/b2)^k)
    (exactly 1 at t = 1: the first step is lr·sign(g); about 1 for the first tens of steps; eps only lowers it)."""
    b1, b2 = betas
    ratio = b1 * b1 / b2
    return ((1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2))
            * math.sqrt(sum(ratio ** k for k in range(t))))


def adam_drift_bound(lrs: Iterable[float], betas: tuple[float, float]) -> float:
    """How far one weight of two Adam(W) trainings from the same start can end apart, whatever their gradients:
    each of the updates at rates ``lrs`` moves it by at most lr_t·adam_update_bound(t) in either run, so the two
    differ by at most 2·Σ_t lr_t·adam_update_bound(t). Decoupled weight decay shrinks the difference, gradient
    clipping does not change the bound (Adam divides by the gradient's own scale), and a weight EMA averages
    weights that all lie within it."""
    return 2 * sum(lr * adam_update_bound(t, betas) for t, lr in enumerate(lrs, start=1))


# assert_trainings_agree: at most FEW of the weights may lie further apart than FAR x the drift bound
FAR, FEW = 1e-2, 1e-2


def assert_trainings_agree(a: dict, b: dict, bound: float) -> None:
    """Two state dicts of Adam(W) trainings that differ only by rounding (another process count, kernel, sharding):
    every weight within ``bound`` (:func:`adam_drift_bound`), and at most FEW (1%) of them further apart than FAR
    (1%) of it.

    Where a gradient element is a near-cancelling sum, rounding can turn its update, by up to the bound; but the
    bound holds for any two trainings at these rates, so what fails when they do not compute the same thing is the
    second check. Rounding of relative size ρ moves an update by about ρ·κ·lr, κ that gradient element's
    condition (its terms' sizes over the size of their sum), so only elements with κ beyond about FAR / ρ (100 at
    ρ = 1e-4) get that far: a small fraction (none in the runs of the tests). A different gradient (each process
    stepping on its half batch) moves most weights by a good part of the learning rate: trained on half its batch,
    the LM of test_distributed_tasks.py ends with 96% of its weights more than 1% of the rate away, 74% more than
    10%."""
    assert a.keys() == b.keys()
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=bound, msg=lambda m, key=key: f"{key}: {m}")
    far = sum(((a[k].double() - b[k].double()).abs() > FAR * bound).sum().item() for k in b)
    assert far <= FEW * sum(v.numel() for v in b.values()), (far, bound)


def assert_same_tensors(a, b, what):
    """``a`` and ``b`` (tensors, or dicts, lists and tuples of them) bit for bit equal: tolerance 0, for runs
    that compute the same thing in the same order (a resumed run against one never stopped)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            assert_same_tensors(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{what}[{i}]")
    else:
        assert a == b, what
