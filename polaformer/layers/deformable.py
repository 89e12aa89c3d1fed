"""Depthwise deformable convolutions: the DCN alternative to the Pola layers' depthwise conv on v
(paper Table 3, row 1).

Each is torchvision's ``DeformConv2d`` with one filter per channel, whose sampling offsets come from a
small conv over the same input. That offset conv starts at zero, so a fresh module computes exactly
the plain depthwise conv of its weights and learns to move its taps from there.
"""
from __future__ import annotations

import torch
from torch import nn
from torchvision.ops import DeformConv2d

__all__ = ["DeformableDepthwiseConv1d", "DeformableDepthwiseConv2d"]


def _check_kernel_size(kernel_size: int) -> None:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number so the conv keeps positions, got {kernel_size}")


class DeformableDepthwiseConv2d(nn.Module):
    """``(B, C, H, W) -> (B, C, H, W)``: a k×k depthwise deformable conv.

    ``offset``: conv predicting a (dy, dx) pair per kernel tap and position, shared by all channels
    (one offset group); ``conv``: the deformable depthwise filter.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        _check_kernel_size(kernel_size)
        pad = kernel_size // 2
        self.offset = nn.Conv2d(channels, 2 * kernel_size * kernel_size, kernel_size, padding=pad)
        nn.init.zeros_(self.offset.weight)
        nn.init.zeros_(self.offset.bias)
        self.conv = DeformConv2d(channels, channels, kernel_size, padding=pad, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, self.offset(x))


class DeformableDepthwiseConv1d(nn.Module):
    """``(B, C, N) -> (B, C, N)``: the 1-D version for token sequences, taps moving along the tokens only.

    ``offset`` predicts one shift per tap and token; ``conv`` is a 1×k deformable depthwise filter run on
    the sequence as a one-row image, its vertical offsets held at zero.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        _check_kernel_size(kernel_size)
        self.kernel_size = kernel_size
        pad = kernel_size // 2
        self.offset = nn.Conv1d(channels, kernel_size, kernel_size, padding=pad)
        nn.init.zeros_(self.offset.weight)
        nn.init.zeros_(self.offset.bias)
        self.conv = DeformConv2d(channels, channels, (1, kernel_size), padding=(0, pad), groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, n = x.shape
        shift = self.offset(x)  # (B, k, N)
        # torchvision reads offsets as (dy, dx) pairs per tap
        offsets = torch.stack([torch.zeros_like(shift), shift], dim=2).reshape(b, 2 * self.kernel_size, 1, n)
        return self.conv(x.unsqueeze(2), offsets).squeeze(2)
