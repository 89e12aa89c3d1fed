"""The fused CPU kernels of ``polaformer/backends/cpu/csrc/`` (one source per family), compiled on first use.

The attention's elementwise stages (the power features, their backward, the two streams'
normalisation and its gradient) are each one pass over memory there instead of a chain of 4-8
torch ops. They are built once per machine with ``torch.utils.cpp_extension`` (about 30 s; torch
caches the build under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), for the
vector width torch itself uses on this CPU (AVX2 or AVX-512). The build is named by a hash of the
sources and compiled from a copy of them inside it, so every checkout of the same sources shares it.

Where they cannot be built (no C++ compiler or ninja, another CPU architecture, a build error) the
torch-op versions run instead, with one warning in the log. ``POLAFORMER_NATIVE=0`` turns them off;
the results agree with the torch-op versions to rounding (tests/test_native.py, float64).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["native_kernels", "native_enabled"]

_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_state: dict = {}
# In older torch the build lock is a file that only the building process removes (FileBaton): a build
# killed outright leaves it behind and every later load would wait on it forever. No build of this file
# takes this long. Newer torch (2.14) holds an OS advisory lock on a file that stays after every build;
# removing that file would only let two builds run at once, so it is left alone.
_STALE_LOCK_SECONDS = 30 * 60


def _lock_blocks_while_the_file_exists(cpp_extension) -> bool:
    return hasattr(cpp_extension, "FileBaton")


def native_enabled() -> bool:
    """Whether the environment allows the native kernels (``POLAFORMER_NATIVE`` is not 0/false/off)."""
    return os.environ.get("POLAFORMER_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def clear_stale_build_lock(build_dir: str | os.PathLike, max_age: float = _STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir/lock`` if it is older than ``max_age`` seconds; returns whether it did."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age:
        return False
    log.warning("polaformer native kernels: removing the build lock %s, left %.0f minutes ago by a build that "
                "did not finish", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


def _sources_digest() -> str:
    """A hash of every source and header: torch's build cache does not see a changed header."""
    digest = hashlib.sha256()
    for path in sorted([*_SOURCE_DIR.glob("*.cpp"), *_SOURCE_DIR.glob("*.h")]):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _staged_sources(folder: Path) -> list[Path]:
    """The sources copied into ``folder`` (inside the build folder, which the digest names): two checkouts of
    the same sources then build from the same paths, and share one build instead of redoing each other's."""
    if not folder.is_dir():
        staging = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for path in [*_SOURCE_DIR.glob("*.cpp"), *_SOURCE_DIR.glob("*.h")]:
            shutil.copyfile(path, staging / path.name)
        try:
            staging.rename(folder)
        except OSError:  # another process staged the same sources first
            shutil.rmtree(staging, ignore_errors=True)
    return sorted(folder.glob("*.cpp"))


def _build():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _FLAGS:
        log.warning("polaformer native kernels: not built for CPU capability %s; using torch ops", capability)
        return None
    sources = _sources()
    if not sources:
        log.warning("polaformer native kernels: no C++ sources in %s; using torch ops", _SOURCE_DIR)
        return None
    # torch.utils.cpp_extension logs a CUDA warning when imported on a machine without CUDA
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    cflags = ["-O3", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_FLAGS[capability], *openmp]
    log.info("polaformer native kernels: loading the %s build (the first use on a machine compiles it, ~30 s)",
             capability)
    try:
        # torch's build cache is keyed by the name and the .cpp sources, not by torch's version or the headers:
        # a module built against another libtorch or from other headers must not be loaded, hence both in the name
        version = re.sub(r"\W", "_", torch.__version__)
        name = f"polaformer_native_{capability.lower()}_torch{version}_{_sources_digest()}"
        build_dir = cpp_extension._get_build_directory(name, False)
        if _lock_blocks_while_the_file_exists(cpp_extension):
            clear_stale_build_lock(build_dir)
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in _staged_sources(Path(build_dir) / "src")],
            extra_cflags=cflags,
            extra_ldflags=openmp,
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops still work
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        log.warning("polaformer native kernels: build failed (%s); using torch ops", reason)
        return None


def native_kernels():
    """The compiled module, or None where it is turned off or cannot be built (tried once per process)."""
    if not native_enabled():
        return None
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"] = _build()
    return _state["module"]
