"""The Triton kernel toolkit the ops' kernels share (:mod:`.common`: the program prologue, a packed sequence's
extent, the split of work over programs, the launch through ``torch.library``), and whether triton is installed.

Each op's own kernels live in its folder (``polaformer/ops/<op>/triton.py``). Importing this package does not
import triton; :mod:`.common` does.
"""
from __future__ import annotations

import importlib.util

# Whether triton is installed (it ships with CUDA builds of torch), found without importing it; a plain
# constant, which torch.compile reads without tracing a call.
_INSTALLED = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when triton is installed."""
    return _INSTALLED
