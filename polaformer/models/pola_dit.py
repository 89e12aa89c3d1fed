"""PolaDiT: the diffusion transformer (DiT) with PolaFormer++'s PaCS attention (``pola_dit_{s,b,l,xl}_{2,4,8}``).

The DiT of Peebles & Xie with only the token mixer changed, as in the official PolaFormer++ code: patch
embedding plus a fixed 2-D sin-cos position table, adaLN-Zero blocks conditioned on the sum of a timestep
embedding and a class embedding (with a null class for classifier-free guidance when ``class_dropout_prob``
> 0), and a final adaLN layer that predicts ε (and, with ``learn_sigma``, the variance interpolation) per
pixel. Parameter names are the official ones, so the authors' checkpoints load strictly.

``attention="softmax"`` builds the original DiT instead (timm's ``Attention``, keys ``attn.qkv`` and
``attn.proj``), the baseline of the same size.
"""
from __future__ import annotations

import math

import torch
from timm.layers import Mlp, PatchEmbed
from timm.models import generate_default_cfgs
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capture import capturing
from ..layers.registry import sequence_attentions
from ._helpers import check_architecture, refuse_unknown_kwargs, register_variants

__all__ = ["ATTENTIONS", "PolaDiT", "sincos_pos_table", "timestep_frequencies"]

# the grid token mixers of polaformer.layers.registry.SEQUENCE_ATTENTIONS, by name ("pacs", "softmax")
ATTENTIONS = sequence_attentions("grid")


def sincos_pos_table(dim: int, grid: int) -> torch.Tensor:
    """Fixed (grid², dim) position table of the DiT, float64: per raster token ``(row, col)``, the first half
    of the channels encodes ``col``, the second ``row``, each as ``[sin(p·ω) ; cos(p·ω)]`` with
    ``ω_i = 10000^(−i/(dim/4))``."""
    if dim % 4:
        raise ValueError(f"the sin-cos position table needs a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")

    def encode(positions):
        angles = positions.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1)


