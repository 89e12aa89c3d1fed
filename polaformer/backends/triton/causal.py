"""Moved: the causal op's Triton kernels live in its folder, :mod:`polaformer.ops.causal.triton`; this module re-exports
them for old imports (it imports triton, as before)."""
from ...ops.causal.triton import *  # noqa: F403
from ...ops.causal.triton import __all__  # noqa: F401
