"""ImageNet-layout image folders for the training engine: datasets, transforms, Mixup/CutMix.

Layout (the one the official Swin-style framework reads)::

    DATA.DATA_PATH/train/<class>/<image>     e.g. train/n01440764/n01440764_10026.JPEG
    DATA.DATA_PATH/val/<class>/<image>

Class indices are the sorted class folder names (as torchvision's ``ImageFolder``); images are
found recursively under each class folder, by extension (case-insensitive, see ``IMG_EXTENSIONS``).
Hidden entries (names starting with ``.``) are ignored. Problems with the layout raise
``DatasetError`` before training starts: a missing folder, a class folder without images, no
images at all, a single class, train/val class lists that differ, no readable training image.

Unreadable images (corrupt, truncated, not an image at all) do not stop an epoch: the dataset
logs one warning per file and returns ``None`` for it; ``collate_skip_corrupt`` (the DataLoader
``collate_fn``) drops those and returns ``(images, targets, num_skipped)``, so the count travels
with the batch and works with any number of DataLoader workers without shared state.

Config keys read (attribute access on the engine's config, nothing else is touched):

    DATA.DATA_PATH, DATA.IMG_SIZE, DATA.INTERPOLATION,
    AUG.COLOR_JITTER, AUG.AUTO_AUGMENT, AUG.REPROB, AUG.REMODE, AUG.RECOUNT,
    AUG.MIXUP, AUG.CUTMIX, AUG.CUTMIX_MINMAX, AUG.MIXUP_PROB, AUG.MIXUP_SWITCH_PROB, AUG.MIXUP_MODE,
    MODEL.NAME, MODEL.LABEL_SMOOTHING, TEST.CROP

The transforms and Mixup settings follow the official ``data/build.py`` (see ``build_transform``).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision import transforms

from ..files import read_image

__all__ = [
    "IMG_EXTENSIONS",
    "DatasetError",
    "ImageFolderDataset",
    "build_folder_datasets",
    "build_mixup",
    "build_transform",
    "collate_skip_corrupt",
    "eval_data_config",
    "mixup_active",
    "model_normalisation",
    "model_transforms",
    "open_folder",
]

logger = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "hamming", "box", "random")
# Resize ratio of the evaluation transform with TEST.CROP (crop_pct = 224 / 256), as the official code.
EVAL_RESIZE_RATIO = 256 / 224
EVAL_CROP_PCT = 224 / 256  # timm's name for it; floor(size / EVAL_CROP_PCT) == int(EVAL_RESIZE_RATIO * size)
# The official code switches to CIFAR-style transforms at and below this size.
SMALL_IMAGE_SIZE = 32
_MAX_LISTED = 5


class DatasetError(ValueError):
    """The data folder cannot be used for training (raised before training starts)."""


def _listing(names: Sequence[str], limit: int = _MAX_LISTED) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _scan_split(root: str, extensions: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Class names (sorted) and, per class, the sorted image paths relative to ``root``."""
    if not os.path.isdir(root):
        raise DatasetError(f"data folder not found: {root}")
    extensions = tuple(e.lower() for e in extensions)
    with os.scandir(root) as it:
        entries = sorted((e for e in it if _visible(e.name)), key=lambda e: e.name)
    classes = [e.name for e in entries if e.is_dir()]
    if not classes:
        loose = [e.name for e in entries if e.is_file() and e.name.lower().endswith(extensions)]
        hint = f" (found {len(loose)} image files directly in it)" if loose else ""
        raise DatasetError(
            f"no images in {root}: it has no class folders{hint}; expected {root}/<class>/<image>"
        )
    per_class: list[list[str]] = []
    walk = _SplitWalk(root, extensions, classes)
    for name in classes:
        per_class.append(walk.images(name))
    walk.report()
    if not any(per_class):
        raise DatasetError(
            f"no images in {root}: its {len(classes)} class folders hold no files with the extensions "
            f"{', '.join(extensions)}"
        )
    empty = [name for name, files in zip(classes, per_class) if not files]
    if empty:
        first = os.path.join(root, empty[0])
        what = "empty class folder" if len(empty) == 1 else f"{len(empty)} empty class folders under {root}"
        raise DatasetError(
            f"{what}: {first if len(empty) == 1 else _listing(empty)} (no files with the extensions "
            f"{', '.join(extensions)}); remove the folder or add its images"
        )
    return classes, per_class


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, scaled from its real range.

    PIL's ``convert('RGB')`` clips 16- and 32-bit integer pixels to 255 (a 16-bit PNG turns white)
    and truncates float pixels (a float TIFF in [0, 1] turns black). Integer images are scaled from
    their bit depth (16 bits unless a value exceeds it); float images from [0, 1] when they lie in
    it, else from their own minimum and maximum.
    """
    if image.mode not in ("I", "F") and not image.mode.startswith("I;"):
        return image.convert("RGB")
    pixels = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        finite = pixels[np.isfinite(pixels)]
        low, high = (0.0, 1.0) if finite.size == 0 or (finite.min() >= 0 and finite.max() <= 1) else (
            float(finite.min()), float(finite.max()))
    else:
        low, high = 0.0, 65535.0 if pixels.max(initial=0) <= 65535 else float(pixels.max())
    scaled = np.nan_to_num((pixels - low) / max(high - low, 1e-12), nan=0.0, posinf=1.0, neginf=0.0)
    gray = np.clip(np.rint(scaled * 255), 0, 255).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")


class _SplitWalk:
    """Finds the images of one split, following symbolic links but visiting each real folder once.

    A link loop (``class/self -> .``) would otherwise be followed until the path gets too long,
    and a link into another class would count its images twice. Links that lead outside the split
    (into ``val/`` from ``train/``, say) are followed but reported: they may leak images across splits.
    """

    def __init__(self, root: str, extensions: tuple[str, ...], classes: Sequence[str]):
        self.root, self.extensions = root, extensions
        self.real_root = os.path.realpath(root)
        self.class_roots = {name: os.path.realpath(os.path.join(root, name)) for name in classes}
        self.visited: set[str] = set()
        self.outside: list[str] = []  # links leading outside the split
        self.repeated: list[str] = []  # links to folders already visited, or into another class

    def _inside(self, real: str, folder: str | None = None) -> bool:
        folder = folder or self.real_root
        return real == folder or real.startswith(folder + os.sep)

    def images(self, name: str) -> list[str]:
        files: list[str] = []
        top = os.path.join(self.root, name)
        stack = [(top, os.path.realpath(top))]
        if os.path.islink(top) and not self._inside(stack[0][1]):
            self.outside.append(f"{top} -> {stack[0][1]}")
        while stack:
            path, real = stack.pop()
            if real in self.visited or self._in_other_class(real, name):
                self.repeated.append(f"{path} -> {real}")
                continue
            self.visited.add(real)
            try:
                with os.scandir(path) as it:
                    entries = sorted((e for e in it if _visible(e.name)), key=lambda e: e.name)
            except OSError as err:
                logger.warning("cannot list %s: %s", path, err.strerror or err)
                continue
            subdirs = []
            for entry in entries:
                link = entry.is_symlink()
                target = os.path.realpath(entry.path) if link else os.path.join(real, entry.name)
                if link and not self._inside(target):
                    self.outside.append(f"{entry.path} -> {target}")
                if entry.is_dir():
                    subdirs.append((entry.path, target))
                elif entry.name.lower().endswith(self.extensions) and entry.is_file():  # a FIFO would block reading
                    files.append(os.path.relpath(entry.path, self.root))
            stack.extend(reversed(subdirs))  # os.walk's order: a folder's files, then its sub-folders by name
        return files

    def _in_other_class(self, real: str, name: str) -> bool:
        return any(self._inside(real, folder) for other, folder in self.class_roots.items()
                   if other != name and not self._inside(self.class_roots[name], folder))

    def report(self) -> None:
        if self.repeated:
            logger.warning("%s: skipped %d symbolic links to folders scanned already or of another class (e.g. %s)",
                           self.root, len(self.repeated), self.repeated[0])
        if self.outside:
            logger.warning("%s: %d symbolic links lead outside this split, their images are included "
                           "(e.g. %s); check that no image is in both train/ and val/",
                           self.root, len(self.outside), self.outside[0])


class ImageFolderDataset(Dataset):
    """``root/<class>/<image>`` images read with PIL as RGB; unreadable ones come back as ``None``.

    ``dataset[i]`` is ``(transform(image), class_index)``, or ``None`` when the file cannot be
    decoded (a warning is logged once per file and process; the file is not read again by that
    process). Use ``collate_skip_corrupt`` (or ``dataset.collate_fn``) as the DataLoader's
    ``collate_fn``. Paths are kept in one packed byte array, not a list of Python strings, so that
    DataLoader workers do not copy them page by page at ImageNet scale.
    """

    def __init__(
        self,
        root: str,
        transform: Optional[Callable] = None,
        *,
        extensions: Sequence[str] = IMG_EXTENSIONS,
        image_shape: Optional[tuple[int, ...]] = None,
    ):
        self.root = os.fspath(root)
        self.transform = transform
        self.classes, per_class = _scan_split(self.root, extensions)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        encoded = [os.fsencode(p) for files in per_class for p in files]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in encoded], out=self._offsets[1:])
        self._paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.targets = np.concatenate(
            [np.full(len(files), i, dtype=np.int64) for i, files in enumerate(per_class)]
        )
        self.image_shape = image_shape
        self.collate_fn = functools.partial(collate_skip_corrupt, image_shape=image_shape)
        self._bad: set[int] = set()  # indices found unreadable by this process

    def __len__(self) -> int:
        return len(self.targets)

    def path(self, index: int) -> str:
        start, end = self._offsets[index], self._offsets[index + 1]
        return os.path.join(self.root, os.fsdecode(self._paths[start:end].tobytes()))

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, class_index)`` pairs, as ``torchvision.datasets.ImageFolder.samples``."""
        return [(self.path(i), int(t)) for i, t in enumerate(self.targets)]

    def class_counts(self) -> list[int]:
        return np.bincount(self.targets, minlength=len(self.classes)).tolist()

    def load(self, index: int) -> Optional[Image.Image]:
        """The RGB image at ``index``, or ``None`` (with a warning the first time) if unreadable."""
        if index in self._bad:
            return None
        try:
            return self._read(index)
        except Exception as err:  # any decoding/reading failure: PIL raises many kinds
            self._bad.add(index)
            logger.warning("skipping unreadable image %s: %s: %s", self.path(index), type(err).__name__, err)
            return None

    def _read(self, index: int) -> Image.Image:
        # decoded now (truncated or corrupt data fails here, not in the transform), through the one reader
        return to_rgb(read_image(self.path(index)))

    def check_readable(self, samples: int = 32) -> None:
        """Raise ``DatasetError`` unless one of ``samples`` images spread evenly over the set decodes.

        A set whose every image is unreadable would otherwise "train" on nothing; a sound set pays
        for one decoded image. Every image is tried when the set holds no more than ``samples``.
        """
        indices = np.unique(np.linspace(0, len(self) - 1, num=min(samples, len(self))).round().astype(np.int64))
        first_error = None
        for index in indices.tolist():
            try:
                self._read(index)
                return
            except Exception as err:  # PIL's messages repeat the path: name the error, or the system's reason
                reason = err.strerror if isinstance(err, OSError) and err.strerror else getattr(
                    err, "detail", type(err).__name__)
                first_error = first_error or f"{self.path(index)}: {reason}"
        which = f"none of its {len(self)} images" if len(indices) == len(self) else (
            f"none of {len(indices)} images sampled across its {len(self)}")
        raise DatasetError(f"{self.root}: {which} can be read (e.g. {first_error})")

    def __getitem__(self, index: int):
        image = self.load(index)
        if image is None:
            return None
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={self.root!r}, images={len(self)}, classes={len(self.classes)}, "
            f"transform={self.transform!r})"
        )


