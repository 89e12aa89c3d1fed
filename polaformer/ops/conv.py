"""Convolution identities used by the models."""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
except ImportError:  # older torch: only the flag that torch.export sets as well
    from torch.fx._symbolic_trace import is_fx_tracing as is_fx_symbolic_tracing

from .pola_attention import _capturing_graph

__all__ = ["plus_depthwise_conv"]


def plus_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel_size: int,
                        channels: int) -> torch.Tensor:
    """``x + depthwise_conv(x)`` (square odd kernel, stride 1, "same" zero padding) as one convolution.

    The identity is folded into the kernel's centre tap, so the sum costs no pass of its own over the
    map (written once instead of twice, read once instead of three times); gradients are the same, the
    kernel being the weight plus a constant. ``weight`` is (channels, 1, k, k). Graph capture and FX
    tracing get the plain sum: exporters want a convolution kernel of known shape, and FX cannot
    follow the folded kernel's construction through proxies.
    """
    if kernel_size % 2 == 0:
        raise ValueError(f"the identity needs an odd kernel with a centre tap, got kernel_size {kernel_size}")
    padding = kernel_size // 2
    if is_fx_symbolic_tracing() or _capturing_graph():
        return x + F.conv2d(x, weight, bias, padding=padding, groups=channels)
    identity = F.pad(weight.new_ones(1, 1, 1, 1), (padding,) * 4)
    return F.conv2d(x, weight + identity, bias, padding=padding, groups=channels)
