"""Moved: the pola op's Triton kernels live in its folder, :mod:`polaformer.ops.pola.triton`; this module re-exports
them for old imports (it imports triton, as before)."""
from ...ops.pola.triton import *  # noqa: F403
from ...ops.pola.triton import __all__  # noqa: F401
