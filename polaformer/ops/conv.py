"""Convolution identities used by the models."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["plus_depthwise_conv"]


def plus_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x + depthwise_conv(x)`` (odd square kernel, stride 1, "same" zero padding) as one convolution.

    The identity is folded into the kernel's centre tap, so the sum costs no pass of its own over the
    map (the map is written once instead of twice and read once instead of three times; gradients
    are the same, since the kernel is a sum of the weight and a constant). ``weight`` is (C, 1, k, k).
    """
    k = weight.shape[-1]
    if weight.shape[1] != 1 or weight.shape[-2] != k or k % 2 == 0 or x.shape[1] != weight.shape[0]:
        raise ValueError(
            f"expected a depthwise (C, 1, k, k) kernel with odd k for a (B, C, H, W) map, "
            f"got weight {tuple(weight.shape)} for x {tuple(x.shape)}"
        )
    identity = F.pad(weight.new_ones(1, 1, 1, 1), (k // 2,) * 4)
    return F.conv2d(x, weight + identity, bias, padding=k // 2, groups=weight.shape[0])
