"""Detection and instance segmentation: torchvision's detectors on a feature-pyramid backbone.

``retinanet``, ``fcos``, ``fasterrcnn`` and ``maskrcnn`` (boxes + masks) from
:mod:`torchvision.models.detection`, and ``cascade_mask_rcnn`` built from its parts (:mod:`.cascade`).
Scores are the official COCO metrics from pycocotools.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import torch
from torch import nn
from torchvision.models.detection import FCOS, FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

from ...engine.distributed import DistContext, all_gather_object
from ...engine.optim import unwrap
from .backbone import BackboneError, build_backbone
from .cascade import build_cascade_mask_rcnn

__all__ = ["DETECTORS", "build_detector", "evaluate_detector", "detection_loss", "draw_predictions"]


DETECTORS = ("retinanet", "fcos", "fasterrcnn", "maskrcnn", "cascade_mask_rcnn")


def build_detector(detector: str, backbone: str, num_classes: int, *, backbone_weights: str | None = None,
                   backbone_kwargs: dict | None = None, min_size: int = 800, max_size: int = 1333,
                   anchor_sizes: list[int] | None = None, detections_per_img: int = 100,
                   fpn_channels: int = 256, roi_batch: int = 512) -> nn.Module:
    """A torchvision detector for ``num_classes`` foreground classes on ``backbone`` (a timm name).

    ``min_size``/``max_size``: torchvision's resize of the shorter/longer side (800/1333 for COCO).
    ``anchor_sizes``: one base size per pyramid level (5 levels), smallest first; the default is
    torchvision's (32..512 for the R-CNNs and RetinaNet's 3 scales per octave on top).
    ``fpn_channels`` (256) and ``roi_batch`` (RoIs sampled per image for the R-CNN heads, 512) are
    torchvision's defaults; the embedded CPU recipe lowers both (and the mask head's width with the FPN's).
    """
    if detector not in DETECTORS:
        raise BackboneError(f"unknown detector {detector!r}; choose one of {', '.join(DETECTORS)}")
    one_stage = detector in ("retinanet", "fcos")
    body = build_backbone(backbone, weights=backbone_weights, model_kwargs=backbone_kwargs,
                          extra="p6p7" if one_stage else "pool", first_stride=8 if one_stage else 4,
                          out_channels=fpn_channels)
    common = dict(min_size=min_size, max_size=max_size, detections_per_img=detections_per_img)
    if anchor_sizes is not None and len(anchor_sizes) != 5:
        raise BackboneError(f"anchor_sizes needs one size per pyramid level (5), got {anchor_sizes}")
    if detector == "fcos":
        if fpn_channels % 32:
            raise BackboneError(
                f"FCOS's head uses GroupNorm(32): fpn_channels must be a multiple of 32, got {fpn_channels}")
        return FCOS(body, num_classes + 1, **common)
    if detector == "retinanet":
        anchors = None
        if anchor_sizes is not None:
            sizes = tuple((s, int(s * 2 ** (1 / 3)), int(s * 2 ** (2 / 3))) for s in anchor_sizes)
            anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * 5)
        return RetinaNet(body, num_classes + 1, anchor_generator=anchors, **common)
    anchors = AnchorGenerator(tuple((s,) for s in anchor_sizes), ((0.5, 1.0, 2.0),) * 5) if anchor_sizes else None
    if detector == "fasterrcnn":
        return FasterRCNN(body, num_classes + 1, rpn_anchor_generator=anchors, box_batch_size_per_image=roi_batch,
                          **common)
    if detector == "cascade_mask_rcnn":
        return build_cascade_mask_rcnn(body, num_classes + 1, anchor_generator=anchors, roi_batch=roi_batch, **common)
    heads = {"num_classes": num_classes + 1}
    if fpn_channels != 256:  # torchvision's mask head is 4 convs of 256 whatever the FPN; narrow it with the FPN
        heads = dict(mask_head=MaskRCNNHeads(fpn_channels, [fpn_channels] * 4, 1),
                     mask_predictor=MaskRCNNPredictor(fpn_channels, fpn_channels, num_classes + 1),
                     box_predictor=FastRCNNPredictor(1024, num_classes + 1))  # 1024: torchvision's box head width
    return MaskRCNN(body, rpn_anchor_generator=anchors, box_batch_size_per_image=roi_batch, **heads, **common)


def detection_loss(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    images, targets = batch
    device = next(model.parameters()).device
    # Under torchrun the engine passes its DistributedDataParallel wrapper, which has no roi_heads of its own.
    detector = unwrap(model)
    has_masks = hasattr(detector, "roi_heads") and detector.roi_heads.has_mask()
    keep = ("boxes", "labels", "masks") if has_masks else ("boxes", "labels")
    targets = [{k: t[k].to(device, non_blocking=True) for k in keep} for t in targets]
    return model([im.to(device, non_blocking=True) for im in images], targets)


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())  # pycocotools prints its progress


@torch.no_grad()
def predict(model: nn.Module, loader) -> list[tuple[int, dict]]:
    model.eval()
    device = next(model.parameters()).device
    out = []
    for images, targets in loader:
        for target, pred in zip(targets, model([im.to(device) for im in images])):
            out.append((int(target["image_id"]), {k: v.cpu() for k, v in pred.items()}))
    return out


def coco_results(predictions, category_ids: list[int], mask_threshold: float = 0.5) -> tuple[list, list]:
    """Predictions as COCO result lists (boxes; masks as RLE when the model predicts masks)."""
    from pycocotools import mask as mask_utils

    boxes, segms = [], []
    for image_id, pred in predictions:
        columns = zip(pred["boxes"].tolist(), pred["scores"].tolist(), pred["labels"].tolist())
        for i, (box, score, label) in enumerate(columns):
            entry = {"image_id": image_id, "category_id": category_ids[label - 1], "score": score,
                     "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]}
            boxes.append(entry)
            if "masks" in pred:
                binary = (pred["masks"][i, 0] > mask_threshold).numpy().astype(np.uint8)
                rle = mask_utils.encode(np.asfortranarray(binary))
                rle["counts"] = rle["counts"].decode("ascii")
                segms.append({**entry, "segmentation": rle})
    return boxes, segms


def coco_metrics(coco_gt, results: list, iou_type: str, image_ids: list[int]) -> dict[str, float]:
    from pycocotools.cocoeval import COCOeval

    names = ("AP", "AP50", "AP75", "APs", "APm", "APl")
    prefix = "bbox_" if iou_type == "bbox" else "segm_"
    if not results:
        return {prefix + n: 0.0 for n in names}
    with _quiet():
        coco_dt = coco_gt.loadRes(results)
        evaluator = COCOeval(coco_gt, coco_dt, iou_type)
        evaluator.params.imgIds = image_ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    # pycocotools' -1 means "no ground truth of that kind" (e.g. no medium or large objects): left out,
    # except AP itself, which the training loop ranks checkpoints by.
    return {prefix + n: max(0.0, float(v)) for n, v in zip(names, evaluator.stats[:6]) if v >= 0 or n == "AP"}


def evaluate_detector(model: nn.Module, loader, coco_gt, category_ids: list[int],
                      ctx: DistContext = DistContext()) -> dict[str, float]:
    """COCO box mAP (and mask mAP for Mask R-CNN) on ``loader``'s images, pycocotools' numbers. Under torchrun
    (``ctx``) each process predicts the images of its loader (every K-th, :class:`ShardSampler`) and the results
    of all are scored together, in the order one process gives them."""
    per_image = [(image_id, *coco_results([(image_id, pred)], category_ids))
                 for image_id, pred in predict(model, loader)]
    parts = all_gather_object(per_image, ctx)
    merged = [part[j] for j in range(max(map(len, parts))) for part in parts if j < len(part)]
    boxes = [entry for _, found, _ in merged for entry in found]
    segms = [entry for _, _, found in merged for entry in found]
    image_ids = [image_id for image_id, _, _ in merged]
    metrics = coco_metrics(coco_gt, boxes, "bbox", image_ids)
    if hasattr(model, "roi_heads") and model.roi_heads.has_mask():
        metrics.update(coco_metrics(coco_gt, segms, "segm", image_ids))
    return metrics


def draw_predictions(image: torch.Tensor, pred: dict, classes, *, score_threshold: float = 0.5) -> torch.Tensor:
    """``image`` (3, H, W) in [0, 1] with the predicted masks and labelled boxes drawn, as uint8."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    keep = pred["scores"] >= score_threshold
    canvas = (image.clamp(0, 1) * 255).to(torch.uint8)
    if "masks" in pred and keep.any():
        canvas = draw_segmentation_masks(canvas, pred["masks"][keep, 0] > 0.5, alpha=0.45)
    labels = [f"{classes[int(c) - 1]} {s:.2f}" for c, s in zip(pred["labels"][keep], pred["scores"][keep])]
    return draw_bounding_boxes(canvas, pred["boxes"][keep], labels=labels, colors="yellow", width=1)
