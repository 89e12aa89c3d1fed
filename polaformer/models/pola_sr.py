"""PaCS super-resolution: the MambaIRv2Light layout of the official PolaFormer++ SR code (``pola_sr_light_x*``).

Each attentive layer holds a shifted-window softmax attention (16×16 windows, relative position bias) with a
gated MLP, then an attentive module in which the official code replaced MambaIRv2's selective scan by PaCS
linear attention over the whole image: 1×1 ``in_proj``, ``x · sigmoid(CPE(x))`` with a 3×3 depthwise CPE,
PaCS attention (4 heads, 2-D RoPE over 2·head_dim on the numerator), LayerNorm and ``out_proj``; a second
gated MLP follows. Groups of layers end in a 3×3 conv with a residual; a pixel-shuffle head upsamples in one
step. Module names follow the official checkpoints (``layers.i.residual_group.layers.j.assm.attn.qkvg`` …),
so they load strictly; the ×3 and ×4 models have the official 930,347 and 939,440 parameters.

The input is mirrored at its bottom/right edges up to whole windows and the output cropped back, as in the
official forward. Large images: :func:`chop_upscale` is the official test's partition (pieces of about 200
pixels with a 10% overlap that is cut away), :func:`tiled_upscale` our alternative (any tile size, overlaps
averaged).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models import generate_default_cfgs
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PacsLinearAttention, RoPE2d
from ..layers.qkv_window_attention import QKVWindowAttention
from ..layers.window_attention import relative_position_index
from ..ops import tokens_to_map
from ._helpers import check_architecture, register_variants, without_timm_extras
from .swin import hard_window_mask, shifted_window_mask, window_partition, window_reverse

__all__ = ["PolaSR", "chop_upscale", "tiled_upscale"]

ATTENTION_HEADS = 4  # fixed in the official attentive module
CHOP_SIDE = 200  # the official test cuts a side into side // 200 + 1 pieces
DIV2K_RGB_MEAN = (0.4488, 0.4371, 0.4040)


class Gate(nn.Module):
    """Spatial gate of the gated MLP: one half of the channels times a 5×5 depthwise conv of the other half."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        x2 = self.conv(tokens_to_map(self.norm(x2), height, width)).flatten(2).transpose(1, 2)
        return x1 * x2


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.sg = Gate(hidden // 2)
        self.fc2 = nn.Linear(hidden // 2, dim)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self.fc2(self.sg(self.act(self.fc1(x)), height, width))


class AttentiveModule(nn.Module):
    """The official ``ASSM`` with PaCS attention in place of the selective scan, on (B, H·W, C) tokens."""

    def __init__(self, dim: int):
        super().__init__()
        self.in_proj = nn.Sequential(nn.Conv2d(dim, dim, 1))
        self.CPE = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim))
        self.attn = PacsLinearAttention(dim, ATTENTION_HEADS)
        self.RoPE_linear = RoPE2d(2 * dim, ATTENTION_HEADS)
        self.out_norm = nn.LayerNorm(dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        x = self.in_proj(tokens_to_map(x, height, width))
        x = x * torch.sigmoid(self.CPE(x))
        y = self.attn(x, *self.RoPE_linear(height, width)).flatten(2).transpose(1, 2)
        return self.out_proj(self.out_norm(y))


class AttentiveLayer(nn.Module):
    """Window attention + gated MLP, then the attentive module + gated MLP, each half with a scaled skip."""

    def __init__(self, dim: int, num_heads: int, window_size: int, shift_size: int, mlp_ratio: float):
        super().__init__()
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.norm4 = nn.LayerNorm(dim)
        self.scale1 = nn.Parameter(1e-4 * torch.ones(dim))
        self.scale2 = nn.Parameter(1e-4 * torch.ones(dim))
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.win_mhsa = QKVWindowAttention(dim, window_size, num_heads)
        self.assm = AttentiveModule(dim)
        hidden = int(dim * mlp_ratio)
        self.convffn1 = GatedMLP(dim, hidden)
        self.convffn2 = GatedMLP(dim, hidden)

    def window_attention(self, x: torch.Tensor, height: int, width: int, relative_index: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        window, shift = (self.window_size, self.window_size), self.shift_size
        qkv = self.wqkv(x).reshape(b, height, width, 3 * c)
        if shift:
            qkv = torch.roll(qkv, (-shift, -shift), (1, 2))
        out = self.win_mhsa(window_partition(qkv, window), relative_index, mask if shift else None)
        out = window_reverse(out, window, height, width)
        if shift:
            out = torch.roll(out, (shift, shift), (1, 2))
        return out.reshape(b, n, c)

    def forward(self, x: torch.Tensor, height: int, width: int, relative_index: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x_win = self.window_attention(self.norm1(x), height, width, relative_index, mask) + shortcut
        x_win = self.convffn1(self.norm2(x_win), height, width) + x_win
        x = shortcut * self.scale1 + x_win
        shortcut = x
        x = self.assm(self.norm3(x), height, width) + x
        x = x + self.convffn2(self.norm4(x), height, width)
        return shortcut * self.scale2 + x


class ResidualGroup(nn.Module):
    def __init__(self, depth: int, **layer_kwargs):
        super().__init__()
        window = layer_kwargs["window_size"]
        self.layers = nn.ModuleList(
            AttentiveLayer(shift_size=0 if i % 2 == 0 else window // 2, **layer_kwargs) for i in range(depth))
        self.grad_checkpointing = False

    def forward(self, x, height, width, relative_index, mask):
        for layer in self.layers:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, height, width, relative_index, mask, use_reentrant=False)
            else:
                x = layer(x, height, width, relative_index, mask)
        return x


class AttentiveGroup(nn.Module):
    """The official ``ASSB``: a residual group of layers, then a 3×3 conv, around a skip."""

    def __init__(self, dim: int, depth: int, **layer_kwargs):
        super().__init__()
        self.residual_group = ResidualGroup(depth, dim=dim, **layer_kwargs)
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x, height, width, relative_index, mask):
        y = tokens_to_map(self.residual_group(x, height, width, relative_index, mask), height, width)
        return self.conv(y).flatten(2).transpose(1, 2) + x


class PatchNorm(nn.Module):
    """Feature map to tokens, then LayerNorm (the official ``patch_embed``, kept for its ``norm`` key)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.flatten(2).transpose(1, 2))


class PolaSR(nn.Module):
    """Lightweight super-resolution network with PaCS attention (the official lightSR layout).

    Args:
        upscale: scale factor (any integer ≥ 1; the official models use 2, 3, 4).
        in_chans: image channels (3: the DIV2K mean is subtracted, otherwise none).
        embed_dim: feature channels (divisible by 8: four PaCS heads with RoPE over twice their width).
        depths: attentive layers per group.
        num_heads: window-attention heads per group.
        window_size: side of the softmax windows; the input is mirrored to a multiple of it.
        mlp_ratio: hidden width of the gated MLPs over ``embed_dim`` (the gate halves it).
        img_range: multiplier applied after subtracting the mean (1 for images in [0, 1]).
    """

    def __init__(self, upscale: int = 4, in_chans: int = 3, embed_dim: int = 48, depths=(5, 5, 5, 5),
                 num_heads=(4, 4, 4, 4), window_size: int = 16, mlp_ratio: float = 1.0, img_range: float = 1.0):
        super().__init__()
        check_architecture(upscale=upscale, in_chans=in_chans, embed_dim=embed_dim, depths=list(depths),
                           num_heads=list(num_heads), window_size=window_size, ratios={"mlp_ratio": mlp_ratio})
        if embed_dim % 8:  # four PaCS heads whose RoPE tables span twice their width in quarter-turn pairs
            raise ValueError(f"embed_dim must be divisible by 8, got {embed_dim}")
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {list(depths)} and num_heads {list(num_heads)} differ in length")
        self.upscale = upscale
        self.in_chans = in_chans
        self.window_size = window_size
        self.img_range = img_range
        mean = DIV2K_RGB_MEAN if in_chans == 3 else (0.0,) * in_chans
        self.register_buffer("mean", torch.tensor(mean).view(1, in_chans, 1, 1), persistent=False)
        self.register_buffer("relative_position_index_SA", relative_position_index(window_size, window_size))

        self.conv_first = nn.Conv2d(in_chans, embed_dim, 3, padding=1)
        self.patch_embed = PatchNorm(embed_dim)
        self.layers = nn.ModuleList(
            AttentiveGroup(embed_dim, depth, num_heads=heads, window_size=window_size, mlp_ratio=mlp_ratio)
            for depth, heads in zip(depths, num_heads))
        self.norm = nn.LayerNorm(embed_dim)
        self.conv_after_body = nn.Conv2d(embed_dim, embed_dim, 3, padding=1)
        self.upsample = nn.Sequential(nn.Conv2d(embed_dim, upscale ** 2 * in_chans, 3, padding=1),
                                      nn.PixelShuffle(upscale))
        self.apply(self._init_weights)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True):
        for group in self.layers:
            group.residual_group.grad_checkpointing = enable

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def mirror_pad(self, x: torch.Tensor) -> torch.Tensor:
        """Extend the bottom and right edges by their mirror image up to whole windows."""
        h, w = x.shape[-2:]
        mod = self.window_size
        hp, wp = math.ceil(h / mod) * mod, math.ceil(w / mod) * mod
        while x.shape[-2] < hp:
            x = torch.cat([x, x.flip(-2)], -2)
        while x.shape[-1] < wp:
            x = torch.cat([x, x.flip(-1)], -1)
        return x[..., :hp, :wp]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        window = (self.window_size, self.window_size)
        shift = self.window_size // 2
        mask = hard_window_mask(shifted_window_mask((h, w), window, (shift, shift), x.device))
        tokens = self.patch_embed(x)
        for group in self.layers:
            tokens = group(tokens, h, w, self.relative_position_index_SA, mask)
        return tokens_to_map(self.norm(tokens), h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) low-resolution images in [0, 1] → (B, C, scale·H, scale·W)."""
        if x.dim() != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"expected images of shape (B, {self.in_chans}, H, W), got {tuple(x.shape)}")
        h, w = x.shape[-2:]
        if h == 0 or w == 0:  # no pixel to upscale (or to mirror to a window): the empty output image
            return x.new_zeros(*x.shape[:2], h * self.upscale, w * self.upscale)
        x = (self.mirror_pad(x) - self.mean) * self.img_range
        x = self.conv_first(x)
        x = self.conv_after_body(self.forward_features(x)) + x
        x = self.upsample(x) / self.img_range + self.mean
        return x[..., :h * self.upscale, :w * self.upscale]


@torch.no_grad()
def chop_upscale(model: nn.Module, lr: torch.Tensor, scale: int) -> torch.Tensor:
    """Upscale (B, C, H, W) ``lr`` as the official lightSR test does (``MambaIRv2LightModel.test``).

    Each side of ``n`` pixels is cut into ``n // 200 + 1`` equal pieces, after reflect-padding the bottom and
    right edges to a multiple of that count; every piece is run with a tenth of its side of context from each
    neighbour, which is cut from its output, and the outputs are put side by side and cropped back. An image
    under 200 pixels on both sides is one call of ``model``.
    """
    if lr.dim() != 4:
        raise ValueError(f"expected a (B, C, H, W) batch, got shape {tuple(lr.shape)}")
    h, w = lr.shape[-2:]
    rows, cols = h // CHOP_SIDE + 1, w // CHOP_SIDE + 1
    padded = F.pad(lr, (0, -w % cols, 0, -h % rows), mode="reflect")
    piece_h, piece_w = padded.shape[-2] // rows, padded.shape[-1] // cols
    context_h, context_w = piece_h // 10, piece_w // 10
    out = None
    for i in range(rows):
        before_h = context_h if i > 0 else 0
        after_h = context_h if i < rows - 1 else 0
        for j in range(cols):
            before_w = context_w if j > 0 else 0
            after_w = context_w if j < cols - 1 else 0
            piece = model(padded[..., i * piece_h - before_h:(i + 1) * piece_h + after_h,
                                 j * piece_w - before_w:(j + 1) * piece_w + after_w])
            if out is None:
                out = piece.new_zeros(*piece.shape[:2], padded.shape[-2] * scale, padded.shape[-1] * scale)
            out[..., i * piece_h * scale:(i + 1) * piece_h * scale, j * piece_w * scale:(j + 1) * piece_w * scale] = \
                piece[..., before_h * scale:(before_h + piece_h) * scale, before_w * scale:(before_w + piece_w) * scale]
    return out[..., :h * scale, :w * scale]


@torch.no_grad()
def tiled_upscale(model: nn.Module, lr: torch.Tensor, scale: int, tile: int = 192, overlap: int = 16) -> torch.Tensor:
    """Upscale (B, C, H, W) ``lr`` tile by tile, so that memory grows with ``tile``, not with the image.

    Tiles of ``tile``×``tile`` low-resolution pixels step by ``tile − overlap``; outputs where tiles overlap are
    averaged. An image no larger than one tile is one call of ``model``. Each tile is mirrored to whole windows
    by the model itself.
    """
    if lr.dim() != 4:
        raise ValueError(f"expected a (B, C, H, W) batch, got shape {tuple(lr.shape)}")
    if not 0 <= overlap < tile:
        raise ValueError(f"overlap must be in [0, tile), got overlap {overlap} with tile {tile}")
    b, c, h, w = lr.shape
    out = lr.new_zeros(b, c, h * scale, w * scale)
    count = lr.new_zeros(1, 1, h * scale, w * scale)

    def starts(size: int) -> list[int]:
        if size <= tile:
            return [0]
        steps = list(range(0, size - tile, tile - overlap))
        return steps + [size - tile]

    for top in starts(h):
        for left in starts(w):
            piece = model(lr[..., top:top + tile, left:left + tile])
            rows = slice(top * scale, top * scale + piece.shape[-2])
            cols = slice(left * scale, left * scale + piece.shape[-1])
            out[..., rows, cols] += piece
            count[..., rows, cols] += 1
    return out / count


def _cfg(**kwargs):
    return {"input_size": (3, 64, 64), "first_conv": "conv_first", "classifier": "upsample.0",
            "mean": DIV2K_RGB_MEAN, "std": (1.0, 1.0, 1.0), **kwargs}


_SCALES = {f"pola_sr_light_x{scale}": scale for scale in (2, 3, 4)}

default_cfgs = generate_default_cfgs({name: _cfg() for name in _SCALES})


def _create(variant: str, pretrained: bool = False, **kwargs) -> PolaSR:
    if pretrained:
        raise ValueError(f"{variant} has no downloadable weights; load the authors' file with "
                         "'polaformer sr eval --checkpoint PATH'")
    return PolaSR(upscale=_SCALES[variant], **without_timm_extras(kwargs))


register_variants(__name__, _SCALES, _create)
