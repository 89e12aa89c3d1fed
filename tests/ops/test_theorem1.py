"""Theorem 1 of the paper, the part that is provable: in one dimension, raising a positive
sequence to a power p ≥ 1 never increases the entropy of its normalised form.

H(p) = entropy of a^p / Σ a^p has dH/dp = -p · Var_{π_p}(log a) ≤ 0, so H is non-increasing in p.
The multi-dimensional case (weights Σ_c q_c^p k_ic^p) has counterexamples; one is pinned below
and reported in docs/analysis.md.

Tolerances (tests/README.md): float64 entropies of at most 64 terms against each other at 1e-7 relative (1e-9
absolute), far above reorder_rtol(64, float64) = 1.4e-14 times the logarithms' condition.
"""
import math

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from polaformer.analysis import positive_sequence_entropy, power_entropy
from polaformer.ops import pola_attention_weights

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
powers = st.floats(min_value=1.0, max_value=50.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(a=st.lists(positive, min_size=2, max_size=64), p1=powers, p2=powers)
def test_power_map_entropy_is_non_increasing_in_p(a, p1, p2):
    p1, p2 = sorted((p1, p2))
    h1, h2 = power_entropy(np.array(a), p1), power_entropy(np.array(a), p2)
    assert h2 <= h1 + 1e-9 * (1 + abs(h1)), (a, p1, p2, h1, h2)


@settings(max_examples=100, deadline=None)
@given(a=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=2, max_size=64), p=powers)
def test_power_entropy_matches_the_positive_sequence_entropy(a, p):
    a = np.array(a)
    expected = positive_sequence_entropy(torch.from_numpy(a) ** p).item()
    assert math.isclose(power_entropy(a, p), expected, rel_tol=1e-7, abs_tol=1e-9)


def test_multidimensional_counterexample_entropy_rises():
    """q = (1, 1), keys (2, 0), (0, 2), (1.5, 1.5): the power map p=3 makes the row *more* uniform.

    Weights ∝ q·k: p=1 gives (2, 2, 3), p=3 gives (8, 8, 6.75). So Theorem 1 cannot hold row by row
    for the power map in d > 1; it is an existence statement about some map, not about every row.
    """
    q = torch.tensor([[[[1.0, 1.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[2.0, 0.0], [0.0, 2.0], [1.5, 1.5]]]], dtype=torch.float64)
    h = {p: positive_sequence_entropy(pola_attention_weights(q, k, torch.tensor(float(p)))[0]).item() for p in (1, 3)}
    assert h[3] > h[1] + 0.01
    assert h[3] <= math.log(3)
