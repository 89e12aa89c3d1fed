"""PolaFormer's polarity-aware attention with the learnable power map, every form in this folder: the entries
and the order of their paths (``op.py``), the Triton kernels (``triton.py``), the CPU forms with the hand-written
backward (``autograd.py``), the torch formulation (``formulation.py``), packed sequences (``packed.py``) and the
float64 references (``naive.py``). The native CPU kernels are one library for every op
(:mod:`polaformer.backends.cpu`)."""
from .naive import (
    naive_pola_layer_attention,
    naive_pola_linear_attention,
    naive_power_linear_attention,
    official_pola_linear_attention,
    pola_attention_weights,
    power_attention_weights,
)
from .op import linear_attention, pola_layer_attention, pola_linear_attention, power_linear_attention

__all__ = [
    "linear_attention",
    "naive_pola_layer_attention",
    "naive_pola_linear_attention",
    "naive_power_linear_attention",
    "official_pola_linear_attention",
    "pola_attention_weights",
    "pola_layer_attention",
    "pola_linear_attention",
    "power_attention_weights",
    "power_linear_attention",
]
