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

The polarity coefficients Gˢ, Gᵒ of the paper are, in the official code, the gate ``g``: the second
half of the ``qg`` (or fourth quarter of ``qkvg``) projection, a per-token, per-channel weight
(N × d/2 per head and stream). The attention output of each head is ``[same-sign | opposite-sign]``
along its channels, so ``g``'s first ``d/2`` channels of a head are Gˢ and the last ``d/2`` are Gᵒ;
being applied after the local branch is added, they weight it too.

The ablation switches of paper Table 3 (defaults: the official layer, keys and outputs unchanged):
``polarity=False`` replaces the two streams by one, ``relu(x)ᵖ`` on q and k over the whole value
(:func:`~polaformer.ops.power_linear_attention`); ``polarity_coefficients=False`` drops the gate, so the
projection is ``q`` (or ``qkv``) and the output ``proj(attn + local(v))``; ``local`` picks the rank-restoring
branch on v: ``"dwc"`` (official), ``"dcn"`` (``dcn``, a :class:`DeformableDepthwiseConv2d`) or ``"none"``.

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

from ..ops import learnable_power, pola_layer_attention, power_linear_attention, resample_grid_table
from .deformable import DeformableDepthwiseConv2d
from .sr_attention import add_spatial_reduction, spatially_reduced

__all__ = ["LOCAL_BRANCHES", "PolaLinearAttention", "check_ablation_switches"]

# The rank-restoring branch on v: the official depthwise conv, a deformable one, or none.
LOCAL_BRANCHES = ("dwc", "dcn", "none")


