"""Cascade Mask R-CNN: three weighted stages that train and refine, and ``detect train --detector cascade_mask_rcnn``
on the embedded scenes and on a COCO-format folder."""
import json

import pytest
import torch

from polaformer.cli import main
from polaformer.tasks.dense.cascade import STAGE_WEIGHTS, CascadeRoIHeads
from polaformer.tasks.dense.config import load_recipe
from polaformer.tasks.dense.detection import build_detector

from dense_helpers import SMALL, kwarg_flags, write_coco


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


def test_cascade_on_digits_and_a_coco_folder(tmp_path, capsys):
    tiny = ["--detector", "cascade_mask_rcnn", "--backbone", "pola_pvt_v2_b0", *kwarg_flags("pola_pvt_v2_b0"),
            "--opts", "model.fpn_channels", "32", "model.roi_batch", "16", "model.min_size", "64", "model.max_size", "64",
            "--steps", "1", "--batch-size", "2",
            "--no-progress", "--device", "cpu"]
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
