"""PolaFormer and PolaFormer++ (polarity-aware linear attention) for PyTorch and timm.

``import polaformer.models`` registers the models with timm; :func:`load_checkpoint` loads
weights (the authors' released checkpoints included) into a model without running code
from the file.
"""
from .checkpoint import LoadResult, load_checkpoint

__all__ = ["LoadResult", "load_checkpoint"]