def collate_skip_corrupt(
    batch: Sequence[Any], *, image_shape: Optional[Sequence[int]] = None, even: bool = False
):
    """Collate ``(image, target)`` samples, dropping ``None`` (unreadable) ones.

    Returns ``(images, targets, num_skipped)`` where ``num_skipped`` is the number of ``None``
    samples dropped from this batch. When every sample was unreadable, ``images`` is an empty tensor
    of shape ``(0, *image_shape)`` (``(0,)`` without ``image_shape``) and ``targets`` an empty int64
    tensor: the caller must skip such a batch (``images.shape[0] == 0``).

    ``even=True`` additionally drops the last readable sample when an odd number remain, for timm's
    ``Mixup``, which requires an even batch size; that sample is not counted in ``num_skipped``.
    """
    kept = [sample for sample in batch if sample is not None]
    num_skipped = len(batch) - len(kept)
    if even and len(kept) % 2:
        kept = kept[:-1]
    if not kept:
        shape = (0, *image_shape) if image_shape is not None else (0,)
        return torch.empty(shape), torch.empty(0, dtype=torch.long), num_skipped
    images, targets = default_collate(kept)
    return images, targets, num_skipped


# --------------------------------------------------------------------------------------------
# transforms and Mixup, as the official data/build.py


def _img_size(cfg) -> int:
    size = cfg.DATA.IMG_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise DatasetError(f"DATA.IMG_SIZE must be a positive integer, got {size!r}")
    return size


