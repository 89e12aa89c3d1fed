"""Feature-pyramid backbones for dense prediction: a timm trunk (any Pola family, or a plain CNN) + FPN.

Hierarchical trunks (Pola-PVT, Pola-PVTv2, Pola-Swin, PolaFormer++, ResNet) give maps at strides
4, 8, 16 and 32 through timm's ``forward_intermediates`` (what ``features_only`` uses). A plain ViT
(Pola-DeiT) has one stride-16 map; :class:`SimplePyramid` turns its last block into strides 4-32
the way ViTDet does. torchvision's :class:`~torchvision.ops.FeaturePyramidNetwork` then gives
``out_channels`` maps, the input torchvision's detectors expect.

Weights are loaded into the bare trunk *before* it is wrapped, with
:func:`polaformer.finetune.load_for_finetune`, so position tables are resampled to the grid of
``img_size`` (the detection resolution) and the classifier is dropped.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import timm
import torch
import torch.nn.functional as F
from timm.models._features import FeatureGetterNet
from torch import nn
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelMaxPool, LastLevelP6P7

from ... import models as _register  # noqa: F401  (registers the Pola families with timm)
from ...engine.factory import ModelBuildError, create_model
from ...finetune import load_for_finetune

__all__ = ["BackboneError", "FeaturePyramidBackbone", "SimplePyramid", "build_backbone", "pyramid_indices"]

_logger = logging.getLogger(__name__)

PYRAMID_STRIDES = (4, 8, 16, 32)


class BackboneError(ModelBuildError):
    """A trunk that cannot feed a feature pyramid (one line)."""


def pyramid_indices(feature_info: list[dict]) -> tuple[tuple[int, ...], bool]:
    """Indices of the trunk's features to use, and whether a simple pyramid must make the strides.

    Takes, for every stride 4..32, the deepest feature at that stride; a trunk with a single
    stride (a plain ViT) gives its last feature and ``True``.
    """
    by_stride: dict[int, int] = {}
    for index, info in enumerate(feature_info):
        by_stride[info["reduction"]] = index
    if set(PYRAMID_STRIDES) <= set(by_stride):
        return tuple(by_stride[s] for s in PYRAMID_STRIDES), False
    if len(by_stride) == 1:
        return (len(feature_info) - 1,), True
    raise BackboneError(
        f"the trunk's features have strides {sorted(by_stride)}; a pyramid needs 4, 8, 16 and 32, or a single stride"
    )


class SimplePyramid(nn.Module):
    """ViTDet's simple feature pyramid: one stride-s map -> maps at s/4, s/2, s and 2s.

    Up-sampling by transposed convolutions, down-sampling by max pooling; the channel counts
    (C/4, C/2, C, C) are left to the FPN's lateral 1x1 convolutions.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.up4 = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), nn.GroupNorm(1, dim // 2), nn.GELU(),
            nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2),
        )
        self.up2 = nn.ConvTranspose2d(dim, dim // 2, 2, stride=2)
        self.down2 = nn.MaxPool2d(2)
        self.channels = [dim // 4, dim // 2, dim, dim]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.up4(x), self.up2(x), x, self.down2(x)]


class FeaturePyramidBackbone(nn.Module):
    """``images -> OrderedDict('0'..'3', 'pool' or 'p6'/'p7')``; pads the input to ``size_divisible``.

    torchvision's detectors already pad batches to 32; the padding here makes the backbone safe
    on its own too (any H x W), cropping nothing: the extra border is zeros, as torchvision's.
    """

    def __init__(self, trunk: nn.Module, in_channels: list[int], out_channels: int = 256,
                 extra_blocks: ExtraFPNBlock | None = None, pyramid: SimplePyramid | None = None,
                 size_divisible: int = 32, levels: tuple[int, ...] = (0, 1, 2, 3)):
        super().__init__()
        self.trunk = trunk
        self.levels = levels
        self.pyramid = pyramid
        self.fpn = FeaturePyramidNetwork(in_channels, out_channels, extra_blocks=extra_blocks)
        self.out_channels = out_channels
        self.size_divisible = size_divisible

    def forward(self, x: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        h, w = x.shape[-2:]
        d = self.size_divisible
        pad_h, pad_w = -h % d, -w % d
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        features = self.trunk(x)
        if self.pyramid is not None:
            features = self.pyramid(features[-1])
        return self.fpn(OrderedDict((str(i), features[i]) for i in self.levels))


def build_trunk(name: str, *, weights: str | None = None, model_kwargs: dict | None = None) -> nn.Module:
    """A bare timm model (no classifier) with ``weights`` loaded, position tables resampled; built by the engine's
    factory, so sizes are checked against memory first and arguments the model refuses are one line."""
    if not isinstance(name, str) or not timm.is_model(name):
        raise BackboneError(f"unknown backbone {name!r} (any timm model name, e.g. pola_pvt_tiny)")
    model = create_model(name, 0, **(model_kwargs or {}))
    if weights:
        result = load_for_finetune(model, weights)
        _logger.info("backbone %s: %s", name, result.describe())
    return model


def build_backbone(name: str, *, weights: str | None = None, model_kwargs: dict | None = None,
                   out_channels: int = 256, extra: str = "pool", first_stride: int = 4) -> FeaturePyramidBackbone:
    """An FPN backbone on the timm model ``name``.

    Args:
        weights: an ImageNet checkpoint (ours or the authors') for the trunk.
        model_kwargs: for ``timm.create_model``, e.g. ``img_size=(800, 1344)`` so that the position
            tables are resampled to the detection grid once, at load time.
        extra: ``'pool'`` (a stride-64 max-pooled level, Faster/Mask R-CNN) or ``'p6p7'``
            (two strided convolutions on P5, RetinaNet and FCOS).
        first_stride: the finest level fed to the FPN: 4, or 8 for RetinaNet/FCOS (P3-P7).
    """
    model = build_trunk(name, weights=weights, model_kwargs=model_kwargs)
    info = getattr(model, "feature_info", None)
    if not info or not hasattr(model, "forward_intermediates"):
        raise BackboneError(f"backbone {name!r} has no forward_intermediates/feature_info for a feature pyramid")
    indices, simple = pyramid_indices(info)
    trunk = FeatureGetterNet(model, out_indices=indices)
    if simple:
        pyramid = SimplePyramid(info[indices[0]]["num_chs"])
        in_channels = pyramid.channels
    else:
        pyramid = None
        in_channels = [info[i]["num_chs"] for i in indices]
    if first_stride not in PYRAMID_STRIDES:
        raise BackboneError(f"first_stride must be one of {PYRAMID_STRIDES}, got {first_stride}")
    levels = tuple(i for i, s in enumerate(PYRAMID_STRIDES) if s >= first_stride)
    in_channels = [in_channels[i] for i in levels]
    if extra == "pool":
        extra_block = LastLevelMaxPool()
    elif extra == "p6p7":
        extra_block = LastLevelP6P7(out_channels, out_channels)
    else:
        raise BackboneError(f"extra FPN levels must be 'pool' or 'p6p7', got {extra!r}")
    return FeaturePyramidBackbone(trunk, in_channels, out_channels, extra_block, pyramid, levels=levels)
