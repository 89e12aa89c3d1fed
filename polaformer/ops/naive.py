"""Moved: each op's reference lives in its folder (``ops/pola/naive.py``, ``ops/pacs/naive.py``,
``ops/causal/naive.py``), what they share in :mod:`polaformer.ops.reference`; this module re-exports their names
for old imports."""
from .pacs.naive import naive_pacs_layer_attention, naive_pacs_linear_attention, pacs_attention_weights
from .pola.naive import (
    naive_pola_layer_attention,
    naive_pola_linear_attention,
    naive_power_linear_attention,
    official_pola_linear_attention,
    pola_attention_weights,
    power_attention_weights,
)
from .reference import linear_attention_weights, softmax_attention_weights

__all__ = [
    "linear_attention_weights",
    "naive_pacs_layer_attention",
    "naive_pacs_linear_attention",
    "naive_pola_layer_attention",
    "naive_pola_linear_attention",
    "naive_power_linear_attention",
    "official_pola_linear_attention",
    "pacs_attention_weights",
    "pola_attention_weights",
    "power_attention_weights",
    "softmax_attention_weights",
]
