"""Make tests/data/ade_test_sizes.json: the sizes mmseg's ADE20K test pipeline of the official PolaFormer++
segmentation configs scores images at (not run in CI: neither checkout is there).

    python scripts/ade_test_sizes_reference.py /path/to/mmcv /path/to/PolaFormerPP

reads the test pipeline of ``downstream/segmentation/configs/_base_/datasets/ade20k_repeat.py`` (the scale of its
``MultiScaleFlipAug`` and the divisor of its ``ResizeToMultiple``) and runs mmcv's own ``imrescale`` and
``imresize_to_multiple`` (``mmcv/image/geometric.py`` of an mmcv 1.x checkout: the fork's pipeline calls them,
``Resize(keep_ratio=True)`` then ``ResizeToMultiple``) on blank images of several sizes; cv2, which they call to
resize, is stood in for by a function that returns a blank image of the asked size, since only sizes are
recorded. Last run on mmcv v1.7.2 and ZacharyMeng/PolaFormerPP fd26f5e1c1bcc3210f4d583294ebf9a4d01d62dc.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import sys
import types
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "ade_test_sizes.json"
PIPELINE = "downstream/segmentation/configs/_base_/datasets/ade20k_repeat.py"
# (height, width): ADE20K's common 512-short-side shapes, portrait, tiny, huge, and sides that round at .5
SIZES = [(512, 683), (683, 512), (512, 512), (256, 341), (375, 500), (1536, 2048), (40, 56), (7, 1000),
         (2000, 50), (333, 777), (601, 401)]


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load_geometric(mmcv: Path):
    def resize(img, size, dst=None, interpolation=None):
        width, height = size
        return np.zeros((height, width, *img.shape[2:]), img.dtype)

    codes = {f"INTER_{n}": i for i, n in enumerate(("NEAREST", "LINEAR", "CUBIC", "AREA", "LANCZOS4"))}
    borders = {f"BORDER_{n}": i for i, n in enumerate(("CONSTANT", "REPLICATE", "REFLECT", "WRAP", "REFLECT_101",
                                                       "TRANSPARENT", "ISOLATED"))}
    _stub("cv2", resize=resize, **codes, **borders)
    _stub("mmcv").__path__ = []
    _stub("mmcv.utils", to_2tuple=lambda x: x if isinstance(x, tuple) else (x, x))
    _stub("mmcv.image").__path__ = []
    _stub("mmcv.image.io", imread_backend="cv2")
    spec = importlib.util.spec_from_file_location("mmcv.image.geometric", mmcv / "mmcv" / "image" / "geometric.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def official_test_pipeline(checkout: Path) -> tuple[tuple[int, int], int]:
    config = runpy.run_path(str(checkout / PIPELINE))  # a file of dict literals
    flip_aug = next(step for step in config["test_pipeline"] if step["type"] == "MultiScaleFlipAug")
    steps = {step["type"]: step for step in flip_aug["transforms"]}
    assert steps["Resize"]["keep_ratio"], steps["Resize"]
    return tuple(flip_aug["img_scale"]), steps["ResizeToMultiple"]["size_divisor"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mmcv", type=Path, help="an mmcv 1.x checkout")
    parser.add_argument("official", type=Path, help="a ZacharyMeng/PolaFormerPP checkout")
    args = parser.parse_args()
    geometric = load_geometric(args.mmcv)
    scale, divisor = official_test_pipeline(args.official)
    cases = []
    for height, width in SIZES:
        image = np.zeros((height, width, 3), np.uint8)
        rescaled = geometric.imrescale(image, scale)
        final = geometric.imresize_to_multiple(rescaled, divisor, scale_factor=1)
        cases.append({"size": [height, width], "rescaled": list(rescaled.shape[:2]), "final": list(final.shape[:2])})
    record = {"source": f"mmcv imrescale + imresize_to_multiple; {PIPELINE}", "scale": list(scale),
              "divisor": divisor, "cases": cases}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(cases)} sizes, scale {scale}, divisor {divisor}")


if __name__ == "__main__":
    main()
