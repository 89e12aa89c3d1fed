"""Moved: the Pola ops live in :mod:`polaformer.ops.pola`; this module re-exports their names for old imports."""
from .pola import linear_attention, pola_layer_attention, pola_linear_attention, power_linear_attention

__all__ = ["linear_attention", "pola_layer_attention", "pola_linear_attention", "power_linear_attention"]
