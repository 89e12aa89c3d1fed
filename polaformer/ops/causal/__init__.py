"""Causal polarity-aware linear attention (each query sees the keys up to its own position), every form in this
folder: the entries and the order of their paths (``op.py``), the Triton kernels (``triton.py``), the torch
chunked and recurrent forms and :class:`CausalState` (``forms.py``), packed sequences (``packed.py``) and the
float64 reference of the one-stream op (``naive.py``)."""
from .forms import CausalState
from .naive import naive_causal_linear_attention
from .op import (
    causal_linear_attention,
    causal_pacs_linear_attention,
    causal_pacs_step,
    causal_pola_linear_attention,
    causal_pola_step,
)

__all__ = [
    "CausalState",
    "causal_linear_attention",
    "causal_pacs_linear_attention",
    "causal_pacs_step",
    "causal_pola_linear_attention",
    "causal_pola_step",
    "naive_causal_linear_attention",
]
