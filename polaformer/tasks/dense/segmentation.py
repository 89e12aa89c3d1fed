"""Semantic segmentation: segmentation_models_pytorch decoders (FPN = Semantic FPN, UPerNet) and SegNeXt's
LightHamHead (:mod:`.lightham`, the PolaFormer++ decoder) on Pola encoders.

The encoders go through smp's timm universal encoder (``tu-<timm name>``), which calls our
registered models' ``features_only``; that works for every hierarchical family (Pola-PVT,
Pola-PVTv2, Pola-Swin, PolaFormer++) and for CNNs such as ``resnet18``. A plain ViT (Pola-DeiT) has
no pyramid for these decoders and is refused with one line. ImageNet weights are loaded into the
encoder's trunk with position tables resampled, as for detection.

Evaluation can follow mmseg's ADE20K test pipeline (:func:`mmseg_test_size`): each image rescaled within a
``(long, short)`` scale keeping its ratio, then to a multiple of 32, and the logits resized back to the image.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...engine.distributed import DistContext, all_reduce_sum
from .backbone import BackboneError, build_trunk, pyramid_indices
from .data import IGNORE_INDEX
from .lightham import LightHamSegmentationNet

__all__ = ["DECODERS", "Segmenter", "build_segmenter", "segmentation_loss", "evaluate_segmenter", "ConfusionMatrix",
           "mmseg_test_size"]


DECODERS = ("fpn", "upernet", "lightham")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TEST_SIZE_DIVISOR = 32  # the PolaFormer++ fork's test pipeline: ResizeToMultiple(size_divisor=32)


class Segmenter(nn.Module):
    """Normalises [0, 1] images, pads them to the stride, runs the smp model, crops the logits back."""

    def __init__(self, net: nn.Module, size_divisible: int = 32):
        super().__init__()
        self.net = net
        self.size_divisible = size_divisible
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h, w = images.shape[-2:]
        d = self.size_divisible
        x = F.pad((images - self.mean) / self.std, (0, -w % d, 0, -h % d))
        return self.net(x)[..., :h, :w]


def build_segmenter(decoder: str, backbone: str, num_classes: int, *, backbone_weights: str | None = None,
                    backbone_kwargs: dict | None = None, decoder_channels: int = 256,
                    decoder_dropout: float = 0.2) -> Segmenter:
    import segmentation_models_pytorch as smp

    if decoder not in DECODERS:
        raise BackboneError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    probe = build_trunk(backbone, model_kwargs=backbone_kwargs)  # validates the name; tells a ViT apart
    _, simple = pyramid_indices(probe.feature_info)
    if simple:
        raise BackboneError(
            f"{backbone!r} is a plain ViT with a single stride; the smp decoders need a pyramid "
            "(use a hierarchical family, or 'polaformer detect' whose backbone adds a simple pyramid)"
        )
    kwargs = dict(encoder_name=f"tu-{backbone}", encoder_weights=None, classes=num_classes, **(backbone_kwargs or {}))
    if decoder == "lightham":
        encoder = smp.encoders.get_encoder(f"tu-{backbone}", in_channels=3, depth=5, weights=None,
                                           **(backbone_kwargs or {}))
        net = LightHamSegmentationNet(encoder, num_classes, channels=decoder_channels)
    elif decoder == "fpn":
        net = smp.FPN(decoder_pyramid_channels=decoder_channels, decoder_segmentation_channels=decoder_channels // 2,
                      decoder_dropout=decoder_dropout, **kwargs)
    else:
        net = smp.UPerNet(decoder_channels=decoder_channels, **kwargs)
    if backbone_weights:
        trunk = build_trunk(backbone, weights=backbone_weights, model_kwargs=backbone_kwargs)
        features = net.encoder.model
        target = getattr(features, "model", features)  # timm's getter wraps the model; the list net is it
        missing, _ = target.load_state_dict(trunk.state_dict(), strict=False)
        if missing:
            raise BackboneError(f"{backbone_weights}: the encoder lacks {len(missing)} weights (e.g. {missing[0]})")
    return Segmenter(net)


def segmentation_loss(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    images, targets = batch
    device = next(model.parameters()).device
    images = torch.stack(images).to(device, non_blocking=True)
    labels = torch.stack([t["semantic"] for t in targets]).to(device, non_blocking=True)
    return {"loss_ce": F.cross_entropy(model(images), labels, ignore_index=IGNORE_INDEX)}


class ConfusionMatrix:
    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        valid = label != IGNORE_INDEX
        index = label[valid] * self.num_classes + pred[valid]
        self.matrix += torch.bincount(index, minlength=self.num_classes ** 2).view(self.num_classes, self.num_classes)

    def metrics(self) -> dict[str, float]:
        """mIoU over the classes present in the labels or predictions (mmseg's nan-mean), pixel accuracy."""
        m = self.matrix.double()
        tp = m.diag()
        union = m.sum(0) + m.sum(1) - tp
        iou = tp / union
        return {
            "mIoU": float(np.nanmean(iou.numpy())) if (union > 0).any() else 0.0,
            "aAcc": float(tp.sum() / m.sum().clamp(min=1)),
        }


def _rescaled_size(height: int, width: int, scale) -> tuple[int, int]:
    """mmcv's ``imrescale`` size: the largest within ``scale`` = (long, short) edges keeping the ratio, sides
    rounded half up."""
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def mmseg_test_size(height: int, width: int, scale=(2048, 512), divisor: int = TEST_SIZE_DIVISOR) -> tuple[int, int]:
    """``(height, width)`` an image is scored at by the official test pipeline: mmcv's ``imrescale`` within
    ``scale``, then ``imresize_to_multiple`` (each side rounded up to ``divisor``)."""
    return tuple(math.ceil(side / divisor) * divisor for side in _rescaled_size(height, width, scale))


def _resize_8bit(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of a [0, 1] image kept on the 256 levels of the 8-bit image mmcv resizes."""
    out = F.interpolate(image[None] * 255, size=size, mode="bilinear", align_corners=False)[0]
    return out.round().clamp(0, 255) / 255


@torch.no_grad()
def evaluate_segmenter(model: nn.Module, loader, num_classes: int, test_scale=(),
                       ctx: DistContext = DistContext()) -> dict[str, float]:
    """mIoU and pixel accuracy; with ``test_scale`` (long, short) each image is rescaled as mmseg's test pipeline
    (:func:`mmseg_test_size`, in two bilinear steps as there) and its logits resized back before the argmax. Under
    torchrun (``ctx``) the confusion matrices of the processes' loaders are added."""
    model.eval()
    device = next(model.parameters()).device
    confusion = ConfusionMatrix(num_classes)
    for images, targets in loader:
        for image, target in zip(images, targets):  # one at a time: validation images differ in size
            size = image.shape[-2:]
            if test_scale:
                image = _resize_8bit(_resize_8bit(image, _rescaled_size(*size, test_scale)),
                                     mmseg_test_size(*size, scale=test_scale))
            logits = model(image[None].to(device))
            if logits.shape[-2:] != size:
                logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
            confusion.update(logits.argmax(1)[0].cpu(), target["semantic"])
    if ctx.is_distributed:  # pixel counts: exact in float64
        summed = all_reduce_sum(confusion.matrix.flatten().tolist(), ctx, device)
        confusion.matrix = torch.tensor(summed, dtype=torch.float64).to(torch.int64).view_as(confusion.matrix)
    return confusion.metrics()
