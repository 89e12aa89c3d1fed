"""Moved: the PaCS ops live in :mod:`polaformer.ops.pacs`; this module re-exports their names for old imports."""
from .pacs import pacs_layer_attention, pacs_linear_attention

__all__ = ["pacs_layer_attention", "pacs_linear_attention"]
