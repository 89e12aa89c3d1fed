"""Cascade Mask R-CNN: three weighted stages that train and refine, the official RoI pooling (mmcv's RoIAlign with
sampling ratio 0 and aligned pixel centres on mmdetection's levels), and ``detect train --detector cascade_mask_rcnn``
on the embedded scenes and on a COCO-format folder.

Tolerances (tests/README.md, tests/tolerances.py): the RoI pooling against the official rule in float64 at 1e-10, far
above reorder_rtol(n, float64) for bilinear samples of 4 terms.

The eval command's segm_AP against the training's, as in test_dense_cli.py: the same weights, argmax decisions equal
unless two scores lie within float32 rounding of each other."""
import json
import math

import pytest
import torch
import torchvision

from dense_helpers import SMALL, kwarg_flags, write_coco
from polaformer.cli import main
from polaformer.tasks.dense.cascade import STAGE_WEIGHTS, CascadeRoIHeads, MultiLevelRoIAlign
from polaformer.tasks.dense.config import load_recipe
from polaformer.tasks.dense.detection import build_detector


def _targets():
    targets = [{"boxes": torch.tensor([[4.0, 4, 30, 30], [34, 10, 60, 40]]), "labels": torch.tensor([2, 1]),
                "masks": torch.zeros(2, 64, 64, dtype=torch.uint8)},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                "masks": torch.zeros(0, 50, 60, dtype=torch.uint8)}]  # an image without objects
    for i, (x0, y0, x1, y1) in enumerate(targets[0]["boxes"].int().tolist()):
        targets[0]["masks"][i, y0:y1, x0:x1] = 1
    return targets


def test_three_stages_train_refine_and_predict():
    torch.manual_seed(0)
    model = build_detector("cascade_mask_rcnn", "pola_pvt_v2_b0", 3, backbone_kwargs=SMALL["pola_pvt_v2_b0"],
                           min_size=64, max_size=64, anchor_sizes=[8, 16, 32, 64, 128], fpn_channels=32, roi_batch=16)
    heads = model.roi_heads
    assert isinstance(heads, CascadeRoIHeads) and len(heads.box_heads) == len(heads.mask_heads) == 3
    assert [m.high_threshold for m in heads.matchers] == [0.5, 0.6, 0.7]
    images = [torch.rand(3, 64, 64), torch.rand(3, 50, 60)]
    assert heads.stage_weights == STAGE_WEIGHTS == (1.0, 0.5, 0.25)
    heads.stage_weights = (1.0, 0.5, 0.0)  # the last stage's losses and gradients vanish, the others' do not
    losses = model(images, _targets())
    stage_keys = {f"loss_{kind}_s{s}" for kind in ("classifier", "box_reg", "mask") for s in range(3)}
    assert stage_keys <= set(losses) and all(torch.isfinite(v) for v in losses.values())
    assert all(float(losses[f"loss_{k}_s2"]) == 0 for k in ("classifier", "box_reg", "mask"))
    assert all(float(losses[f"loss_{k}_s{s}"]) > 0 for k in ("classifier", "mask") for s in (0, 1))
    sum(losses.values()).backward()
    for stage, learns in ((0, True), (1, True), (2, False)):
        assert (heads.box_predictors[stage].cls_score.weight.grad.abs().sum() > 0) == learns
        assert (heads.mask_predictors[stage].mask_fcn_logits.weight.grad.abs().sum() > 0) == learns
    heads.stage_weights = STAGE_WEIGHTS

    model.eval()
    with torch.no_grad():
        predictions = model(images)
    for pred, image in zip(predictions, images):
        h, w = image.shape[-2:]
        assert pred["masks"].shape[1:] == (1, h, w) and 0 <= pred["masks"].min() and pred["masks"].max() <= 1
        assert (pred["boxes"][:, 2] <= w).all() and (pred["boxes"][:, 3] <= h).all()
        assert len(pred["boxes"]) == len(pred["scores"]) == len(pred["labels"]) and (pred["labels"] >= 1).all()


def _mmcv_roi_align(feature: torch.Tensor, box, size: int, scale: float, sampling_ratio: int) -> torch.Tensor:
    """mmcv's RoIAlign (``aligned=True``, average pooling) written out from its CPU kernel for one box
    (x1, y1, x2, y2) on a (C, H, W) map: coordinates scaled and shifted by half a pixel, ``sampling_ratio`` (or,
    at 0, ceil(bin side)) bilinear samples per bin side, a sample more than a pixel outside the map counts 0, one
    within a pixel is clamped to the edge."""
    channels, height, width = feature.shape
    x1, y1, x2, y2 = (float(v) * scale - 0.5 for v in box)
    bin_h, bin_w = (y2 - y1) / size, (x2 - x1) / size
    grid_h = sampling_ratio or math.ceil((y2 - y1) / size)
    grid_w = sampling_ratio or math.ceil((x2 - x1) / size)
    out = torch.zeros(channels, size, size, dtype=feature.dtype)
    for ph in range(size):
        for pw in range(size):
            total = torch.zeros(channels, dtype=feature.dtype)
            for iy in range(grid_h):
                y = y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
                for ix in range(grid_w):
                    x = x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
                    if y < -1 or y > height or x < -1 or x > width:
                        continue
                    y, x = max(y, 0.0), max(x, 0.0)
                    y0, x0 = min(int(y), height - 1), min(int(x), width - 1)
                    y1_, x1_ = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
                    ly, lx = (y - y0 if y0 < height - 1 else 0.0), (x - x0 if x0 < width - 1 else 0.0)
                    total += ((1 - ly) * (1 - lx) * feature[:, y0, x0] + (1 - ly) * lx * feature[:, y0, x1_]
                              + ly * (1 - lx) * feature[:, y1_, x0] + ly * lx * feature[:, y1_, x1_])
            out[:, ph, pw] = total / max(grid_h * grid_w, 1)
    return out


