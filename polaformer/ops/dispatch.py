"""Where the ops choose their kernel: the one capture check and the one backend switch.

Every op has a plain torch formulation, the one graph capture sees. In eager mode on the CPU the ops call
the native kernels of :mod:`polaformer.backends.cpu` where those are built and allowed. Nothing else in
the package asks these questions.

Switches (environment variables):

- ``POLAFORMER_NATIVE=0``: no native CPU kernels; the ops run their torch formulation.
- ``POLAFORMER_ONEDNN=0|narrow|wide``: the oneDNN linear layers of :func:`polaformer.accelerate`
  (:mod:`polaformer.backends.cpu.onednn`).
"""
from __future__ import annotations

import torch

from ..backends.cpu import native

try:
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as _fx_tracing
except ImportError:  # older torch: only the flag that torch.export sets as well
    from torch.fx._symbolic_trace import is_fx_tracing as _fx_tracing

__all__ = ["capturing", "cpu_kernels", "legacy_onnx_export"]


def capturing() -> bool:
    """True while a graph is being captured: torch.compile, torch.export, the ONNX exporters, TorchScript, or
    FX symbolic tracing (where tensors are proxies). Capture gets the plain formulation: the in-place and
    ``out=`` writes of the eager kernels break or mis-trace there, and compilers fuse plain ops on their own."""
    return (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.onnx.is_in_onnx_export()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or _fx_tracing()
    )


def legacy_onnx_export() -> bool:
    """True inside ``torch.onnx.export(..., dynamo=False)``, whose TorchScript tracer lacks some operators."""
    return torch.onnx.is_in_onnx_export() and torch.jit.is_tracing()


def cpu_kernels(x: torch.Tensor):
    """The compiled CPU kernels for a float32/float64 CPU tensor ``x``, or None (then the torch formulation
    runs). For eager calls: a caller under :func:`capturing` takes the plain formulation before asking."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    return native.native_kernels()