def _interpolation(cfg) -> str:
    mode = str(cfg.DATA.INTERPOLATION).lower()
    if mode not in INTERPOLATIONS:
        raise DatasetError(
            f"DATA.INTERPOLATION must be one of {', '.join(INTERPOLATIONS)}, got {cfg.DATA.INTERPOLATION!r}"
        )
    return mode


def eval_interpolation(mode: str) -> str:
    """The interpolation of the official evaluation transform for ``DATA.INTERPOLATION`` ``mode``.

    It maps anything it does not know (``'random'``) to bilinear.
    """
    mode = str(mode).lower()
    if mode not in INTERPOLATIONS:
        raise DatasetError(f"DATA.INTERPOLATION must be one of {', '.join(INTERPOLATIONS)}, got {mode!r}")
    return mode if mode in ("bicubic", "nearest", "lanczos", "hamming", "box") else "bilinear"


def eval_data_config(img_size: int, *, interpolation: str = "bicubic", crop: bool = True, in_chans: int = 3) -> dict:
    """The official evaluation transform as timm data-config entries (arguments of ``create_transform``).

    Official: with ``TEST.CROP`` a resize to the square ``int(256 / 224 · size)`` and a centre crop
    of ``size``; without it a resize straight to ``size × size``; for sizes up to 32 no crop. In
    timm's terms that is ``crop_mode='squash'`` with ``crop_pct`` 0.875, or 1.0 without a crop
    (the centre crop then takes the whole image). These are the models' ``pretrained_cfg`` values,
    so ``timm.data.create_transform(**timm.data.resolve_model_data_config(model))`` is this transform
    at the model's size.
    """
    return {
        "input_size": (in_chans, img_size, img_size),
        "interpolation": eval_interpolation(interpolation),
        "crop_pct": EVAL_CROP_PCT if crop and img_size > SMALL_IMAGE_SIZE else 1.0,
        "crop_mode": "squash",
    }


