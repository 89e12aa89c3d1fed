"""Triton kernels for the Pola and PaCS attention ops and the causal ops (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``).

The ops reach this package only through :func:`polaformer.ops.dispatch.triton_kernels`. Importing it does not
import triton: each entry point's module is imported on first use (``_ENTRY_POINTS``, one line per op).
"""
from __future__ import annotations

import importlib
import importlib.util

_ENTRY_POINTS = {
    "causal_attention": "causal",
    "pola_attention": "pola",
    "pacs_attention": "pacs",
}


# Whether triton is installed (it ships with CUDA builds of torch), found without importing it; a plain
# constant, which torch.compile reads without tracing a call.
_INSTALLED = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when triton is installed."""
    return _INSTALLED


def __getattr__(name: str):
    module = _ENTRY_POINTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted([*globals(), *_ENTRY_POINTS])
