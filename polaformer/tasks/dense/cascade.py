"""Cascade Mask R-CNN (Cai and Vasconcelos) from torchvision's detection parts.

torchvision has no cascade head, so :class:`CascadeRoIHeads` chains three R-CNN stages on one
``MultiScaleRoIAlign``, each with its own box head, class-agnostic box predictor, mask head and box coder,
as mmdetection's ``cascade_mask_rcnn_r50_fpn`` config:

- training: stage t samples 512 RoIs per image (25% positive, ground-truth boxes added as proposals) with
  a ``Matcher`` at IoU 0.5 / 0.6 / 0.7, regresses towards its targets with the stage's deltas scaled by
  target stds (0.1, 0.1, 0.2, 0.2) / (0.05, 0.05, 0.1, 0.1) / (0.033, 0.033, 0.067, 0.067), trains its mask head
  on its positives, and passes its refined boxes (without the added ground truth) to the next stage; the
  stage losses are weighted 1 / 0.5 / 0.25;
- inference: the proposals are refined by stages 1 and 2, the class scores are the mean of the three
  stages' logits, the boxes are the last stage's, and each mask is the mean of the three mask heads'
  probabilities, as mmdetection's ``CascadeRoIHead.simple_test``.

The losses follow torchvision's Mask R-CNN (cross-entropy, smooth L1 with beta 1/9 summed over the
positives and divided by the sampled RoIs, per-pixel BCE on 28x28 masks). The RoI features are pooled as the
official config pools them (:class:`MultiLevelRoIAlign`: mmcv's ``RoIAlign(sampling_ratio=0)``, whose
``aligned`` is True, on mmdetection's ``SingleRoIExtractor`` levels), not with torchvision's default pooler
(2 samples per bin side, ``aligned=False``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler, BoxCoder, Matcher
from torchvision.models.detection.faster_rcnn import TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.roi_heads import RoIHeads, maskrcnn_loss
from torchvision.ops import MultiScaleRoIAlign, box_iou, clip_boxes_to_image, roi_align

__all__ = ["CascadeRoIHeads", "MultiLevelRoIAlign", "build_cascade_mask_rcnn", "IOU_THRESHOLDS", "STAGE_WEIGHTS",
           "TARGET_STDS"]

IOU_THRESHOLDS = (0.5, 0.6, 0.7)
STAGE_WEIGHTS = (1.0, 0.5, 0.25)
TARGET_STDS = ((0.1, 0.1, 0.2, 0.2), (0.05, 0.05, 0.1, 0.1), (0.033, 0.033, 0.067, 0.067))
BOX_HEAD_WIDTH = 1024  # torchvision's and mmdet's two shared fully connected layers
FINEST_SCALE = 56  # mmdet's SingleRoIExtractor: RoIs under 2 x 56 pixels on a side pool from the finest level


class MultiLevelRoIAlign(MultiScaleRoIAlign):
    """RoI features as mmdetection's ``SingleRoIExtractor`` with mmcv's ``RoIAlign(output_size, sampling_ratio=0)``
    (the official Cascade Mask R-CNN config): a box of side sqrt(area) = s pools from level
    floor(log2(s / 56 + 1e-6)) (clamped to the levels), with pixel centres at half-integers (``aligned``) and
    ceil(bin side) bilinear samples per bin side (sampling ratio 0), averaged. A drop-in for torchvision's
    ``MultiScaleRoIAlign`` (same arguments, levels' scales inferred the same way)."""

    def __init__(self, featmap_names: list[str], output_size: int, sampling_ratio: int = 0):
        super().__init__(featmap_names, output_size, sampling_ratio)

    def forward(self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor],
                image_shapes: list[tuple[int, int]]) -> torch.Tensor:
        features = [x[name] for name in self.featmap_names]
        top = max(shape[0] for shape in image_shapes)
        scales = [2.0 ** round(math.log2(f.shape[-2] / top)) for f in features]  # 1/4, 1/8, ... as torchvision's
        rois = torch.cat([torch.cat([torch.full_like(b[:, :1], i), b], dim=1) for i, b in enumerate(boxes)])
        side = ((rois[:, 3] - rois[:, 1]) * (rois[:, 4] - rois[:, 2])).sqrt()
        levels = torch.floor(torch.log2(side / FINEST_SCALE + 1e-6)).clamp(0, len(features) - 1).long()
        out = features[0].new_zeros(len(rois), features[0].shape[1], *self.output_size)
        for level, (feature, scale) in enumerate(zip(features, scales)):
            index = torch.where(levels == level)[0]
            out[index] = roi_align(feature, rois[index], self.output_size, scale, self.sampling_ratio,
                                   aligned=True).to(out.dtype)
        return out


