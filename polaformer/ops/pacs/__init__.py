"""PolaFormer++'s PaCS attention, every form in this folder: the entries and the order of their paths
(``op.py``), the Triton kernels (``triton.py``), the CPU forms (``autograd.py``), the torch formulation
(``formulation.py``), packed sequences (``packed.py``) and the float64 references (``naive.py``). The native CPU
kernels are one library for every op (:mod:`polaformer.backends.cpu`)."""
from .naive import naive_pacs_layer_attention, naive_pacs_linear_attention, pacs_attention_weights
from .op import pacs_layer_attention, pacs_linear_attention

__all__ = [
    "naive_pacs_layer_attention",
    "naive_pacs_linear_attention",
    "pacs_attention_weights",
    "pacs_layer_attention",
    "pacs_linear_attention",
]
