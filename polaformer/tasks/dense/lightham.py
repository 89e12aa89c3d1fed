"""SegNeXt's LightHamHead (the PolaFormer++ segmentation decoder): a Hamburger with NMF2D matrix decomposition.

Stages 2-4 of the encoder (strides 8, 16, 32) are resized to stride 8 and concatenated, squeezed by a
1x1 conv + GroupNorm(32) + ReLU, passed through the Hamburger (1x1 conv + ReLU, non-negative matrix
factorisation of the channel x pixel matrix by multiplicative updates, 1x1 conv + GroupNorm, residual ReLU),
aligned by another 1x1 conv + GN + ReLU, dropped out and classified. Parameter names are mmseg's
(``squeeze.conv.weight``, ``hamburger.ham_out.gn.bias``, ``conv_seg.weight``, ...) so the authors' decode
heads load strictly.

The factorisation starts from random non-negative bases on every forward. Here they are drawn on the
input's device (the official code hard-codes ``.cuda()``); in training from the global generator (so
``torch.manual_seed`` reproduces a run), in eval from a generator seeded with ``eval_seed`` on each
forward, so evaluation is deterministic. ``bases=`` passes them explicitly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LightHamHead", "NMF2D", "LightHamSegmentationNet"]

GROUPS = 32  # GroupNorm groups of the official ham_norm_cfg


class ConvModule(nn.Module):
    """A 1x1 conv, optional GroupNorm and ReLU, with mmcv's ConvModule parameter names (``conv``, ``gn``) and its
    initialisation (``kaiming_init``: normal, fan_out, for ReLU, bias 0; the norm's weight 1 and bias 0)."""

    def __init__(self, in_channels: int, out_channels: int, *, norm: bool, relu: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=not norm)  # mmcv's bias='auto'
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_out", nonlinearity="relu")
        if self.conv.bias is not None:
            nn.init.zeros_(self.conv.bias)
        if norm:
            self.gn = nn.GroupNorm(GROUPS, out_channels)  # starts at weight 1, bias 0, as mmcv's constant_init
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if hasattr(self, "gn"):
            x = self.gn(x)
        return F.relu(x) if self.relu else x


class NMF2D(nn.Module):
    """Rank-``rank`` NMF of each (channels x pixels) map by multiplicative updates; returns the reconstruction."""

    def __init__(self, rank: int = 16, train_steps: int = 6, eval_steps: int = 7, eval_seed: int = 0):
        super().__init__()
        self.rank, self.train_steps, self.eval_steps, self.eval_seed = rank, train_steps, eval_steps, eval_seed

    def random_bases(self, batch: int, channels: int, like: torch.Tensor) -> torch.Tensor:
        generator = None
        if not self.training:
            generator = torch.Generator(device=like.device).manual_seed(self.eval_seed)
        bases = torch.rand(batch, channels, self.rank, generator=generator, device=like.device, dtype=like.dtype)
        return F.normalize(bases, dim=1)

    @staticmethod
    def _update_coef(x, bases, coef):
        return coef * torch.bmm(x.transpose(1, 2), bases) / (coef.bmm(bases.transpose(1, 2).bmm(bases)) + 1e-6)

    def forward(self, x: torch.Tensor, bases: torch.Tensor | None = None) -> torch.Tensor:
        b, c, h, w = x.shape
        x = x.reshape(b, c, h * w)
        if bases is None:
            bases = self.random_bases(b, c, x)
        elif bases.shape != (b, c, self.rank):
            raise ValueError(f"NMF2D bases must have shape {(b, c, self.rank)}, got {tuple(bases.shape)}")
        coef = torch.softmax(torch.bmm(x.transpose(1, 2), bases), dim=-1)
        for _ in range(self.train_steps if self.training else self.eval_steps):
            coef = self._update_coef(x, bases, coef)
            bases = bases * torch.bmm(x, coef) / (bases.bmm(coef.transpose(1, 2).bmm(coef)) + 1e-6)
        coef = self._update_coef(x, bases, coef)
        return torch.bmm(bases, coef.transpose(1, 2)).reshape(b, c, h, w)


class Hamburger(nn.Module):
    def __init__(self, channels: int, rank: int, eval_seed: int):
        super().__init__()
        self.ham_in = ConvModule(channels, channels, norm=False, relu=True)
        self.ham = NMF2D(rank, eval_seed=eval_seed)
        self.ham_out = ConvModule(channels, channels, norm=True, relu=False)

    def forward(self, x: torch.Tensor, bases: torch.Tensor | None = None) -> torch.Tensor:
        return F.relu(x + self.ham_out(self.ham(self.ham_in(x), bases)))


class LightHamHead(nn.Module):
    """mmseg's ``LightHamHead(in_channels, channels, ham_channels, ham_kwargs=dict(MD_R=rank), norm_cfg=GN(32),
    dropout_ratio, num_classes)`` on the last ``len(in_channels)`` encoder maps; logits at the first one's stride."""

    def __init__(self, in_channels: list[int], num_classes: int, *, channels: int = 512, ham_channels: int = 512,
                 rank: int = 16, dropout: float = 0.1, eval_seed: int = 0):
        super().__init__()
        for name, value in (("channels", channels), ("ham_channels", ham_channels)):
            if value <= 0 or value % GROUPS:
                raise ValueError(
                    f"LightHamHead {name} must be a positive multiple of {GROUPS} (GroupNorm), got {value}")
        self.in_channels = list(in_channels)
        self.squeeze = ConvModule(sum(in_channels), ham_channels, norm=True, relu=True)
        self.hamburger = Hamburger(ham_channels, rank, eval_seed)
        self.align = ConvModule(ham_channels, channels, norm=True, relu=True)
        self.dropout = nn.Dropout2d(dropout) if dropout > 0 else nn.Identity()
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        nn.init.normal_(self.conv_seg.weight, std=0.01)  # mmseg's init of the classifier
        nn.init.zeros_(self.conv_seg.bias)

    def forward(self, features: list[torch.Tensor], bases: torch.Tensor | None = None) -> torch.Tensor:
        features = features[-len(self.in_channels):]
        size = features[0].shape[-2:]
        x = torch.cat([F.interpolate(f, size=size, mode="bilinear", align_corners=False) for f in features], dim=1)
        x = self.hamburger(self.squeeze(x), bases)
        return self.conv_seg(self.dropout(self.align(x)))


class LightHamSegmentationNet(nn.Module):
    """An smp encoder and a LightHamHead on its strides 8/16/32; logits resized to the input, as mmseg does."""

    def __init__(self, encoder: nn.Module, num_classes: int, channels: int = 512, **head_kwargs):
        super().__init__()
        self.encoder = encoder
        self.decode_head = LightHamHead(list(encoder.out_channels[-3:]), num_classes, channels=channels,
                                        ham_channels=channels, **head_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.decode_head(self.encoder(x)[-3:])
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
