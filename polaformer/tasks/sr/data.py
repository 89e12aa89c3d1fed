"""Super-resolution data: image pairs (an HR folder degraded by bicubic downscaling, or HR/LR folder pairs, or the
photos that ship with scikit-image and scikit-learn) and random aligned training patches.

Images are kept as uint8 RGB tensors (3, H, W) until a batch is made; the model sees floats in [0, 1].
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ...data.folder import DatasetError
from ...engine.distributed import SampleDraws
from ...engine.output import write_image
from ...files import read_image_or_raise

__all__ = ["IMAGE_SUFFIXES", "PHOTOS", "ImagePair", "RandomPatches", "bicubic_downscale", "embedded_photo",
           "folder_pairs", "image_to_tensor", "photo_pairs", "read_image", "save_image"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
# the colour photos of scikit-image (``skimage.data``) and scikit-learn (``load_sample_images``), by split
PHOTOS = {
    "train": ("astronaut", "rocket", "immunohistochemistry", "hubble_deep_field", "retina", "china"),
    "valid": ("chelsea", "coffee", "flower"),
}


def image_to_tensor(array: np.ndarray) -> torch.Tensor:
    """(H, W[, C]) uint8 array → (3, H, W) uint8 tensor (grey repeated, alpha dropped)."""
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.dtype != np.uint8:
        raise DatasetError(f"expected an 8-bit (H, W) or (H, W, C) image, got {array.dtype} of shape {array.shape}")
    tensor = torch.from_numpy(np.array(array, copy=True)).permute(2, 0, 1)  # skimage and PIL arrays are read-only
    return tensor.expand(3, -1, -1).contiguous() if tensor.shape[0] == 1 else tensor[:3].contiguous()


def read_image(path: Path) -> torch.Tensor:
    """An image file as a (3, H, W) uint8 tensor; an unreadable file (not a regular file, not an image, a
    decompression bomb) is a one-line :class:`DatasetError`."""
    with read_image_or_raise(path, DatasetError) as image:
        return image_to_tensor(np.asarray(image.convert("RGB")))


def save_image(image: torch.Tensor, path: Path) -> None:
    """Write a (3, H, W) uint8 tensor atomically; the format follows the suffix."""
    write_image(path, image.permute(1, 2, 0).cpu().numpy())


def bicubic_downscale(hr: torch.Tensor, scale: int) -> torch.Tensor:
    """The LR image of a (3, H, W) uint8 ``hr`` whose sides are multiples of ``scale``: antialiased bicubic
    (a close stand-in for MATLAB's ``imresize``, which made the benchmark LR images), rounded to uint8."""
    h, w = hr.shape[-2:]
    if h % scale or w % scale:
        raise DatasetError(f"an HR image of {w}x{h} is not a multiple of the scale {scale}")
    lr = F.interpolate(hr[None].double(), size=(h // scale, w // scale), mode="bicubic", antialias=True,
                       align_corners=False)
    return lr[0].round().clamp(0, 255).to(torch.uint8)


@dataclass
class ImagePair:
    """One evaluation or training image: its name, HR (cropped to ``scale``× the LR) and LR."""

    name: str
    hr: torch.Tensor
    lr: torch.Tensor


def _mod_crop(hr: torch.Tensor, scale: int) -> torch.Tensor:
    h, w = hr.shape[-2:]
    return hr[:, :h - h % scale, :w - w % scale]


def _pair_from_hr(name: str, hr: torch.Tensor, scale: int) -> ImagePair:
    hr = _mod_crop(hr, scale)
    if min(hr.shape[-2:]) < scale:
        raise DatasetError(f"image {name} of {hr.shape[-1]}x{hr.shape[-2]} is smaller than the scale {scale}")
    return ImagePair(name, hr, bicubic_downscale(hr, scale))


def _images(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DatasetError(f"image folder {folder} " + ("is not a folder" if folder.exists() else "does not exist"))
    # regular files only: a FIFO named like an image would block the read forever
    files = sorted(p for p in folder.iterdir()
                   if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file())
    if not files:
        raise DatasetError(f"no images in {folder} (looked for {', '.join(IMAGE_SUFFIXES)})")
    return files


def _lr_partner(hr_path: Path, lr_files: dict[str, Path], scale: int, lr_folder: Path) -> Path:
    for stem in (hr_path.stem, f"{hr_path.stem}x{scale}", f"{hr_path.stem}_LRBI_x{scale}"):
        if stem in lr_files:
            return lr_files[stem]
    raise DatasetError(f"no LR image for {hr_path.name} in {lr_folder} (looked for {hr_path.stem}, "
                       f"{hr_path.stem}x{scale} or {hr_path.stem}_LRBI_x{scale} with an image suffix)")


def folder_pairs(hr_folder, scale: int, lr_folder=None) -> list[ImagePair]:
    """Pairs from ``hr_folder``: LR images made by :func:`bicubic_downscale`, or read from ``lr_folder`` (matched
    by name, DIV2K's ``0001x4`` and Manga109's ``_LRBI_x4`` suffixes included). An HR image is cropped to
    ``scale``× its LR one; any other size difference is a scale mismatch and an error."""
    pairs = []
    hr_files = _images(Path(hr_folder))
    lr_files = {p.stem: p for p in _images(Path(lr_folder))} if lr_folder else {}
    for hr_path in hr_files:
        hr = read_image(hr_path)
        if not lr_folder:
            pairs.append(_pair_from_hr(hr_path.stem, hr, scale))
            continue
        lr_path = _lr_partner(hr_path, lr_files, scale, Path(lr_folder))
        lr = read_image(lr_path)
        (h, w), (lh, lw) = hr.shape[-2:], lr.shape[-2:]
        if h // scale != lh or w // scale != lw:
            raise DatasetError(f"{lr_path.name} is {lw}x{lh} but {hr_path.name} is {w}x{h}: "
                               f"not a x{scale} pair (scale mismatch?)")
        pairs.append(ImagePair(hr_path.stem, hr[:, :lh * scale, :lw * scale], lr))
    return pairs


def embedded_photo(name: str) -> torch.Tensor:
    """A photo that ships with scikit-image (``skimage.data.NAME``) or scikit-learn (``china``, ``flower``)."""
    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        return image_to_tensor(load_sample_image(f"{name}.jpg"))
    import skimage.data

    return image_to_tensor(getattr(skimage.data, name)())


def photo_pairs(split: str, scale: int) -> list[ImagePair]:
    """The embedded photos of ``split`` (``train`` or ``valid``, see :data:`PHOTOS`) with bicubic LR images."""
    if split not in PHOTOS:
        raise DatasetError(f"the embedded photos have the splits {', '.join(PHOTOS)}, not {split!r}")
    return [_pair_from_hr(name, embedded_photo(name), scale) for name in PHOTOS[split]]


class RandomPatches(SampleDraws, Dataset):
    """Aligned random crops of ``pairs``: an LR patch of ``patch_size // scale`` pixels and its HR patch,
    flipped and rotated at random (basicsr's ``use_hflip``/``use_rot``), as floats in [0, 1].

    One pass holds ``repeats`` crops of every image (basicsr's ``dataset_enlarge_ratio``). A crop is drawn from
    (``seed``, epoch, index) (:class:`~polaformer.engine.distributed.SampleDraws`): the same for any process count.
    """

    def __init__(self, pairs: list[ImagePair], scale: int, patch_size: int, repeats: int = 100, seed: int = 0):
        super().__init__(seed)
        if patch_size % scale:
            raise DatasetError(f"the HR patch size {patch_size} is not a multiple of the scale {scale}")
        self.pairs, self.scale, self.lr_patch, self.repeats = pairs, scale, patch_size // scale, repeats
        for pair in pairs:
            lh, lw = pair.lr.shape[-2:]
            if min(lh, lw) < self.lr_patch:
                raise DatasetError(f"image {pair.name} has an LR size of {lw}x{lh}, smaller than the LR patch "
                                   f"{self.lr_patch}x{self.lr_patch} (HR patch {patch_size}, scale {scale})")

    def __len__(self) -> int:
        return len(self.pairs) * self.repeats

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.pairs[index % len(self.pairs)]
        p, s = self.lr_patch, self.scale
        lh, lw = pair.lr.shape[-2:]
        generator = self.generator(index)
        top, left = (int(torch.randint(0, n - p + 1, (), generator=generator)) for n in (lh, lw))
        lr = pair.lr[:, top:top + p, left:left + p]
        hr = pair.hr[:, top * s:(top + p) * s, left * s:(left + p) * s]
        flip, vflip, transpose = (bool(torch.randint(0, 2, (), generator=generator)) for _ in range(3))
        if flip:
            lr, hr = lr.flip(-1), hr.flip(-1)
        if vflip:
            lr, hr = lr.flip(-2), hr.flip(-2)
        if transpose:
            lr, hr = lr.transpose(-1, -2), hr.transpose(-1, -2)
        return lr.float() / 255, hr.float() / 255
