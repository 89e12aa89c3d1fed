"""Token sequences (B, H·W, C) as feature maps (B, C, H, W) without copies."""
from __future__ import annotations

import torch

__all__ = ["tokens_to_map"]


def tokens_to_map(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Raster-ordered tokens (B, H·W, C) as a (B, C, H, W) map: a channels-last view of the same memory.

    Built as reshape + permute rather than transpose + reshape: the latter gives a batch of one the
    stride C instead of H·W·C, oneDNN then reads the map as channels-first and its convolutions take a
    much slower path.
    Callers check the grid against the token count (no check here: FX tracing runs this on proxies).
    """
    b, _, c = tokens.shape
    return tokens.reshape(b, height, width, c).permute(0, 3, 1, 2)
