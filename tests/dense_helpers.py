"""Small backbones and tiny data folders for the tests/test_dense_*.py files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

# Narrow, shallow versions of every family: quick to build and to train for a step.
SMALL = {
    "pola_pvt_tiny": dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 2),
                          mlp_ratios=(2, 2, 2, 2)),
    "pola_pvt_v2_b0": dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 2),
                           mlp_ratios=(2, 2, 2, 2)),
    "pola_swin_t": dict(depths=(1, 1, 2, 1), embed_dim=16, num_heads=(1, 2, 2, 4), mlp_ratio=2.0),
    "POLA_b0": dict(embed_dims=(16, 24, 32, 48), depths=(1, 2, 2, 1), num_heads=(1, 1, 2, 3), projection=64),
    "pola_deit_tiny_patch16_224": dict(depth=1, embed_dim=48, num_heads=2),
}


def kwarg_flags(name: str) -> list[str]:
    return [x for k, v in SMALL[name].items()
            for x in ("--backbone-kwarg", f"{k}={list(v) if isinstance(v, tuple) else v}")]


def write_coco(root: Path, n_images: int = 3, size: tuple[int, int] = (48, 64)) -> tuple[Path, Path]:
    """``root/images/*.png`` + ``root/instances.json``: squares of two categories (ids 3 and 7) with polygons."""
    images_dir = root / "images"
    images_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    h, w = size
    images, annotations = [], []
    for i in range(n_images):
        array = (rng.uniform(0, 60, size=(h, w, 3))).astype(np.uint8)
        for j, (cat, colour) in enumerate(((3, 255), (7, 160))):
            x, y, s = 4 + 24 * j, 6 + 3 * i, 14
            array[y:y + s, x:x + s] = colour
            annotations.append({"id": len(annotations) + 1, "image_id": 10 + i, "category_id": cat, "iscrowd": 0,
                                "bbox": [x, y, s, s], "area": s * s,
                                "segmentation": [[x, y, x + s, y, x + s, y + s, x, y + s]]})
        Image.fromarray(array).save(images_dir / f"im{i}.png")
        images.append({"id": 10 + i, "file_name": f"im{i}.png", "height": h, "width": w})
    ann = root / "instances.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": 3, "name": "bright"}, {"id": 7, "name": "grey"}]}))
    return images_dir, ann


def write_ade(root: Path, n_images: int = 2, size: tuple[int, int] = (40, 56), num_classes: int = 3) -> Path:
    """An ADE20K-layout folder: index PNGs with 0 = unlabelled and classes 1..num_classes."""
    rng = np.random.default_rng(1)
    h, w = size
    for split in ("training", "validation"):
        (root / "images" / split).mkdir(parents=True)
        (root / "annotations" / split).mkdir(parents=True)
        for i in range(n_images):
            label = np.zeros((h, w), np.uint8)
            label[:, : w // 2] = 1 + i % num_classes
            label[h // 2:, w // 2:] = num_classes
            image = (label[..., None] * (200 // num_classes) + rng.integers(0, 20, (h, w, 3))).astype(np.uint8)
            Image.fromarray(image).save(root / "images" / split / f"ADE_{split}_{i}.jpg")
            Image.fromarray(label, mode="L").save(root / "annotations" / split / f"ADE_{split}_{i}.png")
    return root
