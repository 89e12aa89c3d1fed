"""timm.create_model refuses sizes and rates that would build a broken model, in one ValueError
naming the argument (issue 27): a 0-block model, zero heads (a ZeroDivisionError before), NaN logits."""
import pytest
import timm

import polaformer.models  # noqa: F401
from polaformer.layers import PolaMultiheadAttention

CASES = [
    ("pola_deit_tiny_patch16_224", dict(depth=0), "depth must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(depth=-1), "depth must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(num_heads=0), "num_heads must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(drop_path_rate=-0.1), "drop_path_rate must be a number in [0, 1), got -0.1"),
    ("pola_deit_tiny_patch16_224", dict(alpha=float("nan")), "alpha must be a finite number >= 0, got nan"),
    ("pola_deit_tiny_patch16_224", dict(alpha=-3), "alpha must be a finite number >= 0, got -3"),
    ("pola_pvt_tiny", dict(depths=[-1, 2, 2, 2]), "depths must be a positive integer"),
    ("pola_pvt_tiny", dict(sr_ratios=[0, 4, 2, 1]), "sr_ratios must be a positive integer"),
    ("pola_pvt_v2_b0", dict(num_heads=[0, 2, 5, 8]), "num_heads must be a positive integer"),
    ("pola_swin_t", dict(depths=(2, 2, 0, 2)), "depths must be a positive integer"),
    ("pola_swin_t", dict(drop_path_rate=float("nan")), "drop_path_rate must be a number in [0, 1), got nan"),
    ("POLA_b0", dict(num_heads=(1, 0, 2, 3)), "num_heads must be a positive integer"),
]


@pytest.mark.parametrize("name, kwargs, message", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_create_model_refuses_broken_sizes(name, kwargs, message):
    with pytest.raises(ValueError) as info:
        timm.create_model(name, **kwargs)
    assert message in str(info.value)


def test_multihead_attention_refuses_zero_heads():
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
        PolaMultiheadAttention(64, 0)