def timestep_frequencies(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(B,) timesteps (may be fractional) -> (B, dim) ``[cos(t·f) ; sin(t·f)]``, ``f_i = max_period^(−i/(dim/2))``.

    Computed in float32 as the checkpoints were trained (an odd ``dim`` gets a zero last column)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    out = torch.cat([args.cos(), args.sin()], dim=-1)
    return nn.functional.pad(out, (0, dim % 2))


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_frequencies(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class embeddings; with ``dropout_prob`` > 0 a last row is the null class (label ``num_classes``) that
    training draws with that probability and unconditional sampling asks for."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, drop: bool) -> torch.Tensor:
        if drop and self.dropout_prob > 0:
            dropped = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(dropped, self.num_classes, labels)
        return self.embedding_table(labels)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """Pre-norm attention and MLP, each with adaLN-Zero: shift, scale and a residual gate from the condition."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, attention: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = ATTENTIONS[attention](dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class PolaDiT(nn.Module):
    """Class-conditional diffusion transformer.

    Args:
        input_size: side of the (square) input, pixels or latent cells.
        patch_size: side of a patch; must divide ``input_size``.
        in_channels: input channels (4 for a Stable Diffusion VAE's latents).
        hidden_size, depth, num_heads, mlp_ratio: sizes.
        class_dropout_prob: probability of the null class in training (classifier-free guidance); 0 builds
            no null class.
        num_classes: classes (the null class comes on top).
        learn_sigma: also output the variance interpolation ``v`` (2·in_channels outputs).
        attention: ``pacs`` (PolaDiT) or ``softmax`` (the original DiT).

    ``forward(x, t, y)``: images (B, in_channels, S, S), timesteps (B,), labels (B,) -> (B, out_channels, S, S).
    In training mode labels are replaced by the null class with probability ``class_dropout_prob``.
    """

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True, attention: str = "pacs", **kwargs):
        super().__init__()
        refuse_unknown_kwargs(kwargs, "PolaDiT")
        check_architecture(input_size=input_size, patch_size=patch_size, in_channels=in_channels,
                           hidden_size=hidden_size, depth=depth, num_heads=num_heads, num_classes=num_classes,
                           ratios={"mlp_ratio": mlp_ratio})
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r} (known: {', '.join(ATTENTIONS)})")
        if patch_size < 1 or input_size % patch_size:
            raise ValueError(f"patch_size {patch_size} must divide input_size {input_size}")
        if not 0 <= class_dropout_prob < 1:
            raise ValueError(f"class_dropout_prob must be in [0, 1), got {class_dropout_prob}")
        self.input_size, self.patch_size, self.in_channels = input_size, patch_size, in_channels
        self.learn_sigma, self.num_classes, self.attention = learn_sigma, num_classes, attention
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        grid = input_size // patch_size
        # fixed, but a parameter (frozen) as in the official model: checkpoints hold it under this name
        self.pos_embed = nn.Parameter(sincos_pos_table(hidden_size, grid).float().unsqueeze(0), requires_grad=False)
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, attention) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.grad_checkpointing = False
        self._init_weights()

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True):
        self.grad_checkpointing = enable

    @property
    def null_class(self) -> int | None:
        """The label of the unconditional embedding, or None when the model has none."""
        return self.num_classes if self.y_embedder.dropout_prob > 0 else None

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a linear layer over the patch
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every block starts as the identity, the output at zero
        for layer in [b.adaLN_modulation[-1] for b in self.blocks] + [self.final_layer.adaLN_modulation[-1],
                                                                      self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, p·p·C) patch predictions -> (B, C, S, S) images."""
        p, c, grid = self.patch_size, self.out_channels, self.input_size // self.patch_size
        x = x.reshape(x.shape[0], grid, grid, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, grid * p, grid * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        expected = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"PolaDiT expects images of shape (B, {', '.join(map(str, expected))}), "
                             f"got {tuple(x.shape)}")
        if t.shape != (x.shape[0],) or y.shape != (x.shape[0],):
            raise ValueError(f"timesteps and labels must be ({x.shape[0]},), got {tuple(t.shape)} and {tuple(y.shape)}")
        if not capturing() and y.device.type == "cpu" and len(y):  # a value check: no device sync on accelerators
            top = self.num_classes if self.null_class is not None else self.num_classes - 1
            if int(y.min()) < 0 or int(y.max()) > top:
                raise ValueError(f"labels must be in [0, {top}], got {int(y.min()) if y.min() < 0 else int(y.max())}")
            if float(t.min()) < 0:
                raise ValueError(f"timesteps must be >= 0, got {float(t.min()):g}")
        tokens = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, drop=self.training)
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, c, use_reentrant=False)
            else:
                tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c))


def _cfg(**kwargs):
    return {"num_classes": 1000, "input_size": (4, 32, 32), "first_conv": "x_embedder.proj",
            "classifier": "final_layer.linear", "license": "cc-by-nc-4.0", **kwargs}


SIZES = {"s": dict(hidden_size=384, depth=12, num_heads=6), "b": dict(hidden_size=768, depth=12, num_heads=12),
         "l": dict(hidden_size=1024, depth=24, num_heads=16), "xl": dict(hidden_size=1152, depth=28, num_heads=16)}
PATCHES = (2, 4, 8)

VARIANTS = {f"pola_dit_{size}_{p}": {**sizes, "patch_size": p} for size, sizes in SIZES.items() for p in PATCHES}

default_cfgs = generate_default_cfgs({name: _cfg() for name in VARIANTS})


def _create(variant: str, pretrained: bool = False, **kwargs) -> PolaDiT:
    if pretrained:
        raise ValueError(f"{variant} has no downloadable weights; load the authors' checkpoint with load_state_dict")
    return PolaDiT(**{**VARIANTS[variant], **kwargs})


register_variants(__name__, VARIANTS, _create)
