"""Backbones (every family + FPN), detectors and segmenters built on them, weights loaded into them.

The resampled position table keeps its mean to 1e-3: bilinear resampling averages neighbours, and the border's clamped
samples move the mean by the table's edge values over its size (a few 1e-4 for a 16x16 table of trunc-normal(0.02)
values), not by rounding."""
import pytest
import timm
import torch

from dense_helpers import SMALL
from polaformer.tasks.dense.backbone import BackboneError, build_backbone, pyramid_indices
from polaformer.tasks.dense.detection import build_detector
from polaformer.tasks.dense.segmentation import ConfusionMatrix, build_segmenter


@pytest.mark.parametrize("name", list(SMALL))
def test_backbone_pyramid_at_any_size(name):
    torch.manual_seed(0)
    backbone = build_backbone(name, model_kwargs=SMALL[name], out_channels=32).eval()
    with torch.no_grad():
        out = backbone(torch.randn(1, 3, 70, 101))  # not a multiple of 32: padded to 96 x 128
    assert list(out) == ["0", "1", "2", "3", "pool"]
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(24, 32), (12, 16), (6, 8), (3, 4), (2, 2)]
    assert all(v.shape[1] == 32 for v in out.values())


def test_one_stage_levels_are_p3_to_p7():
    backbone = build_backbone("pola_pvt_v2_b0", model_kwargs=SMALL["pola_pvt_v2_b0"], out_channels=16,
                              extra="p6p7", first_stride=8).eval()
    with torch.no_grad():
        out = backbone(torch.randn(1, 3, 128, 128))
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)]


def test_pyramid_indices():
    hierarchical = [{"reduction": r} for r in (4, 4, 8, 16, 16, 32)]
    assert pyramid_indices(hierarchical) == ((1, 2, 4, 5), False)
    assert pyramid_indices([{"reduction": 16}] * 3) == ((2,), True)
    with pytest.raises(BackboneError, match="strides"):
        pyramid_indices([{"reduction": 8}, {"reduction": 16}])
    with pytest.raises(BackboneError, match="unknown backbone 'nope'"):
        build_backbone("nope")


def test_backbone_weights_loaded_with_resampled_position_tables(tmp_path):
    kwargs = SMALL["pola_pvt_tiny"]
    torch.manual_seed(0)
    classifier = timm.create_model("pola_pvt_tiny", num_classes=7, img_size=64, **kwargs)
    path = tmp_path / "imagenet.pth"
    torch.save({"model": classifier.state_dict()}, path)
    backbone = build_backbone("pola_pvt_tiny", weights=str(path), model_kwargs={**kwargs, "img_size": 128})
    trunk = backbone.trunk.model
    assert trunk.pos_embed1.shape[1] == (128 // 4) ** 2 != classifier.pos_embed1.shape[1]
    torch.testing.assert_close(trunk.patch_embed1.proj.weight, classifier.patch_embed1.proj.weight)
    # the 16x16 table bilinearly resampled to 32x32 keeps its mean
    torch.testing.assert_close(trunk.pos_embed1.mean(), classifier.pos_embed1.mean(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("detector", ["retinanet", "fcos", "maskrcnn"])
def test_detector_train_and_eval_outputs(detector):
    torch.manual_seed(0)
    model = build_detector(detector, "pola_pvt_v2_b0", 3, backbone_kwargs=SMALL["pola_pvt_v2_b0"], min_size=64,
                           max_size=64, anchor_sizes=[8, 16, 32, 64, 128], fpn_channels=32, roi_batch=16)
    images = [torch.rand(3, 64, 64), torch.rand(3, 50, 60)]
    targets = [{"boxes": torch.tensor([[4.0, 4, 30, 30]]), "labels": torch.tensor([2]),
                "masks": torch.zeros(1, 64, 64, dtype=torch.uint8)},
               {"boxes": torch.tensor([[10.0, 5, 20, 40]]), "labels": torch.tensor([1]),
                "masks": torch.zeros(1, 50, 60, dtype=torch.uint8)}]
    for t in targets:
        x0, y0, x1, y1 = t["boxes"][0].int().tolist()
        t["masks"][0, y0:y1, x0:x1] = 1
    losses = model(images, targets)
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())
    model.eval()
    with torch.no_grad():
        pred = model(images)
    assert len(pred) == 2 and pred[1]["boxes"].shape[1] == 4
    assert ("masks" in pred[0]) == (detector == "maskrcnn")


@pytest.mark.parametrize("name", ["pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0"])
@pytest.mark.parametrize("decoder", ["fpn", "upernet"])
def test_segmenter_every_hierarchical_family(name, decoder):
    model = build_segmenter(decoder, name, 5, backbone_kwargs=SMALL[name], decoder_channels=64).eval()
    with torch.no_grad():
        assert model(torch.rand(2, 3, 45, 70)).shape == (2, 5, 45, 70)


def test_segmenter_refuses_a_plain_vit_and_loads_weights(tmp_path):
    with pytest.raises(BackboneError, match="plain ViT"):
        build_segmenter("fpn", "pola_deit_tiny_patch16_224", 3, backbone_kwargs=SMALL["pola_deit_tiny_patch16_224"])
    kwargs = SMALL["pola_swin_t"]
    classifier = timm.create_model("pola_swin_t", num_classes=4, **kwargs)
    path = tmp_path / "swin.pth"
    torch.save({"model": classifier.state_dict()}, path)
    model = build_segmenter("upernet", "pola_swin_t", 3, backbone_weights=str(path), backbone_kwargs=kwargs)
    torch.testing.assert_close(model.net.encoder.model.model.patch_embed.proj.weight,
                               classifier.patch_embed.proj.weight)


def test_confusion_matrix_miou():
    cm = ConfusionMatrix(3)
    label = torch.tensor([0, 0, 1, 1, 255, 2])
    pred = torch.tensor([0, 1, 1, 1, 0, 0])
    cm.update(pred, label)
    # class 0: tp 1, union 3; class 1: tp 2, union 3; class 2: tp 0, union 1
    assert cm.metrics()["mIoU"] == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    assert cm.metrics()["aAcc"] == pytest.approx(3 / 5)
