"""Resampling learned position tables laid out as raster-ordered token grids."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["resample_grid_table"]


def resample_grid_table(table: torch.Tensor, new_grid: tuple[int, int], old_grid: tuple[int, int],
                        num_prefix_tokens: int = 0, mode: str = "bilinear", antialias: bool = False) -> torch.Tensor:
    """A ``(1, prefix + h·w, C)`` table on an ``old_grid`` (h, w) interpolated to ``new_grid``.

    The ``num_prefix_tokens`` leading rows (class token) are kept as they are. The grid is
    interpolated with ``align_corners=False`` in the table's own dtype (float32 for half-precision
    tables, which some interpolation kernels lack), so a float64 model resamples in float64 as the
    official PVT code does; the result has the table's dtype.
    """
    prefix, grid = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    channels = table.shape[-1]
    grid = grid.to(torch.promote_types(table.dtype, torch.float32))
    grid = grid.reshape(1, old_grid[0], old_grid[1], channels).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new_grid[0], new_grid[1]), mode=mode, antialias=antialias,
                         align_corners=False if mode in ("bilinear", "bicubic") else None)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], channels).to(table.dtype)
    return torch.cat([prefix, grid], dim=1) if num_prefix_tokens else grid
