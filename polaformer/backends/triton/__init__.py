"""Triton kernels for the Pola and PaCS attention ops (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

The ops reach this package only through :func:`polaformer.ops.dispatch.triton_kernels`.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when triton imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
