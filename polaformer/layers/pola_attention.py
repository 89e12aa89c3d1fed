"""PolaFormer's attention block (the layer of the official PVT and Swin code).

Parameter names follow the official checkpoints, so the released weights load
without renaming:

- ``qg`` + ``kv`` (PVT layout, keys/values may be spatially reduced) or one
  fused ``qkvg`` (Swin layout);
- ``scale``: learnable softplus temperature dividing q and k;
- ``power``: per head and channel, ``p = 1 + α·sigmoid(power)``;
- ``positional_encoding``: optional learnable table added to the keys;
- ``dwc``: depthwise conv on v, shared by all heads (``head_dim`` channels);
- ``sr`` + ``norm``: strided conv and LayerNorm reducing the keys/values;
- ``proj``: output projection. The output is ``proj((attn + dwc(v)) * g)``.

Where the official layer returns an output, this one returns the same: an odd ``head_dim`` splits
the values as ``torch.chunk`` does (the same-sign stream takes the larger half), a grid not
divisible by ``sr_ratio`` is reduced by the flooring strided conv, and the key table is added
flat whenever it has one row per key (or a single row, which broadcasts), whatever the grid.
Only where the official layer fails (a table of another length) is the table resampled.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import depthwise_conv2d, learnable_power, pola_linear_attention, resample_grid_table, tokens_to_map
from ..ops.native import native_kernels
from ..ops.pola_attention import _capturing_graph
from .linear import Linear

__all__ = ["PolaLinearAttention", "branch_and_gate"]


def add_branch_and_gate(out: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """``(out + branch) · gate``, the branch added to the tokens after ``prefix`` (B, N, C) ones.

    ``out`` must be the attention op's fresh output: when no autograd is involved and no graph is being
    captured, it is updated in place (the op saved nothing that this would overwrite).
    """
    if not (out.requires_grad or branch.requires_grad or gate.requires_grad or _capturing_graph()):
        (out[:, prefix:] if prefix else out).add_(branch)
        return out.mul_(gate)
    if prefix:
        out = torch.cat([out[:, :prefix], out[:, prefix:] + branch], dim=1)
    else:
        out = out + branch
    return out * gate


def _branch_kernels():
    kernels = native_kernels()
    return kernels if kernels is not None and hasattr(kernels, "dwconv_add_gate") else None


def fuses_branch_and_gate(out: torch.Tensor, v: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor) -> bool:
    """Whether ``(out + depthwise_conv(v)) · g`` can run as one native pass (:func:`branch_and_gate`): no
    gradient wanted, no graph capture, CPU float32/64, a fresh contiguous ``out``, ``v`` and ``g`` with a unit
    channel stride, and the native kernels built."""
    tensors = (out, v, g, weight, bias)
    return not (_capturing_graph() or out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64)
                or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
                or any(t.dtype != out.dtype for t in tensors) or not out.is_contiguous()
                or v.stride(-1) != 1 or g.stride(-1) != 1 or _branch_kernels() is None)


def branch_and_gate(out: torch.Tensor, v: torch.Tensor, g: torch.Tensor, conv: nn.Conv2d, prefix: int,
                    height: int, width: int) -> torch.Tensor:
    """``(out + conv(v)) · g`` for (B, prefix + H·W, C) tokens, ``conv`` a "same" depthwise conv over the grid
    tokens of ``v`` (the prefix tokens are only gated); ``out`` must be the attention's fresh output.

    Without gradients this is one native pass that reads ``v`` and ``g`` where the projection wrote them
    (token rows, a unit channel stride) and updates ``out`` in place (:func:`fuses_branch_and_gate`);
    otherwise a channels-last copy of ``v``, the conv, the add and the gate.
    """
    k = conv.kernel_size[0]
    if conv.bias is not None and fuses_branch_and_gate(out, v, g, conv.weight, conv.bias):
        taps = conv.weight.view(conv.weight.shape[0], k * k).t().contiguous()
        _branch_kernels().dwconv_add_gate(out, v, g, taps, conv.bias, prefix, height, width, k)
        return out
    grid = tokens_to_map(v[:, prefix:], height, width).contiguous(memory_format=torch.channels_last)
    local = depthwise_conv2d(grid, conv.weight, conv.bias).flatten(2).transpose(1, 2)
    return add_branch_and_gate(out, local, g, prefix)


class PolaLinearAttention(nn.Module):
    """Polarity-aware linear attention with learnable power map, gate and depthwise conv.

    Args:
        dim: channels of the input tokens.
        num_heads: attention heads; ``dim`` must be divisible by it.
        qkv_bias: bias in the q/k/v/gate projections.
        proj_drop: dropout after the output projection.
        sr_ratio: spatial reduction of keys/values (a strided conv); requires
            the separate ``qg``/``kv`` projections.
        kernel_size: size of the depthwise conv on v.
        alpha: the power map's range, ``p ∈ (1, 1 + alpha)``.
        key_pos_tokens: length of the learnable key positional encoding, or
            None for none. It is added row by row when it has one row per key
            (prefix tokens included), as the official code does; for another
            number of keys, a table whose rows (after the prefix tokens) form a
            square grid is resampled bilinearly to the key grid, so the layer
            runs at any input size.
        fused_qkvg: one ``qkvg`` projection (Swin layout) instead of ``qg`` + ``kv``.
        num_prefix_tokens: leading tokens (class token) that take part in the
            attention but not in the depthwise conv branch.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        sr_ratio: int = 1,
        kernel_size: int = 5,
        alpha: float = 4.0,
        key_pos_tokens: int | None = None,
        fused_qkvg: bool = False,
        num_prefix_tokens: int = 0,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        head_dim = dim // num_heads
        if head_dim < 2:
            raise ValueError(f"head_dim = dim / num_heads = {head_dim} must be at least 2 (two polarity streams)")
        if fused_qkvg and sr_ratio > 1:
            raise ValueError("spatial reduction (sr_ratio > 1) needs separate qg/kv projections (fused_qkvg=False)")
        if num_prefix_tokens and sr_ratio > 1:
            raise ValueError("prefix tokens are not supported together with spatial reduction")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.alpha = alpha
        self.sr_ratio = sr_ratio
        self.num_prefix_tokens = num_prefix_tokens

        if fused_qkvg:
            self.qkvg = Linear(dim, 4 * dim, bias=qkv_bias)
        else:
            self.qg = Linear(dim, 2 * dim, bias=qkv_bias)
            self.kv = Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)
        self.dwc = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        self.power = nn.Parameter(torch.zeros(1, num_heads, 1, head_dim))
        self.scale = nn.Parameter(torch.zeros(1, 1, dim))
        if key_pos_tokens is not None:
            self.positional_encoding = nn.Parameter(torch.zeros(1, key_pos_tokens, dim))
            side = math.isqrt(key_pos_tokens - num_prefix_tokens)
            self.key_pos_grid = (side, side) if side * side == key_pos_tokens - num_prefix_tokens else None
        else:
            self.register_parameter("positional_encoding", None)
            self.key_pos_grid = None

    def _key_positions(self, key_grid: tuple[int, int]) -> torch.Tensor:
        """The key positional table for a key grid: added flat where the official code adds it
        (one row per key, or one row), else resampled from the table's square grid."""
        table = self.positional_encoding
        rows = table.shape[1]
        if rows in (1, self.num_prefix_tokens + key_grid[0] * key_grid[1]):
            return table
        if self.key_pos_grid is None:
            raise ValueError(
                f"key positional encoding holds {rows} tokens (not a square grid), "
                f"cannot resample it to a {key_grid[0]}x{key_grid[1]} key grid"
            )
        return resample_grid_table(table, key_grid, self.key_pos_grid, self.num_prefix_tokens,
                                   mode="bilinear", antialias=False)

    def _project(self, x: torch.Tensor, height: int, width: int):
        b, n, c = x.shape
        if hasattr(self, "qkvg"):
            q, k, v, g = self.qkvg(x).reshape(b, n, 4, c).unbind(2)
            return q, k, v, g
        q, g = self.qg(x).reshape(b, n, 2, c).unbind(2)
        if self.sr_ratio > 1:
            if height < self.sr_ratio or width < self.sr_ratio:
                raise ValueError(
                    f"token grid {height}x{width} is smaller than the spatial reduction ratio {self.sr_ratio}"
                )
            grid = tokens_to_map(x, height, width)
            x = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
        k, v = self.kv(x).reshape(b, x.shape[1], 2, c).unbind(2)
        return q, k, v, g

    def _local_branch_fused(self, out, v, g, prefix, height, width) -> bool:
        k = self.dwc.kernel_size[0]
        weight, bias = self.dwc.weight, self.dwc.bias
        if bias is None or not fuses_branch_and_gate(out, v, g, weight, bias):
            return False
        # each tap's weights over all channels (the head_dim kernels repeated per head), (K·K, C)
        taps = weight.view(self.head_dim, k * k).t().repeat(1, self.num_heads)
        _branch_kernels().dwconv_add_gate(out, v, g, taps, bias.repeat(self.num_heads), prefix, height, width, k)
        return True

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``x``: (B, prefix + height·width, dim) tokens in raster order."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"expected tokens of shape (B, N, {self.dim}), got {tuple(x.shape)}")
        b, n, c = x.shape
        if n != self.num_prefix_tokens + height * width:
            raise ValueError(
                f"token count {n} != {self.num_prefix_tokens} prefix tokens + H*W = {height}*{width}"
            )
        q, k, v, g = self._project(x, height, width)
        n_kv = k.shape[1]
        if self.positional_encoding is not None:
            k = k + self._key_positions((height // self.sr_ratio, width // self.sr_ratio))
        scale = F.softplus(self.scale)
        heads = self.num_heads
        q = (q / scale).reshape(b, n, heads, -1).transpose(1, 2)
        k = (k / scale).reshape(b, n_kv, heads, -1).transpose(1, 2)
        v_tokens = v
        v = v.reshape(b, n_kv, heads, -1).transpose(1, 2)

        out = pola_linear_attention(q, k, v, learnable_power(self.power, self.alpha))
        out = out.transpose(1, 2).reshape(b, n, c)  # a view: the op writes token-major memory

        p = self.num_prefix_tokens
        if n_kv == n and self._local_branch_fused(out, v_tokens, g, p, height, width):
            return self.proj_drop(self.proj(out))
        if n_kv != n:  # spatially reduced values are stretched back along the token axis
            v = F.interpolate(v.transpose(-2, -1).reshape(b * heads, -1, n_kv), size=n, mode="linear")
            v = v.reshape(b, heads, -1, n).transpose(-2, -1)
            grid = v[:, :, p:].reshape(b * heads, height, width, -1).permute(0, 3, 1, 2)
            local = self.dwc(grid).reshape(b, c, height * width).transpose(1, 2)
        else:
            # The conv shared by the heads is a depthwise conv over all channels with its kernel repeated
            # per head (torch.cat: a sixth of Tensor.repeat's call cost), on v as a dense channels-last map
            # (oneDNN's fast kernel; a strided view takes a path several times slower); its channels-last
            # output is already in token order.
            grid = tokens_to_map(v_tokens[:, p:], height, width).contiguous(memory_format=torch.channels_last)
            local = depthwise_conv2d(grid, torch.cat([self.dwc.weight] * heads), torch.cat([self.dwc.bias] * heads))
            local = local.flatten(2).transpose(1, 2)
        return self.proj_drop(self.proj(add_branch_and_gate(out, local, g, p)))