@pytest.mark.numerics
def test_rois_are_pooled_as_the_official_config():
    """mmcv's RoIAlign(sampling_ratio=0, aligned=True) on mmdetection's SingleRoIExtractor levels (a box of side
    s on level floor(log2(s / 56)), strides 4-32), not torchvision's default pooler (2 samples, not aligned)."""
    # the written-out kernel on a case worked by hand: with aligned centres the 2x2 bins of the box (0, 0, 1, 1)
    # on [[1, 2], [3, 4]] sample at -0.375 / -0.125 (clamped to 0) and 0.125 / 0.375
    two = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=torch.float64)
    assert _mmcv_roi_align(two, (0, 0, 1, 1), 2, 1.0, 2).flatten().tolist() == [1.0, 1.25, 1.5, 1.75]

    torch.manual_seed(0)
    strides = (4, 8, 16, 32)
    features = {str(i): torch.randn(2, 3, 512 // s, 480 // s, dtype=torch.float64) for i, s in enumerate(strides)}
    boxes = [torch.tensor([[10.0, 20, 40, 45], [100, 30, 220, 160], [5, 5, 300, 260]], dtype=torch.float64),
             torch.tensor([[0.0, 0, 479, 511], [60.5, 70.25, 61.5, 71.0]], dtype=torch.float64)]
    pooler = MultiLevelRoIAlign(list(features), 7)
    out = pooler(features, boxes, [(512, 480), (500, 470)])
    expected, levels = [], []
    for image, image_boxes in enumerate(boxes):
        for box in image_boxes:
            side = math.sqrt((box[2] - box[0]) * (box[3] - box[1]))
            level = min(max(math.floor(math.log2(side / 56 + 1e-6)), 0), 3)
            levels.append(level)
            expected.append(_mmcv_roi_align(features[str(level)][image], box, 7, 1 / strides[level], 0))
    assert sorted(set(levels)) == [0, 1, 2, 3]
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-10, atol=1e-12)
    default = torchvision.ops.MultiScaleRoIAlign(list(features), 7, 2)(features, boxes, [(512, 480), (500, 470)])
    assert (default - out).abs().max() > 1e-2  # the pooler the cascade had before

    model = build_detector("cascade_mask_rcnn", "pola_pvt_v2_b0", 3, backbone_kwargs=SMALL["pola_pvt_v2_b0"],
                           min_size=64, max_size=64, fpn_channels=32, roi_batch=16)
    for pool, size in ((model.roi_heads.box_roi_pool, 7), (model.roi_heads.mask_roi_pool, 14)):
        assert isinstance(pool, MultiLevelRoIAlign) and pool.sampling_ratio == 0 and pool.output_size == (size, size)


def test_cascade_on_digits_and_a_coco_folder(tmp_path, capsys):
    tiny = ["--detector", "cascade_mask_rcnn", "--backbone", "pola_pvt_v2_b0", *kwarg_flags("pola_pvt_v2_b0"),
            "--opts", "model.fpn_channels", "32", "model.roi_batch", "16", "model.min_size", "64",
            "model.max_size", "64", "--steps", "1", "--batch-size", "2", "--no-progress", "--device", "cpu"]
    out_dir = tmp_path / "digits"
    code = main(["detect", "train", *tiny, "--train-size", "2", "--val-size", "1", "--output", str(out_dir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    metrics = json.loads(out.strip().splitlines()[-1])
    assert 0 <= metrics["bbox_AP"] <= 1 and 0 <= metrics["segm_AP"] <= 1
    code = main(["detect", "eval", "--checkpoint", str(out_dir / "last.pth"), "--val-size", "1", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["segm_AP"] == pytest.approx(metrics["segm_AP"])

    images, ann = write_coco(tmp_path / "coco")
    code = main(["detect", "train", *tiny, "--train-images", str(images), "--train-annotations", str(ann),
                 "--val-images", str(images), "--val-annotations", str(ann), "--output", str(tmp_path / "coco_run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert {"bbox_AP", "segm_AP"} <= set(json.loads(out.strip().splitlines()[-1]))


def test_paper_cascade_recipe_loads():
    recipe = load_recipe("detect", "configs/dense/cascade_maskrcnn_pola_swin_t_3x.yaml")
    assert recipe["model"]["detector"] == "cascade_mask_rcnn" and recipe["model"]["backbone"] == "pola_swin_t"
    assert recipe["train"]["epochs"] == 36 and recipe["train"]["milestones"] == [0.75, 0.9167]
