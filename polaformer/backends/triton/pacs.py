"""Moved: the pacs op's Triton kernels live in its folder, :mod:`polaformer.ops.pacs.triton`; this module re-exports
them for old imports (it imports triton, as before)."""
from ...ops.pacs.triton import *  # noqa: F403
from ...ops.pacs.triton import __all__  # noqa: F401
