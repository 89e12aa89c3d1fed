"""Process-level settings that make CPU runs faster; applied by the CLI, never on import.

Large tensors (more than a few MB) are allocated by glibc with ``mmap`` and returned to the
system when freed, so every new activation of that size page-faults its memory in again, which
can cost as much as a matmul over it. Raising
glibc's mmap and trim thresholds keeps freed blocks in the heap for reuse. Peak memory is
unchanged; the resident size just does not shrink after a peak.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def tune_cpu_allocator(threshold_bytes: int = 1 << 30) -> bool:
    """Keep freed buffers below ``threshold_bytes`` in the heap (glibc only); returns whether it applied."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1 and libc.mallopt(
            _M_TRIM_THRESHOLD, 2**31 - 1
        ) == 1
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    if ok:
        log.debug("glibc mmap/trim thresholds raised: freed large buffers are reused")
    _applied = ok
    return ok
