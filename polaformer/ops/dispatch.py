"""Which kernels an op may call: the one backend switch (which kernels are allowed) and what is available.

Every op has a plain torch formulation, the one export, ONNX, TorchScript and FX tracing see (the capture
questions are :mod:`polaformer.capture`'s). In eager mode the ops call the native kernels of
:mod:`polaformer.backends.cpu` on CPU tensors (:func:`cpu_kernels`) and their own Triton kernels
(``ops/<op>/triton.py``) on CUDA tensors where :func:`triton_allowed` says so; under torch.compile the Triton
kernels too (as registered ops), the CPU kernels not. The order in which an op tries its paths is written once,
in its ``ops/<op>/op.py`` (``_path``).

Switches:

- :func:`set_attention_backend` (or ``POLAFORMER_ATTENTION_BACKEND``): ``auto`` (default: native on CPU,
  Triton on CUDA), ``torch`` (the plain formulation everywhere), ``native`` (CPU kernels only) or
  ``triton`` (Triton kernels, also on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
  imported, which is how the kernels are tested without a GPU).
- ``POLAFORMER_NATIVE=0``: no native CPU kernels; the ops run their torch formulation.
- ``POLAFORMER_ONEDNN=0|narrow|wide``: the oneDNN linear layers of :func:`polaformer.accelerate`
  (:mod:`polaformer.backends.cpu.onednn`).
"""
from __future__ import annotations

import os

import torch

from ..backends import triton as triton_backend
from ..backends.cpu import native
from ..capture import capturing, exporting, legacy_onnx_export  # noqa: F401  (re-exported from their old home)

__all__ = [
    "attention_backend",
    "capturing",
    "exporting",
    "cpu_kernels",
    "legacy_onnx_export",
    "on_gpu",
    "set_attention_backend",
    "triton_allowed",
]

ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")
_backend_override: str | None = None


def _check_backend(name: str, source: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    return name


def attention_backend() -> str:
    """The attention backend in force: the last :func:`set_attention_backend`, else the environment."""
    if _backend_override is not None:
        return _backend_override
    return _check_backend(os.environ.get("POLAFORMER_ATTENTION_BACKEND", "auto"), "POLAFORMER_ATTENTION_BACKEND")


def set_attention_backend(name: str | None) -> str | None:
    """Select the attention kernels for eager calls (see the module docstring); ``None`` returns to the
    environment's choice. Returns the previous override so a caller can restore it."""
    global _backend_override
    previous = _backend_override
    _backend_override = None if name is None else _check_backend(name, "attention backend")
    return previous


def cpu_kernels(x: torch.Tensor):
    """The compiled CPU kernels for a float32/float64 CPU tensor ``x``, or None (then the torch formulation
    runs). For eager calls: a caller under :func:`capturing` takes the plain formulation before asking."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    if attention_backend() not in ("auto", "native"):
        return None
    return native.native_kernels()


def on_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on a CUDA device, the kernels' home (its own function so tests can route a CPU
    tensor under the interpreter through the ``auto`` backend's CUDA path)."""
    return x.device.type == "cuda"


def triton_allowed(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs an op's Triton kernels: CUDA tensors under the ``auto`` or ``triton``
    backend, CPU tensors only under ``triton`` with ``TRITON_INTERPRET=1``; float64 CUDA tensors take the torch
    formulation. Eager calls and torch.compile both get the kernels (under compile each entry point is a
    ``torch.library`` op, so the graph holds it); :func:`~polaformer.capture.exporting` gets False. The op
    imports its kernels only then, so importing polaformer never imports triton.

    Raises RuntimeError when the ``triton`` backend was asked for explicitly and cannot run on ``x``.
    """
    backend = attention_backend()
    if backend not in ("auto", "triton") or exporting():
        return False
    gpu = on_gpu(x)
    if gpu and x.dtype == torch.float64:
        # Triton's fp64 products do not compile for every shape on a GPU (an abort, not an error): float64
        # takes the torch formulation there; the CPU interpreter runs it (the tests' gradcheck).
        return False
    if not gpu:
        if backend == "auto":
            return False
        if x.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"attention backend 'triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
                f"before triton is imported); got a {x.device.type} tensor"
            )
    if triton_backend.available():
        return True
    if backend == "triton":
        raise RuntimeError("attention backend 'triton' needs the triton package, which is not installed")
    return False
