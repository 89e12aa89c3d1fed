"""Images for the diffusion task, in [-1, 1]: scikit-learn's digits (embedded, :mod:`polaformer.data.noised`) or a
``root/<class>/<image>`` folder, held in memory; and the local ``AutoencoderKL`` of latent mode."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ...checkpoint import atomic_write
from ...data.folder import DatasetError, ImageFolderDataset
from ...data.noised import NoisedImages, digits_images
from ...engine.config import ConfigError

__all__ = ["LATENT_SCALE", "NoisedImages", "digits_images", "folder_images", "load_images", "load_vae",
           "save_samples"]

log = logging.getLogger(__name__)

LATENT_SCALE = 0.18215  # Stable Diffusion's VAE latents times this have about unit variance


def _square(image: Image.Image, size: int) -> Image.Image:
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)


def folder_images(root, image_size: int, channels: int, valid_fraction: float = 0.1, seed: int = 0):
    """A ``root/<class>/<image>`` folder as ``(train_x, train_y, valid_x, valid_y, classes)``: each image
    centre-cropped to a square and resized to ``image_size``, grey (1 channel) or RGB (3); unreadable files
    are skipped with a warning, a seeded ``valid_fraction`` of the rest is held out."""
    if channels not in (1, 3):
        raise ConfigError(f"data.channels must be 1 or 3 for image folders, got {channels}")
    if not Path(root).is_dir():
        raise DatasetError(f"image folder not found: {root}")
    dataset = ImageFolderDataset(str(root))
    images, labels = [], []
    for i in range(len(dataset)):
        image = dataset.load(i)
        if image is None:
            continue
        image = _square(image.convert("L" if channels == 1 else "RGB"), image_size)
        array = np.asarray(image, dtype=np.float32).reshape(image_size, image_size, channels)
        images.append(torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1)
        labels.append(int(dataset.targets[i]))
    if len(images) < 2:
        raise DatasetError(f"{root}: {len(images)} readable images, need at least 2 (one to hold out)")
    x, y = torch.stack(images), torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    held = max(1, int(round(len(x) * valid_fraction)))
    return x[order[held:]], y[order[held:]], x[order[:held]], y[order[:held]], list(dataset.classes)


def load_images(data_cfg):
    """``(train_x, train_y, valid_x, valid_y, num_classes)`` as ``data`` config says (``name``: digits or a
    folder)."""
    if data_cfg.name == "digits":
        if data_cfg.channels != 1:
            raise ConfigError(f"digits are grey: data.channels must be 1, got {data_cfg.channels}")
        return (*digits_images(data_cfg.image_size), 10)
    train_x, train_y, valid_x, valid_y, classes = folder_images(data_cfg.name, data_cfg.image_size,
                                                                data_cfg.channels, data_cfg.valid_fraction,
                                                                data_cfg.seed)
    return train_x, train_y, valid_x, valid_y, len(classes)


def load_vae(path):
    """A diffusers ``AutoencoderKL`` saved in a local folder (``save_pretrained``), frozen, in eval mode."""
    from diffusers import AutoencoderKL

    if not path:
        raise ConfigError("latent mode needs a local AutoencoderKL folder: set data.vae")
    if not Path(path).is_dir():
        raise ConfigError(
            f"VAE path is not a folder: {path}" if Path(path).exists() else f"VAE folder not found: {path}")
    try:
        vae = AutoencoderKL.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, EnvironmentError) as e:
        raise ConfigError(f"cannot load an AutoencoderKL from {path}: {str(e).splitlines()[0]}") from None
    return vae.eval().requires_grad_(False)


def vae_downsampling(vae) -> int:
    """How many pixels one latent cell covers per side."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def save_samples(images: torch.Tensor, labels: torch.Tensor, path, per_row: int) -> None:
    """Write images in [-1, 1] as a PNG grid (``per_row`` per row, in order) or, for a ``.safetensors`` path,
    the float images and their labels; atomically."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save

        data = save({"images": images.contiguous(), "labels": labels.contiguous()})
        atomic_write(path, lambda f: f.write(data))
        return
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    rows = -(-len(pixels) // per_row)
    pad = rows * per_row - len(pixels)
    if pad:
        pixels = torch.cat([pixels, pixels.new_zeros(pad, *pixels.shape[1:])])
    n, s, _, c = pixels.shape
    grid = pixels.reshape(rows, per_row, s, s, c).permute(0, 2, 1, 3, 4).reshape(rows * s, per_row * s, c)
    image = Image.fromarray(grid.squeeze(-1).numpy() if c == 1 else grid.numpy())

    def write(f):
        image.save(f, format="PNG")

    atomic_write(path, write)
