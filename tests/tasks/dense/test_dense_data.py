"""The dense-prediction data: embedded digit scenes (exact by construction), COCO and ADE20K loaders."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from dense_helpers import write_ade, write_coco
from polaformer.tasks.dense.data import (
    IGNORE_INDEX,
    AdeSegmentation,
    CocoInstances,
    DenseDataError,
    DigitScenes,
    RandomCrop,
)


def test_digit_scenes_boxes_masks_and_labels_agree():
    scenes = DigitScenes("train", size=20)
    for i in range(len(scenes)):
        image, t = scenes[i]
        assert image.shape == (3, 128, 128) and 0 <= image.min() and image.max() <= 1
        n = len(t["labels"])
        assert 1 <= n <= 4 and t["masks"].shape == (n, 128, 128)
        for box, label, mask in zip(t["boxes"], t["labels"], t["masks"]):
            rows, cols = torch.nonzero(mask, as_tuple=True)
            # the box is the mask's tight box (xyxy, exclusive end), the semantic map labels exactly the mask
            assert box.tolist() == [cols.min(), rows.min(), cols.max() + 1, rows.max() + 1]
            assert (t["semantic"][mask.bool()] == label).all()
        assert torch.equal(t["semantic"] > 0, t["masks"].sum(0) > 0)  # digits never overlap
    a, b = scenes[3], DigitScenes("train", size=20)[3]
    assert torch.equal(a[0], b[0])  # the same canvas every time
    assert not torch.equal(DigitScenes("val", size=5)[3][0], a[0])


def test_digit_scenes_coco_ground_truth():
    scenes = DigitScenes("val", size=4)
    coco = scenes.coco()
    assert sorted(coco.imgs) == [0, 1, 2, 3]
    assert len(coco.anns) == sum(len(scenes[i][1]["labels"]) for i in range(4))
    ann = coco.anns[1]
    mask = coco.annToMask(ann)
    assert torch.equal(torch.from_numpy(mask), scenes[ann["image_id"]][1]["masks"][0])


def test_coco_loader(tmp_path):
    images, ann = write_coco(tmp_path)
    ds = CocoInstances(images, ann)
    assert len(ds) == 3 and ds.classes == ("bright", "grey") and ds.category_ids() == [3, 7]
    image, t = ds[1]
    assert image.shape == (3, 48, 64)
    assert t["labels"].tolist() == [1, 2] and t["image_id"] == 11
    assert t["boxes"][0].tolist() == [4, 9, 18, 23]
    assert t["masks"].shape == (2, 48, 64) and t["masks"][0, 9:23, 4:18].all()


def _corrupt(tmp_path, edit):
    images, ann = write_coco(tmp_path)
    data = json.loads(ann.read_text())
    edit(data)
    ann.write_text(json.dumps(data))
    return images, ann


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("categories"), "no 'categories' list"),
    (lambda d: d["annotations"][1].update(bbox=[1, 2, 0, 5]), r"annotation #1 \(id 2\): bbox must be"),
    (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), "bbox must be"),
    (lambda d: d["annotations"][0].update(category_id=99), "category_id 99 is not in 'categories'"),
    (lambda d: d["annotations"][2].update(image_id=5), "image_id 5 is not in 'images'"),
    (lambda d: d["annotations"][0].update(segmentation=[[1, 2, 3]]), "polygon must be"),
    (lambda d: d["images"][0].pop("file_name"), "image #0 needs"),
    (lambda d: d["images"][0].update(file_name="missing.png"), "missing.png"),
])
def test_coco_loader_errors_are_one_line(tmp_path, edit, message):
    with pytest.raises(DenseDataError, match=message) as info:
        CocoInstances(*_corrupt(tmp_path, edit))
    assert "\n" not in str(info.value)


def test_coco_loader_rejects_bad_json_and_wrong_sizes(tmp_path):
    images, ann = write_coco(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DenseDataError, match="not valid JSON"):
        CocoInstances(images, tmp_path / "bad.json")
    data = json.loads(ann.read_text())
    data["images"][0]["height"] = 50
    ann.write_text(json.dumps(data))
    with pytest.raises(DenseDataError, match="the image is 48x64 but the annotations say 50x64"):
        CocoInstances(images, ann)[0]


def test_ade_loader_and_crop(tmp_path):
    root = write_ade(tmp_path)
    ds = AdeSegmentation(root, "training", num_classes=3)
    assert len(ds) == 2
    image, t = ds[0]
    label = t["semantic"]
    assert image.shape == (3, 40, 56) and label.shape == (40, 56)
    assert label[0, 0] == 0 and label[-1, -1] == 2  # 1 -> class 0, 3 -> class 2
    assert set(label.unique().tolist()) == {0, 2, IGNORE_INDEX}  # top right is unlabelled
    Image.fromarray(np.zeros((40, 56), np.uint8), mode="L").save(root / "annotations/training/ADE_training_1.png")
    assert (ds[1][1]["semantic"] == IGNORE_INDEX).all()  # 0 = unlabelled
    crop = RandomCrop(ds, 48)[0]
    assert crop[0].shape == (3, 48, 48) and (crop[1]["semantic"][40:] == IGNORE_INDEX).all()


def test_ade_loader_errors(tmp_path):
    root = write_ade(tmp_path)
    with pytest.raises(DenseDataError, match="label 3 is beyond the 2 classes"):
        AdeSegmentation(root, "training", num_classes=2)[0]
    Image.fromarray(np.zeros((40, 56, 3), np.uint8)).save(root / "annotations/training/ADE_training_0.png")
    with pytest.raises(DenseDataError, match="single-channel index PNG"):
        AdeSegmentation(root, "training", num_classes=3)[0]
    Image.fromarray(np.zeros((10, 56), np.uint8), mode="L").save(root / "annotations/training/ADE_training_0.png")
    with pytest.raises(DenseDataError, match=r"annotation is \(10, 56\) but the image is \(40, 56\)"):
        AdeSegmentation(root, "training", num_classes=3)[0]
    (root / "annotations/training/ADE_training_1.png").unlink()
    with pytest.raises(DenseDataError, match="no annotation"):
        AdeSegmentation(root, "training")
    with pytest.raises(DenseDataError, match="no such folder"):
        AdeSegmentation(tmp_path / "nowhere")