class AgnosticBoxPredictor(nn.Module):
    """Class scores (background first) and one box delta per RoI, whatever its class."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.cls_score = nn.Linear(in_channels, num_classes)
        self.bbox_pred = nn.Linear(in_channels, 4)
        nn.init.normal_(self.cls_score.weight, std=0.01)  # mmdet's BBoxHead initialisation
        nn.init.normal_(self.bbox_pred.weight, std=0.001)
        nn.init.zeros_(self.cls_score.bias)
        nn.init.zeros_(self.bbox_pred.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.flatten(1)
        return self.cls_score(x), self.bbox_pred(x)


class CascadeRoIHeads(RoIHeads):
    """Three box + mask stages on shared RoI poolers; a drop-in ``roi_heads`` of torchvision's ``MaskRCNN``."""

    def __init__(self, box_roi_pool: nn.Module, mask_roi_pool: nn.Module, num_classes: int, channels: int, *,
                 iou_thresholds=IOU_THRESHOLDS, stage_weights=STAGE_WEIGHTS, target_stds=TARGET_STDS,
                 batch_size_per_image: int = 512, positive_fraction: float = 0.25, score_thresh: float = 0.05,
                 nms_thresh: float = 0.5, detections_per_img: int = 100):
        if not len(iou_thresholds) == len(stage_weights) == len(target_stds) >= 1:
            raise ValueError(f"a cascade needs one IoU threshold, loss weight and target std per stage, got "
                             f"{len(iou_thresholds)}, {len(stage_weights)} and {len(target_stds)}")
        weights = [tuple(1.0 / s for s in stds) for stds in target_stds]
        super().__init__(box_roi_pool, None, None, iou_thresholds[0], iou_thresholds[0], batch_size_per_image,
                         positive_fraction, weights[-1], score_thresh, nms_thresh, detections_per_img,
                         mask_roi_pool=mask_roi_pool)
        self.stage_weights = tuple(stage_weights)
        pooled = channels * box_roi_pool.output_size[0] * box_roi_pool.output_size[1]
        stages = range(len(iou_thresholds))
        self.box_heads = nn.ModuleList(TwoMLPHead(pooled, BOX_HEAD_WIDTH) for _ in stages)
        self.box_predictors = nn.ModuleList(AgnosticBoxPredictor(BOX_HEAD_WIDTH, num_classes) for _ in stages)
        self.mask_heads = nn.ModuleList(MaskRCNNHeads(channels, [channels] * 4, 1) for _ in stages)
        self.mask_predictors = nn.ModuleList(MaskRCNNPredictor(channels, channels, num_classes) for _ in stages)
        self.matchers = [Matcher(t, t, allow_low_quality_matches=False) for t in iou_thresholds]
        self.coders = [BoxCoder(w) for w in weights]
        self.fg_bg_sampler = BalancedPositiveNegativeSampler(batch_size_per_image, positive_fraction)

    def has_mask(self) -> bool:
        return True

    def _sample(self, stage: int, proposals, targets):
        """Per image: the sampled RoIs, their labels (0 = background), matched ground-truth index, box targets, and
        which of them are the added ground-truth boxes."""
        samples = []
        for boxes, target in zip(proposals, targets):
            gt_boxes, gt_labels = target["boxes"], target["labels"]
            boxes = torch.cat([boxes, gt_boxes])
            added_gt = torch.arange(len(boxes), device=boxes.device) >= len(boxes) - len(gt_boxes)
            if len(gt_boxes):
                match = self.matchers[stage](box_iou(gt_boxes, boxes))
                matched = match.clamp(min=0)
                labels = torch.where(match >= 0, gt_labels[matched], torch.zeros_like(gt_labels[matched]))
            else:
                matched = torch.zeros(len(boxes), dtype=torch.int64, device=boxes.device)
                labels = torch.zeros_like(matched)
            positive, negative = self.fg_bg_sampler([labels])
            keep = torch.where(positive[0] | negative[0])[0]
            boxes, labels, matched = boxes[keep], labels[keep], matched[keep]
            reference = gt_boxes[matched] if len(gt_boxes) else boxes
            samples.append(dict(boxes=boxes, labels=labels, matched=matched, added_gt=added_gt[keep],
                                box_targets=self.coders[stage].encode_single(reference, boxes)))
        return samples

    def _box_stage(self, stage: int, features, boxes, image_shapes):
        x = self.box_heads[stage](self.box_roi_pool(features, boxes, image_shapes))
        return self.box_predictors[stage](x)

    def _refine(self, stage: int, deltas: torch.Tensor, boxes, image_shapes):
        refined = self.coders[stage].decode_single(deltas, torch.cat(boxes))
        return [clip_boxes_to_image(b, shape) for b, shape in zip(refined.split([len(b) for b in boxes]), image_shapes)]

    def _mask_logits(self, stage: int, features, boxes, image_shapes) -> torch.Tensor:
        x = self.mask_heads[stage](self.mask_roi_pool(features, boxes, image_shapes))
        return self.mask_predictors[stage](x)

    def forward(self, features, proposals, image_shapes, targets=None):
        if self.training:
            return [], self._losses(features, proposals, image_shapes, targets)
        return self._detect(features, proposals, image_shapes), {}

    def _losses(self, features, proposals, image_shapes, targets):
        if targets is None:
            raise ValueError("targets should not be None when training")
        losses = {}
        for stage, weight in enumerate(self.stage_weights):
            samples = self._sample(stage, proposals, targets)
            boxes = [s["boxes"] for s in samples]
            logits, deltas = self._box_stage(stage, features, boxes, image_shapes)
            labels = torch.cat([s["labels"] for s in samples])
            box_targets = torch.cat([s["box_targets"] for s in samples])
            positive = labels > 0
            box_loss = F.smooth_l1_loss(deltas[positive], box_targets[positive], beta=1 / 9, reduction="sum")
            positives = [s["labels"] > 0 for s in samples]
            mask_logits = self._mask_logits(stage, features, [b[p] for b, p in zip(boxes, positives)], image_shapes)
            mask_loss = maskrcnn_loss(mask_logits, [b[p] for b, p in zip(boxes, positives)],
                                      [t["masks"] for t in targets], [t["labels"] for t in targets],
                                      [s["matched"][p] for s, p in zip(samples, positives)])
            losses[f"loss_classifier_s{stage}"] = weight * F.cross_entropy(logits, labels)
            losses[f"loss_box_reg_s{stage}"] = weight * box_loss / max(1, labels.numel())
            losses[f"loss_mask_s{stage}"] = weight * mask_loss
            if stage + 1 < len(self.stage_weights):
                refined = self._refine(stage, deltas.detach(), boxes, image_shapes)
                proposals = [b[~s["added_gt"]] for b, s in zip(refined, samples)]
        return losses

    def _detect(self, features, proposals, image_shapes):
        stages = len(self.stage_weights)
        mean_logits = 0
        for stage in range(stages):
            logits, deltas = self._box_stage(stage, features, proposals, image_shapes)
            mean_logits = mean_logits + logits / stages
            if stage + 1 < stages:
                proposals = self._refine(stage, deltas, proposals, image_shapes)
        # the last stage's coder (self.box_coder) decodes the same delta for every class
        boxes, scores, labels = self.postprocess_detections(mean_logits, deltas.repeat(1, logits.shape[1]),
                                                            proposals, image_shapes)
        probs = sum(self._mask_logits(stage, features, boxes, image_shapes).sigmoid() for stage in range(stages))
        probs = probs / stages
        label_probs = probs[torch.arange(len(probs), device=probs.device), torch.cat(labels)][:, None]
        masks = label_probs.split([len(b) for b in boxes])
        return [dict(boxes=box, scores=score, labels=label, masks=mask)
                for box, score, label, mask in zip(boxes, scores, labels, masks)]


def build_cascade_mask_rcnn(body: nn.Module, num_classes: int, *, anchor_generator=None, roi_batch: int = 512,
                            **detector_kwargs) -> MaskRCNN:
    """torchvision's ``MaskRCNN`` (transform, RPN) on ``body`` with :class:`CascadeRoIHeads` on the official
    poolers (:class:`MultiLevelRoIAlign`, 7x7 boxes and 14x14 masks); ``num_classes`` counts the background."""
    channels = body.out_channels
    model = MaskRCNN(body, num_classes, rpn_anchor_generator=anchor_generator, **detector_kwargs)
    old = model.roi_heads  # its test settings are kept, its poolers and single-stage heads replaced
    levels = old.box_roi_pool.featmap_names
    model.roi_heads = CascadeRoIHeads(MultiLevelRoIAlign(levels, 7), MultiLevelRoIAlign(levels, 14), num_classes,
                                      channels, batch_size_per_image=roi_batch, score_thresh=old.score_thresh,
                                      nms_thresh=old.nms_thresh, detections_per_img=old.detections_per_img)
    return model