def build_transform(cfg, is_train: bool):
    """The official training / evaluation transform for ``cfg.DATA.IMG_SIZE``.

    Both normalise with the mean/std of the model ``MODEL.NAME`` (:func:`model_normalisation`: ImageNet's
    for every Pola model, as in the official code), the values ``polaformer eval`` uses for it.

    Training: timm ``create_transform`` (RandomResizedCrop with ``DATA.INTERPOLATION``, horizontal
    flip, RandAugment ``AUG.AUTO_AUGMENT``, colour jitter ``AUG.COLOR_JITTER``, normalisation,
    random erasing ``AUG.REPROB``/``REMODE``/``RECOUNT``). As in timm (and the
    official runs), colour jitter is not applied while RandAugment is on. For ``IMG_SIZE <= 32`` the
    random resized crop is replaced by ``RandomCrop(IMG_SIZE, padding=4)`` (CIFAR style).

    Evaluation: with ``TEST.CROP`` a resize to the square ``int(256 / 224 * IMG_SIZE)`` (crop_pct
    224/256; note that the official resize is to a square, not of the shorter side) and a centre crop
    of ``IMG_SIZE``; without it a resize straight to ``IMG_SIZE x IMG_SIZE``; then ToTensor and
    Normalize. For ``IMG_SIZE <= 32`` the official code does not resize at all (CIFAR images already
    have the size); here images are resized to ``IMG_SIZE x IMG_SIZE``, which leaves images of that
    size unchanged and lets other sizes be batched. It is built by timm's ``create_transform`` from
    :func:`eval_data_config`, the pipeline of ``polaformer eval`` and of timm's own data config.
    """
    from timm.data import create_transform, resolve_data_config

    size = _img_size(cfg)
    mode = _interpolation(cfg)
    normalisation = model_normalisation(cfg.MODEL.NAME)
    if is_train:
        aug = cfg.AUG
        jitter = aug.COLOR_JITTER
        auto_augment = aug.AUTO_AUGMENT
        transform = create_transform(
            input_size=size,
            is_training=True,
            color_jitter=jitter if jitter else None,
            auto_augment=None if not auto_augment or str(auto_augment).lower() == "none" else auto_augment,
            re_prob=aug.REPROB,
            re_mode=aug.REMODE,
            re_count=aug.RECOUNT,
            interpolation=mode,
            **normalisation,
        )
        return _small_image_crop(transform, size)

    data_config = resolve_data_config(args={**eval_data_config(size, interpolation=mode, crop=bool(cfg.TEST.CROP)),
                                            **normalisation})
    return create_transform(**data_config, is_training=False)