def check_ablation_switches(polarity, polarity_coefficients, local) -> None:
    """One-line errors for switch values of the wrong kind."""
    for name, value in (("polarity", polarity), ("polarity_coefficients", polarity_coefficients)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if local not in LOCAL_BRANCHES:
        raise ValueError(f"local must be one of {', '.join(LOCAL_BRANCHES)}, got {local!r}")


def check_heads(dim, num_heads) -> None:
    """``dim`` channels split into ``num_heads`` heads: both positive integers, the split whole (a zero would be
    a ZeroDivisionError, a remainder a reshape error deep in the forward pass)."""
    for name, value in (("dim", dim), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dim % num_heads:
        raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")


def check_alpha(alpha) -> None:
    """The power map's range ``alpha``: NaN would make every logit NaN, a negative one a power below 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


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
        polarity: the two polarity streams (official); False: one stream of
            ``relu(x)ᵖ`` features over the whole value.
        polarity_coefficients: the gate ``g`` holding Gˢ/Gᵒ (see the module
            docstring); False removes it and its projection rows.
        local: ``"dwc"``, ``"dcn"`` or ``"none"``, the branch added on v.
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
        polarity: bool = True,
        polarity_coefficients: bool = True,
        local: str = "dwc",
    ):
        super().__init__()
        check_ablation_switches(polarity, polarity_coefficients, local)
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
        check_alpha(alpha)
        self.alpha = alpha
        self.sr_ratio = sr_ratio
        self.num_prefix_tokens = num_prefix_tokens
        self.polarity, self.polarity_coefficients, self.local = polarity, polarity_coefficients, local

        gated = 1 if polarity_coefficients else 0
        if fused_qkvg:
            setattr(self, "qkvg" if gated else "qkv", nn.Linear(dim, (3 + gated) * dim, bias=qkv_bias))
        else:
            setattr(self, "qg" if gated else "q", nn.Linear(dim, (1 + gated) * dim, bias=qkv_bias))
            self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        add_spatial_reduction(self, dim, sr_ratio)
        if local == "dwc":
            self.dwc = nn.Conv2d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        elif local == "dcn":
            self.dcn = DeformableDepthwiseConv2d(head_dim, kernel_size)
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
        """``(q, k, v, g)``, ``g`` None without polarity coefficients."""
        b, n, c = x.shape
        if hasattr(self, "qkvg"):
            q, k, v, g = self.qkvg(x).reshape(b, n, 4, c).unbind(2)
            return q, k, v, g
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).reshape(b, n, 3, c).unbind(2)
            return q, k, v, None
        if hasattr(self, "qg"):
            q, g = self.qg(x).reshape(b, n, 2, c).unbind(2)
        else:
            q, g = self.q(x), None
        x = spatially_reduced(self, x, height, width)
        k, v = self.kv(x).reshape(b, x.shape[1], 2, c).unbind(2)
        return q, k, v, g

    def local_branch(self, v: torch.Tensor, height: int, width: int) -> torch.Tensor | None:
        """``local(v)`` (B, H·W, C) for the grid tokens, None without a local branch (ablation); ``v`` (B, M, C)
        holds the values, stretched along the tokens when spatially reduced (M < N). Each head's values go
        through the same conv; prefix tokens have none."""
        local_conv = self.dwc if self.local == "dwc" else self.dcn if self.local == "dcn" else None
        if local_conv is None:
            return None
        b, heads, p = v.shape[0], self.num_heads, self.num_prefix_tokens
        n = p + height * width
        v = v.transpose(1, 2).reshape(b * heads, self.head_dim, -1)
        if v.shape[-1] != n:
            v = F.interpolate(v, size=n, mode="linear")
        grid = v[..., p:].reshape(b * heads, self.head_dim, height, width)
        return local_conv(grid).reshape(b, self.dim, height * width).transpose(1, 2)

    def local_branch_and_gate(self, out: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, height: int,
                              width: int) -> torch.Tensor:
        """``(out + local(v)) · g`` for (B, N, C) tokens, prefix tokens only gated; without a local branch or gate
        (ablations) that term is left out. (:meth:`attend` hands both to the attention op instead, which can
        fuse them.)"""
        local = self.local_branch(v, height, width)
        if local is not None:
            p = self.num_prefix_tokens
            out = torch.cat([out[:, :p], out[:, p:] + local], dim=1) if p else out + local
        return out if g is None else out * g

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, C) → (B, heads, N, head_dim), a view."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, height: int, width: int,
                  local: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``(attention + local) · gate`` of the (B, N, C) projections (k, v (B, M, C)) as (B, N, C) tokens,
        ``local`` (B, H·W, C) for the grid tokens, either None: the scale, power, key positions, local branch and
        gate all handed to the attention op, which fuses them where it can
        (:func:`~polaformer.ops.pola_layer_attention`)."""
        b, n, c = q.shape
        positions = None
        if self.positional_encoding is not None:
            positions = self._key_positions((height // self.sr_ratio, width // self.sr_ratio))
        heads = lambda t: None if t is None else self._heads(t)  # noqa: E731
        if self.polarity:
            scale = self.scale.view(1, 1, self.num_heads, self.head_dim).transpose(1, 2)
            out = pola_layer_attention(heads(q), heads(k), heads(v), scale, self.power, self.alpha, heads(positions),
                                       local=heads(local), gate=heads(gate))
            return out.transpose(1, 2).reshape(b, n, c)
        # the one-stream ablation: its own op, the layer's arithmetic here
        scale = F.softplus(self.scale)
        k = k if positions is None else k + positions
        out = power_linear_attention(heads(q / scale), heads(k / scale), heads(v),
                                     learnable_power(self.power, self.alpha)).transpose(1, 2).reshape(b, n, c)
        if local is not None:
            p = self.num_prefix_tokens
            out = torch.cat([out[:, :p], out[:, p:] + local], dim=1) if p else out + local
        return out if gate is None else out * gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, height: int,
               width: int) -> torch.Tensor:
        """``(attention + local(v)) · g`` of the (B, N, C) projections, as (B, N, C) tokens."""
        return self.attention(q, k, v, height, width, self.local_branch(v, height, width), g)

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
        return self.proj_drop(self.proj(self.attend(q, k, v, g, height, width)))
