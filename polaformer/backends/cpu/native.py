"""The fused CPU kernels of ``polaformer/backends/cpu/csrc/`` (one source per family), compiled on first use.

The attention's elementwise stages (the power features, their backward, the two streams'
normalisation and its gradient) are each one pass over memory there instead of a chain of 4-8
torch ops. They are built once per machine and build environment with ``torch.utils.cpp_extension``
(about a minute on 2 cores), for the vector width torch itself uses on this CPU (AVX2 or AVX-512), under
``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``).

The build is named by a hash of everything that goes into it (:func:`build_inputs`): the sources and
headers, the compiler (its path and binary), the flags, the include and library paths of this environment's
torch and Python, torch's version and build. Two virtual environments on one machine (the same torch, other
paths) therefore build once each, into two folders, instead of rebuilding over each other on every start;
two checkouts of the same sources share one build. A build runs in a private folder under an exclusive lock
(``NAME.lock``, ``fcntl.flock``: the kernel releases it when its process dies) and is renamed into place
complete, so a library a process has loaded is never rewritten under it; later processes load the finished
library without running the compiler or ninja at all.

Where they cannot be built (no C++ compiler or ninja, another CPU architecture, a build error) the
torch-op versions run instead, with one warning in the log. ``POLAFORMER_NATIVE=0`` turns them off;
the results agree with the torch-op versions to rounding (tests/test_native.py, float64).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import sysconfig
import threading
import uuid
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["build_inputs", "build_name", "native_kernels", "native_enabled"]

_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_state: dict = {}


def native_enabled() -> bool:
    """Whether the environment allows the native kernels (``POLAFORMER_NATIVE`` is not 0/false/off)."""
    return os.environ.get("POLAFORMER_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


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
    """The sources copied into the private build folder: the compiler never reads a checkout that may change
    while it builds."""
    folder.mkdir(parents=True)
    for path in [*_SOURCE_DIR.glob("*.cpp"), *_SOURCE_DIR.glob("*.h")]:
        shutil.copyfile(path, folder / path.name)
    return sorted(folder.glob("*.cpp"))


def _flags(capability: str) -> tuple[list[str], list[str]]:
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    cflags = ["-O3", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_FLAGS[capability], *openmp]
    return cflags, openmp


def build_inputs(capability: str, cpp_extension) -> dict:
    """Everything that goes into the library (and so into its name): a change of any makes another build."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or os.environ.get("CXX", "c++")
    try:  # the binary itself: an upgraded compiler at the same path is another compiler
        info = os.stat(os.path.realpath(compiler))
        binary = [os.path.realpath(compiler), info.st_size, info.st_mtime_ns]
    except OSError:
        binary = [compiler]
    cflags, ldflags = _flags(capability)
    return {
        "sources": _sources_digest(), "compiler": binary, "cflags": cflags, "ldflags": ldflags,
        "include_paths": [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]],
        "library_paths": cpp_extension.library_paths(), "torch": [torch.__version__, torch.version.git_version],
        "python": [sys.version, sysconfig.get_config_var("EXT_SUFFIX")],
    }


def build_name(capability: str, cpp_extension) -> str:
    """The module's (and its folder's) name: a hash of :func:`build_inputs`."""
    key = hashlib.sha256(json.dumps(build_inputs(capability, cpp_extension), sort_keys=True).encode())
    return f"polaformer_native_{capability.lower()}_{key.hexdigest()[:16]}"


def _load_library(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library(folder: Path, name: str) -> Path | None:
    found = sorted(folder.glob(f"{name}*.so")) if folder.is_dir() else []
    return found[0] if found else None


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
    try:
        name = build_name(capability, cpp_extension)
        final = Path(cpp_extension._get_build_directory(name, False))
        library = _library(final, name)
        if library is not None:  # the usual case: built before, by this or another process
            return _load_library(name, library)
        return _build_once(cpp_extension, name, final, capability)
    except Exception as err:  # no compiler, no ninja, a failed build: the torch ops still work
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        log.warning("polaformer native kernels: build failed (%s); using torch ops", reason)
        return None


def _build_once(cpp_extension, name: str, final: Path, capability: str):
    """The module ``name``, built into ``final`` unless another process does: the build runs in a private folder
    under the lock ``NAME.lock`` and is renamed over ``final`` (empty until then) once complete; the module
    loaded from the private folder stays loaded (a rename keeps the file)."""
    import fcntl

    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f"{name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("polaformer native kernels: waiting for another process building %s", final)
            fcntl.flock(lock, fcntl.LOCK_EX)
        library = _library(final, name)
        if library is not None:  # built by the process we waited for
            return _load_library(name, library)
        for leftover in final.parent.glob(f"{name}.build-*"):  # of a build killed midway
            shutil.rmtree(leftover, ignore_errors=True)
        private = final.with_name(f"{name}.build-{uuid.uuid4().hex[:12]}")
        log.info("polaformer native kernels: compiling the %s build (once per machine and environment, about a "
                 "minute)", capability)
        cflags, ldflags = _flags(capability)
        try:
            module = cpp_extension.load(name=name, sources=[str(p) for p in _staged_sources(private / "src")],
                                        extra_cflags=cflags, extra_ldflags=ldflags, build_directory=str(private),
                                        verbose=False)
            os.rename(private, final)  # replaces the empty folder: readers see no library, then a complete one
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        return module


def native_kernels():
    """The compiled module, or None where it is turned off or cannot be built (tried once per process)."""
    if not native_enabled():
        return None
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"] = _build()
    return _state["module"]
