"""Data for dense prediction: the embedded digit scenes, COCO-format instances, ADE20K-layout folders.

Every data set yields ``(image, target)``: ``image`` a float (3, H, W) tensor in [0, 1], ``target``
a dict in torchvision's detection format (``boxes`` xyxy float, ``labels`` int64 from 1,
``masks`` (N, H, W) uint8, ``image_id``) and/or ``semantic`` (H, W) int64 with
:data:`IGNORE_INDEX` for unlabelled pixels. Detection sets also give :meth:`coco`, the ground
truth as a pycocotools ``COCO`` object for the official mAP.

Malformed files raise :class:`DenseDataError` with one line naming the file, the entry and the problem.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ...data.digits import digits_split
from ...data.folder import DatasetError
from ...engine.distributed import SampleDraws
from ...files import UnreadableFileError, read_image, read_text
from ...limits import available_memory

if TYPE_CHECKING:  # pycocotools is the optional 'dense' extra, imported where it is used
    from pycocotools.coco import COCO

__all__ = [
    "IGNORE_INDEX", "DIGIT_CLASSES", "DenseDataError", "DigitScenes", "CocoInstances", "AdeSegmentation",
    "RandomCrop", "collate", "coco_from_targets",
]

IGNORE_INDEX = 255
DIGIT_CLASSES = tuple(str(d) for d in range(10))
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")


class DenseDataError(DatasetError):
    """A missing, unreadable or malformed dense-prediction file (one line)."""


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())  # pycocotools prints its progress


def collate(batch):
    return tuple(zip(*batch))


def _load_rgb(path: Path) -> torch.Tensor:
    try:
        with read_image(path) as im:  # regular files only; PIL's decompression-bomb limit
            array = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except FileNotFoundError:
        raise DenseDataError(f"{path}: cannot read the image (no such file)") from None
    except UnreadableFileError as e:
        raise DenseDataError(str(e)) from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


# --- the embedded set -----------------------------------------------------------------------------

class DigitScenes(Dataset):
    """Real handwritten digits (scikit-learn's 8x8 scans) scaled and placed on larger noisy canvases.

    Each canvas holds 1..``max_digits`` digits of 14-40 pixels, never overlapping, in random
    colours on a random background. A digit's mask is its up-sampled stroke intensity above a
    threshold, and the image is painted with that same thresholded intensity as alpha, so masks,
    tight boxes and the per-pixel labels (0 background, 1 + digit) are exact by construction.
    Training canvases use scikit-learn's training digits and validation canvases the held-out
    ones (the fixed split of :func:`polaformer.data.digits.digits_split`); canvas ``i`` of a split
    is always the same image.
    """

    classes = DIGIT_CLASSES
    num_classes = len(DIGIT_CLASSES)

    def __init__(self, split: str = "train", *, size: int | None = None, canvas: int = 128,
                 max_digits: int = 4, seed: int = 0):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        x_train, y_train, x_test, y_test = digits_split()
        self.digits, self.digit_labels = (x_train, y_train) if split == "train" else (x_test, y_test)
        self.size = size if size is not None else (800 if split == "train" else 100)
        self.canvas = canvas
        self.max_digits = max_digits
        self.seed = seed + (0 if split == "train" else 1_000_003)

    def __len__(self) -> int:
        return self.size

    def _layout(self, index: int):
        rng = np.random.default_rng([self.seed, index])
        placed: list[tuple[int, int, int, int, int]] = []  # y, x, side, digit index, label
        for _ in range(int(rng.integers(1, self.max_digits + 1))):
            for _attempt in range(20):
                side = int(rng.integers(14, 41))
                y, x = (int(v) for v in rng.integers(0, self.canvas - side + 1, size=2))
                if all(y + side <= py or py + ps <= y or x + side <= px or px + ps <= x for py, px, ps, _, _ in placed):
                    k = int(rng.integers(len(self.digits)))
                    placed.append((y, x, side, k, int(self.digit_labels[k])))
                    break
        background = rng.uniform(0.0, 0.45, size=3)
        colours = rng.uniform(0.55, 1.0, size=(len(placed), 3))
        return rng, placed, background, colours

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        rng, placed, background, colours = self._layout(index)
        c = self.canvas
        image = torch.from_numpy(background).float().view(3, 1, 1).expand(3, c, c).clone()
        image += torch.from_numpy(rng.normal(0, 0.04, size=(3, c, c))).float()
        masks = torch.zeros(len(placed), c, c, dtype=torch.uint8)
        semantic = torch.zeros(c, c, dtype=torch.int64)
        boxes, labels = [], []
        for i, (y, x, side, k, label) in enumerate(placed):
            ink = torch.from_numpy(self.digits[k] / 16.0).float()[None, None]
            alpha = F.interpolate(ink, size=(side, side), mode="bilinear", align_corners=False)[0, 0]
            alpha = torch.where(alpha > 0.3, alpha.clamp(max=1.0), torch.zeros(()))
            mask = alpha > 0
            region = image[:, y:y + side, x:x + side]
            colour = torch.from_numpy(colours[i]).float().view(3, 1, 1)
            image[:, y:y + side, x:x + side] = region * (1 - alpha) + colour * alpha
            masks[i, y:y + side, x:x + side] = mask.to(torch.uint8)
            semantic[y:y + side, x:x + side][mask] = label + 1
            rows, cols = torch.nonzero(mask, as_tuple=True)
            boxes.append([x + cols.min().item(), y + rows.min().item(),
                          x + cols.max().item() + 1, y + rows.max().item() + 1])
            labels.append(label + 1)
        target = {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "masks": masks,
            "semantic": semantic,
            "image_id": index,
        }
        return image.clamp_(0, 1), target

    def coco(self):
        return coco_from_targets((self[i][1] for i in range(len(self))), (self.canvas, self.canvas), self.classes)

    def category_ids(self) -> list[int]:
        return list(range(1, self.num_classes + 1))


def coco_from_targets(targets, image_size: tuple[int, int], classes) -> COCO:
    """Ground truth in pycocotools form from torchvision-style targets (labels 1..K are the category ids)."""
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO

    images, annotations = [], []
    h, w = image_size
    for target in targets:
        image_id = int(target["image_id"])
        images.append({"id": image_id, "height": h, "width": w})
        for box, label, mask in zip(target["boxes"].tolist(), target["labels"].tolist(), target["masks"]):
            rle = mask_utils.encode(np.asfortranarray(mask.numpy()))
            rle["counts"] = rle["counts"].decode("ascii")
            x0, y0, x1, y1 = box
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": int(label),
                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(mask.sum()), "iscrowd": 0, "segmentation": rle,
            })
    coco = COCO()
    coco.dataset = {
        "images": images, "annotations": annotations,
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(classes)],
    }
    with _quiet():
        coco.createIndex()
    return coco


# --- COCO format ----------------------------------------------------------------------------------

def _check_coco(data, path: Path) -> None:
    """One-line errors for what pycocotools would reject cryptically, or accept and mis-evaluate."""
    if not isinstance(data, dict):
        raise DenseDataError(f"{path}: expected a JSON object with 'images', 'annotations' and 'categories'")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise DenseDataError(f"{path}: no {key!r} list")
    category_ids = set()
    for i, cat in enumerate(data["categories"]):
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int) or "name" not in cat:
            raise DenseDataError(f"{path}: category #{i} needs an integer 'id' and a 'name'")
        category_ids.add(cat["id"])
    sizes: dict[int, tuple | None] = {}  # image id -> (height, width) where the file gives both
    for i, image in enumerate(data["images"]):
        if not isinstance(image, dict) or not isinstance(image.get("id"), int) or not image.get("file_name"):
            raise DenseDataError(f"{path}: image #{i} needs an integer 'id' and a 'file_name'")
        if image["id"] in sizes:
            raise DenseDataError(
                f"{path}: image #{i} ({image['file_name']}) has the id {image['id']} of an earlier image")
        name = PurePath(str(image["file_name"]))
        if name.is_absolute() or ".." in name.parts:
            raise DenseDataError(f"{path}: image #{i}: file_name {str(name)!r} leaves the image folder")
        size = (image.get("height"), image.get("width"))
        sizes[image["id"]] = size if all(isinstance(v, int) and v > 0 for v in size) else None
    image_ids = set(sizes)
    if not data["annotations"]:
        raise DenseDataError(f"{path}: no annotations, so nothing to train on or to score")
    for i, ann in enumerate(data["annotations"]):
        where = f"{path}: annotation #{i} (id {ann.get('id') if isinstance(ann, dict) else '?'})"
        if not isinstance(ann, dict):
            raise DenseDataError(f"{where}: not an object")
        if ann.get("image_id") not in image_ids:
            raise DenseDataError(f"{where}: image_id {ann.get('image_id')!r} is not in 'images'")
        if ann.get("category_id") not in category_ids:
            raise DenseDataError(f"{where}: category_id {ann.get('category_id')!r} is not in 'categories'")
        bbox = ann.get("bbox")
        if (not isinstance(bbox, list) or len(bbox) != 4 or not all(isinstance(v, (int, float)) for v in bbox)
                or not all(math.isfinite(v) for v in bbox) or bbox[2] <= 0 or bbox[3] <= 0):
            raise DenseDataError(f"{where}: bbox must be [x, y, width, height] with width, height > 0, got {bbox!r}")
        size = sizes[ann["image_id"]]
        height, width = size or (_MAX_SIDE, _MAX_SIDE)
        x, y, w, h = bbox
        if x >= width or y >= height or x + w <= 0 or y + h <= 0:
            raise DenseDataError(f"{where}: bbox {bbox!r} lies outside its {height}x{width} image")
        seg = ann.get("segmentation")
        if seg is None:
            continue
        if isinstance(seg, list):
            if not seg:  # pycocotools cannot make a mask of no polygon
                raise DenseDataError(f"{where}: segmentation is an empty list; give polygons or an RLE, or leave "
                                     "the key out")
            for polygon in seg:
                if (not isinstance(polygon, list) or len(polygon) < 6 or len(polygon) % 2
                        or not all(isinstance(v, (int, float)) for v in polygon)):
                    raise DenseDataError(f"{where}: a polygon must be a list of at least 3 x, y pairs")
        elif not (isinstance(seg, dict) and "counts" in seg and isinstance(seg.get("size"), list)):
            raise DenseDataError(f"{where}: segmentation must be polygons or an RLE with 'size' and 'counts'")
        else:
            _check_rle(seg, size, where)
    if all(ann.get("iscrowd") for ann in data["annotations"]):
        raise DenseDataError(f"{path}: all {len(data['annotations'])} annotations are crowd regions (iscrowd=1), which "
                             "are neither trained on nor scored: nothing to train on or to score")


_MAX_SIDE = 1 << 16  # pixels a side of an image whose size the annotations do not give


def _check_rle(rle: dict, size: tuple | None, where: str) -> None:
    """An RLE whose size or run lengths do not match its image crashes pycocotools' C code (or decodes to garbage)."""
    shape = rle["size"]
    if len(shape) != 2 or not all(isinstance(v, int) and 0 < v <= _MAX_SIDE for v in shape):
        raise DenseDataError(f"{where}: RLE size must be [height, width] of at most {_MAX_SIDE}, got {shape!r}")
    if size is not None and tuple(shape) != size:
        raise DenseDataError(f"{where}: RLE size {shape} is not its image's {list(size)}")
    counts = rle["counts"]
    runs = _rle_runs(counts) if isinstance(counts, str) else counts
    if (not isinstance(runs, list) or not all(isinstance(v, int) and v >= 0 for v in runs)
            or sum(runs) != shape[0] * shape[1]):
        raise DenseDataError(f"{where}: RLE counts do not cover its {shape[0]}x{shape[1]} pixels in runs of >= 0")


def _rle_runs(text: str) -> list | None:
    """The run lengths of COCO's compressed RLE string (6-bit groups from '0', deltas from the run two back),
    or None where a character lies outside its alphabet."""
    runs: list[int] = []
    position = 0
    while position < len(text):
        value = shift = 0
        more = True
        while more:
            if position >= len(text) or not 48 <= ord(text[position]) < 112:
                return None
            group = ord(text[position]) - 48
            value |= (group & 0x1F) << shift
            more = bool(group & 0x20)
            position += 1
            shift += 5
            if not more and group & 0x10:
                value -= 1 << shift
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    return runs


class CocoInstances(Dataset):
    """Images listed in a COCO instances JSON, with boxes, labels (1..K in category order) and masks.

    Crowd annotations are left out of the training targets (the evaluation keeps them, as COCO's).
    Images with no annotation are kept (negatives).
    """

    def __init__(self, image_dir: str | os.PathLike, annotation_file: str | os.PathLike):
        from pycocotools.coco import COCO

        self.image_dir = Path(image_dir)
        path = Path(annotation_file)
        if not path.is_file():
            raise DenseDataError(f"{path}: no such annotation file")
        if not self.image_dir.is_dir():
            raise DenseDataError(f"{self.image_dir}: no such image folder")
        try:
            data = json.loads(read_text(path, available_memory("cpu")))
        except UnreadableFileError as e:
            raise DenseDataError(str(e)) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DenseDataError(f"{path}: not valid JSON ({e})") from None
        _check_coco(data, path)
        self._coco = COCO()
        self._coco.dataset = data
        with _quiet():
            self._coco.createIndex()
        self.ids = sorted(self._coco.imgs)
        cats = sorted(self._coco.cats)
        self.classes = tuple(self._coco.cats[c]["name"] for c in cats)
        self.num_classes = len(cats)
        self._category_ids = cats
        self._label_of = {c: i + 1 for i, c in enumerate(cats)}
        names = [self._coco.imgs[i]["file_name"] for i in self.ids]
        missing = [name for name in names if not (self.image_dir / name).is_file()]
        if missing:
            raise DenseDataError(f"{self.image_dir}: {len(missing)} listed images are missing (e.g. {missing[0]})")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        image_id = self.ids[index]
        info = self._coco.imgs[image_id]
        image = _load_rgb(self.image_dir / info["file_name"])
        h, w = image.shape[-2:]
        if (info.get("height"), info.get("width")) not in ((h, w), (None, None)):
            raise DenseDataError(f"{info['file_name']}: the image is {h}x{w} but the annotations say "
                                 f"{info.get('height')}x{info.get('width')}")
        anns = [a for a in self._coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        target = {
            "boxes": boxes,
            "labels": torch.tensor([self._label_of[a["category_id"]] for a in anns], dtype=torch.int64),
            "image_id": image_id,
        }
        if all("segmentation" in a for a in anns):
            info = {**info, "height": h, "width": w}
            self._coco.imgs[image_id] = info
            target["masks"] = torch.from_numpy(
                np.stack([self._coco.annToMask(a) for a in anns]) if anns else np.zeros((0, h, w), np.uint8)
            )
        return image, target

    def coco(self):
        return self._coco

    def category_ids(self) -> list[int]:
        return list(self._category_ids)


# --- ADE20K layout --------------------------------------------------------------------------------

class AdeSegmentation(Dataset):
    """An ADE20K-layout folder: ``ROOT/images/SPLIT/NAME.jpg`` + ``ROOT/annotations/SPLIT/NAME.png``.

    Annotations are single-channel index PNGs. With ``reduce_zero_label`` (ADE20K's convention)
    0 is "unlabelled" and becomes :data:`IGNORE_INDEX`, and class ``c`` is stored as ``c + 1``;
    without it, values are class indices and 255 is ignored. Values at or above ``num_classes``
    (after the shift) are an error, naming the file.
    """

    def __init__(self, root: str | os.PathLike, split: str = "training", *, num_classes: int = 150,
                 reduce_zero_label: bool = True):
        root = Path(root)
        image_dir, label_dir = root / "images" / split, root / "annotations" / split
        for folder in (image_dir, label_dir):
            if not folder.is_dir():
                raise DenseDataError(
                    f"{folder}: no such folder (expected ROOT/images/{split} and ROOT/annotations/{split})")
        self.images = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not self.images:
            raise DenseDataError(f"{image_dir}: no images ({', '.join(IMAGE_EXTENSIONS)})")
        self.labels = [label_dir / (p.stem + ".png") for p in self.images]
        for image, label in zip(self.images, self.labels):
            if not label.is_file():
                raise DenseDataError(f"{image}: no annotation {label}")
        self.num_classes = num_classes
        self.reduce_zero_label = reduce_zero_label
        self.classes = tuple(str(i) for i in range(num_classes))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = _load_rgb(self.images[index])
        path = self.labels[index]
        try:
            with read_image(path) as im:
                if im.mode not in ("L", "P", "I;16", "I"):
                    raise DenseDataError(
                        f"{path}: an annotation must be a single-channel index PNG, found mode {im.mode}")
                label = torch.from_numpy(np.asarray(im, dtype=np.int64).copy())
        except (OSError, UnreadableFileError) as e:
            raise DenseDataError(f"{path}: cannot read the annotation ({getattr(e, 'detail', e)})") from None
        if label.shape != image.shape[-2:]:
            raise DenseDataError(
                f"{path}: annotation is {tuple(label.shape)} but the image is {tuple(image.shape[-2:])}")
        if self.reduce_zero_label:
            label = torch.where(label == 0, IGNORE_INDEX, label - 1)
        valid = label != IGNORE_INDEX
        if valid.any() and int(label[valid].max()) >= self.num_classes:
            largest = int(label[valid].max()) + int(self.reduce_zero_label)
            raise DenseDataError(f"{path}: label {largest} is beyond the {self.num_classes} classes")
        return image, {"semantic": label, "image_id": index}


class RandomCrop(SampleDraws, Dataset):
    """Random ``size`` x ``size`` crops of a segmentation set (padded with ignored pixels when smaller), drawn from
    (``seed``, epoch, index) (:class:`~polaformer.engine.distributed.SampleDraws`): the same for any process count.

    Training batches need one size; evaluation uses the whole images, one at a time.
    """

    def __init__(self, dataset: Dataset, size: int, seed: int = 0):
        super().__init__(seed)
        self.dataset = dataset
        self.size = size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, target = self.dataset[index]
        label = target["semantic"]
        h, w = label.shape
        s = self.size
        pad_h, pad_w = max(0, s - h), max(0, s - w)
        if pad_h or pad_w:
            image = F.pad(image, (0, pad_w, 0, pad_h))
            label = F.pad(label, (0, pad_w, 0, pad_h), value=IGNORE_INDEX)
            h, w = label.shape
        generator = self.generator(index)
        y = int(torch.randint(h - s + 1, (), generator=generator))
        x = int(torch.randint(w - s + 1, (), generator=generator))
        return image[:, y:y + s, x:x + s], {**target, "semantic": label[y:y + s, x:x + s]}
