"""Whether a graph is being captured, the question every fast path asks before it runs.

Eager CPU kernels write in place and through ``out=``, which breaks or mis-traces under capture, and a check
that reads a tensor's value cannot be traced; so the ops (:mod:`polaformer.ops`), the CPU kernels
(:mod:`polaformer.backends.cpu`) and the module swaps of :func:`polaformer.accelerate` ask here. Imports torch
only, so it sits below all of them.
"""
from __future__ import annotations

import torch

try:
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as _fx_tracing
except ImportError:  # older torch: only the flag that torch.export sets as well
    from torch.fx._symbolic_trace import is_fx_tracing as _fx_tracing

__all__ = ["capturing", "exporting", "legacy_onnx_export"]


def capturing() -> bool:
    """True while a graph is being captured: torch.compile, torch.export, the ONNX exporters, TorchScript, or
    FX symbolic tracing (where tensors are proxies). Capture gets no eager CPU kernel (their in-place and
    ``out=`` writes break or mis-trace there) and no check that reads a value; under torch.compile the Triton
    kernels stay, as registered ops (:func:`polaformer.ops.dispatch.triton_allowed`)."""
    return torch.compiler.is_compiling() or exporting()


def exporting() -> bool:
    """True while a graph is captured for another runtime (torch.export, ONNX, TorchScript, FX symbolic
    tracing): these keep the plain torch formulation, which every runtime can run."""
    if torch.compiler.is_compiling():
        # Under dynamo only torch.export can be exporting, and the other checks need not be traced (torch
        # 2.11's dynamo breaks the graph on some of them). The flag is read, not is_exporting() called: dynamo
        # before torch 2.12 folds that call to True under torch.compile, which sent compiled calls on a GPU
        # to the torch formulation.
        return bool(getattr(torch.compiler, "_is_exporting_flag", False))
    return (
        torch.compiler.is_exporting()
        or torch.onnx.is_in_onnx_export()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or _fx_tracing()
    )


def legacy_onnx_export() -> bool:
    """True inside ``torch.onnx.export(..., dynamo=False)``, whose TorchScript tracer lacks some operators."""
    return torch.onnx.is_in_onnx_export() and torch.jit.is_tracing()