def model_normalisation(name: str) -> dict:
    """``{'mean', 'std'}`` of the timm model ``name`` (its registered ``pretrained_cfg``, a ``.tag`` included),
    ImageNet's for a name timm does not know."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from timm.models import get_pretrained_cfg

    pretrained = get_pretrained_cfg(name) if name else None
    if pretrained is None:
        return {"mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD}
    return {"mean": tuple(pretrained.mean), "std": tuple(pretrained.std)}


def _small_image_crop(transform, size: int):
    """CIFAR style for ``size <= 32``: the random resized crop becomes ``RandomCrop(size, padding=4)``."""
    if size <= SMALL_IMAGE_SIZE:
        # pad_if_needed only matters for images smaller than size - 8, where the official transform would fail
        transform.transforms[0] = transforms.RandomCrop(size, padding=4, pad_if_needed=True)
    return transform


def model_transforms(model, *, augment: bool = True):
    """``(train, eval, image_shape)``: transforms for a built timm ``model`` from its own data config (timm's
    ``resolve_model_data_config``: interpolation, mean/std, crop), at the size the model was built for.

    The size is the patch embedding's ``img_size`` where the model has one (an ``img_size=`` argument
    changes it, not ``pretrained_cfg``), else ``pretrained_cfg``'s. Training: timm's random resized crop
    (CIFAR style for sizes up to 32, as :func:`build_transform`), flip and colour jitter, or the
    evaluation transform when ``augment`` is false; evaluation: as :func:`eval_data_config` for the
    small sizes (no crop), else the model's own crop.
    """
    from timm.data import create_transform, resolve_model_data_config

    config = resolve_model_data_config(model)
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if built is not None:
        size = tuple(built) if isinstance(built, (tuple, list)) else (built, built)
        config["input_size"] = (config["input_size"][0], *size)
    size = max(config["input_size"][1:])
    if size <= SMALL_IMAGE_SIZE:
        config["crop_pct"] = 1.0
    eval_transform = create_transform(**config, is_training=False)
    if not augment:
        return eval_transform, eval_transform, config["input_size"]
    train = {key: config[key] for key in ("input_size", "interpolation", "mean", "std")}
    return _small_image_crop(create_transform(**train, is_training=True), size), eval_transform, config["input_size"]


def mixup_active(cfg) -> bool:
    """Whether the official code would use Mixup/CutMix (and so soft targets) for this config."""
    aug = cfg.AUG
    return bool(aug.MIXUP > 0 or aug.CUTMIX > 0 or aug.CUTMIX_MINMAX is not None)


def build_mixup(cfg, num_classes: int):
    """timm ``Mixup`` with the ``AUG.*`` settings and ``MODEL.LABEL_SMOOTHING``; ``None`` when off.

    Off means ``AUG.MIXUP == 0``, ``AUG.CUTMIX == 0`` and ``AUG.CUTMIX_MINMAX`` unset, as the
    official code. When it is on, targets become soft (``(B, num_classes)`` probabilities with the
    label smoothing folded in) and the loss must be ``timm.loss.SoftTargetCrossEntropy``; the batch
    size must be even (see ``collate_skip_corrupt(even=True)``).
    """
    from timm.data import Mixup

    if not mixup_active(cfg):
        return None
    aug = cfg.AUG
    minmax = aug.CUTMIX_MINMAX
    return Mixup(
        mixup_alpha=aug.MIXUP,
        cutmix_alpha=aug.CUTMIX,
        cutmix_minmax=tuple(minmax) if minmax is not None else None,
        prob=aug.MIXUP_PROB,
        switch_prob=aug.MIXUP_SWITCH_PROB,
        mode=aug.MIXUP_MODE,
        label_smoothing=cfg.MODEL.LABEL_SMOOTHING,
        num_classes=num_classes,
    )


def build_folder_datasets(cfg, *, is_distributed: bool = False):
    """``(train_set, val_set, num_classes)`` for ``cfg.DATA.DATA_PATH`` with ``train/`` and ``val/``.

    Both sets are ``ImageFolderDataset``s with ``build_transform`` applied; their ``collate_fn``
    attribute is ``collate_skip_corrupt`` bound to the image shape (and, for the training set, to
    ``even=True`` when Mixup/CutMix is on). Raises ``DatasetError`` for a missing or unset folder,
    a class folder without images, no images, a single class, train/val class lists that differ, or
    training images none of which decodes (see ``ImageFolderDataset.check_readable``). With
    ``is_distributed`` only rank 0 logs the summary (every rank scans, and fails, alike).
    """
    data_path = cfg.DATA.DATA_PATH
    if not data_path:
        raise DatasetError("no data folder given: set DATA.DATA_PATH (polaformer train --data-path DIR)")
    size = _img_size(cfg)
    return open_folder(data_path, build_transform(cfg, True), build_transform(cfg, False), (3, size, size),
                       even=mixup_active(cfg), is_distributed=is_distributed)


def open_folder(data_path, train_transform, val_transform, image_shape: tuple[int, ...], *, even: bool = False,
                is_distributed: bool = False):
    """``(train_set, val_set, num_classes)`` for the folder ``data_path`` with ``train/`` and ``val/`` and
    these transforms, checked as :func:`build_folder_datasets` says; ``even``: training batches of even size."""
    data_path = os.path.expanduser(os.fspath(data_path))
    if not os.path.isdir(data_path):
        raise DatasetError(f"data folder not found: {data_path}")
    roots = {split: os.path.join(data_path, split) for split in ("train", "val")}
    missing = [path for path in roots.values() if not os.path.isdir(path)]
    if missing:
        raise DatasetError(
            f"missing folder{'s' if len(missing) > 1 else ''} {' and '.join(missing)}: "
            f"expected {data_path}/train/<class>/<image> and {data_path}/val/<class>/<image>"
        )
    shape = tuple(image_shape)
    train_set = ImageFolderDataset(roots["train"], train_transform, image_shape=shape)
    val_set = ImageFolderDataset(roots["val"], val_transform, image_shape=shape)
    if train_set.classes != val_set.classes:
        only_train = sorted(set(train_set.classes) - set(val_set.classes))
        only_val = sorted(set(val_set.classes) - set(train_set.classes))
        parts = []
        if only_train:
            parts.append(f"{len(only_train)} only in train/ ({_listing(only_train)})")
        if only_val:
            parts.append(f"{len(only_val)} only in val/ ({_listing(only_val)})")
        raise DatasetError(
            f"train and val class folders differ in {data_path}: {'; '.join(parts)} "
            f"(train has {len(train_set.classes)} classes, val {len(val_set.classes)})"
        )
    if len(train_set.classes) < 2:
        raise DatasetError(
            f"{roots['train']} has one class folder ({train_set.classes[0]}): a classifier needs at least 2 classes"
        )
    train_set.check_readable()
    train_set.collate_fn = functools.partial(collate_skip_corrupt, image_shape=shape, even=even)
    num_classes = len(train_set.classes)
    rank0 = not is_distributed or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        logger.info(
            "data %s: %d classes, %d train images, %d val images",
            data_path, num_classes, len(train_set), len(val_set),
        )
    return train_set, val_set, num_classes
