"""Evaluating a checkpoint on an ImageNet-layout folder (or tar shards), and measuring inference throughput.

``polaformer eval --data-path DIR`` and ``polaformer throughput`` are thin wrappers around
:func:`evaluate_folder_checkpoint` and :func:`measure_throughput`.

Evaluation follows the official ``validate``: the model in eval mode over ``DIR/val`` with the
official evaluation transform, cross-entropy loss, top-1 and top-5 accuracy, all averaged over
images. Unreadable images are skipped and counted, as in training. The transform is timm's
(``create_transform(**resolve_model_data_config(model))``): the models' ``pretrained_cfg`` holds the
official values (square bicubic resize to size / 0.875, centre crop), so there is one pipeline, and
a checkpoint's stored config or the command line only override its size, interpolation or crop.

Throughput follows the official ``--throughput``: the model in eval mode without gradients, one
fixed batch (random here: no data loading, no host-to-device copies), warm-up iterations, then
timed iterations between two device synchronisations; images/s = iterations × batch / seconds.

(The module is not called ``evaluate``: importing a submodule binds its name on the package, which
would hide the ``polaformer.engine.evaluate`` function of the training loop.)
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from timm.data import create_transform, resolve_model_data_config
from torch import nn
from torch.utils.data import DataLoader

from ...checkpoint import (
    ArchitectureMismatchError,
    LoadResult,
    _plain_data,
    load_checkpoint,
    read_checkpoint,
    select_weights,
    strip_wrapper_prefixes,
)
from ...data.folder import SMALL_IMAGE_SIZE, ImageFolderDataset, eval_data_config
from ...data.shards import INFO_NAMES, find_info, open_eval_split
from ...engine.device import amp_dtype, autocast, place_model, resolve_device as resolve_engine_device
from ...engine.factory import check_forward, create_model
from ...limits import check_batch_memory, check_forward_memory
from .config import OFFICIAL_MODEL_NAMES
from .train import evaluate

__all__ = [
    "EvalError",
    "FolderEvaluation",
    "Throughput",
    "evaluate_folder_checkpoint",
    "evaluate_loader",
    "eval_config",
    "eval_transform",
    "measure_throughput",
    "model_throughput",
    "resolve_device",
]

log = logging.getLogger(__name__)

DEFAULT_EVAL_BATCH_SIZE = 128  # the official DATA.BATCH_SIZE, which its validation uses too


class EvalError(ValueError):
    """A user error in an evaluation or throughput request (one line)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """The engine's device resolution, with its errors as evaluation errors."""
    return resolve_engine_device(device, EvalError)


# --- evaluation ------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_loader(model: nn.Module, loader, device: torch.device | str = "cpu", *, amp: bool = False) -> dict:
    """Top-1 / top-5 accuracy (percent), mean cross-entropy, images seen and skipped over ``loader``.

    Batches are ``(images, targets)`` or ``(images, targets, num_skipped)`` (the folder datasets'
    ``collate_skip_corrupt``); a batch whose images were all unreadable is skipped. With fewer than
    five classes, top-5 counts the top ``num_classes``.
    """
    device = torch.device(device)
    metrics = evaluate(model, loader, device, amp_dtype=amp_dtype(device, amp))
    if not metrics["images"]:
        raise EvalError("no readable images to evaluate")
    return metrics


def eval_config(model: nn.Module, img_size: int | None = None, *, interpolation: str | None = None,
                crop: bool | None = None, crop_pct: float | None = None) -> dict:
    """timm's data config for evaluating ``model``: ``resolve_model_data_config(model)`` with overrides.

    The model's ``pretrained_cfg`` gives the default (for every family the official evaluation
    transform at its size); ``img_size``, ``interpolation`` (a ``DATA.INTERPOLATION`` value) and
    ``crop`` (``TEST.CROP``) replace what they name as the official transform would set them, and
    ``crop_pct`` replaces the crop fraction (resize to the square ``floor(size / crop_pct)``, centre
    crop). Sizes up to 32 are not cropped unless ``crop_pct`` says so (as the official code).
    """
    if crop_pct is not None and not 0 < crop_pct <= 1:
        raise EvalError(f"crop_pct must be in (0, 1], got {crop_pct}")
    config = resolve_model_data_config(model)
    in_chans, size = config["input_size"][0], img_size or config["input_size"][-1]
    official = eval_data_config(size, interpolation=interpolation or config["interpolation"],
                                crop=True if crop is None else crop, in_chans=in_chans)
    config["input_size"], config["crop_mode"] = official["input_size"], "squash"
    if interpolation is not None:
        config["interpolation"] = official["interpolation"]
    if crop_pct is not None:
        config["crop_pct"] = crop_pct
    elif crop is not None or size <= SMALL_IMAGE_SIZE:
        config["crop_pct"] = official["crop_pct"]
    return config


def eval_transform(model: nn.Module, img_size: int | None = None, *, interpolation: str | None = None,
                   crop: bool | None = None, crop_pct: float | None = None):
    """timm's ``create_transform`` for :func:`eval_config` (with no overrides: exactly
    ``create_transform(**resolve_model_data_config(model))``)."""
    config = eval_config(model, img_size, interpolation=interpolation, crop=crop, crop_pct=crop_pct)
    return create_transform(**config, is_training=False)


@dataclass
class FolderEvaluation:
    metrics: dict  # top1, top5, loss, images, skipped
    arch: str
    load: LoadResult
    img_size: int
    crop: str  # how images were cropped, for the summary line
    num_classes: int
    device: torch.device


def _checkpoint_metadata(path, weights: str) -> dict:
    """The shapes of the selected weights, and the 'arch'/'model_kwargs' of our engine's checkpoints.

    Reads the file once before :func:`load_checkpoint` reads it again: a missing, unreadable or
    foreign file, or missing EMA weights, fail here, before the data folder is scanned.
    """
    checkpoint = read_checkpoint(path)
    entry, state_dict = select_weights(checkpoint, weights, path)
    meta = {"shapes": {key: tuple(value.shape) for key, value in strip_wrapper_prefixes(state_dict).items()}}
    # The training configuration, as load_checkpoint reports it (LoadResult.config).
    meta["config"] = _plain_data(checkpoint["config"]) if entry and checkpoint.get("config") is not None else None
    if isinstance(checkpoint.get("arch"), str):
        kwargs = checkpoint.get("model_kwargs")
        meta.update(arch=checkpoint["arch"], model_kwargs=dict(kwargs) if isinstance(kwargs, dict) else {})
    meta["config_model"] = _config_model_name(checkpoint.get("config"))
    if isinstance(checkpoint.get("num_classes"), int):
        meta["num_classes"] = checkpoint["num_classes"]
    names = checkpoint.get("class_names")
    if isinstance(names, list) and all(isinstance(name, str) for name in names):
        meta["class_names"] = names
    return meta


def _config_model_name(config: Any) -> str | None:
    """The timm name for a stored config's ``MODEL.NAME`` / ``MODEL.TYPE`` (official names mapped)."""
    import timm

    model = config.get("MODEL") if isinstance(config, Mapping) else None
    if not isinstance(model, Mapping):
        return None
    for name in (model.get("NAME"), model.get("TYPE")):
        if isinstance(name, str) and name:
            if timm.is_model(name):
                return name
            if name in OFFICIAL_MODEL_NAMES:
                return OFFICIAL_MODEL_NAMES[name]
    return None


def _classifier_classes(model: nn.Module, shapes: dict) -> int | None:
    """How many classes the file's weights for ``model``'s classifier have (None if unknown)."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    name = next((n for n, m in model.named_modules() if m is head and n), None) if head is not None else None
    shape = shapes.get(f"{name}.weight") if name else None
    return shape[0] if shape else None


def _config_value(config: dict | None, section: str, key: str, kind: type) -> Any:
    """``config[section][key]`` from a checkpoint's stored (official-style) config, if of ``kind``."""
    value = config.get(section, {}).get(key) if isinstance(config, dict) else None
    if kind is int and isinstance(value, bool):
        return None
    return value if isinstance(value, kind) else None


def _default_img_size(model: nn.Module, model_kwargs: dict) -> int:
    size = model_kwargs.get("img_size")
    if size is None:
        size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))[-1]
    return int(size if isinstance(size, int) else size[-1])


def _input_channels(model: nn.Module, model_kwargs: dict) -> int:
    if "in_chans" in model_kwargs:
        return int(model_kwargs["in_chans"])
    return int((getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3,))[0])


def evaluate_folder_checkpoint(
    checkpoint: str | os.PathLike,
    data_path: str | os.PathLike,
    *,
    model: str | None = None,
    model_kwargs: dict | None = None,
    weights: str = "auto",
    batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
    img_size: int | None = None,
    crop_pct: float | None = None,
    workers: int = 0,
    device: str | torch.device = "auto",
    amp: bool = False,
    allow_nonfinite: bool = False,
) -> FolderEvaluation:
    """Evaluate ``checkpoint`` on ``data_path/val`` (one sub-folder per class), or on the validation split of the
    tar shards in ``data_path`` when it holds their info file (:mod:`polaformer.data.shards`; the classes are the
    info file's, else the checkpoint's number of them).

    The model is ``model`` (a timm name; optional for our engine's checkpoints, which name theirs,
    and then it must match, and for files whose stored config's ``MODEL.NAME``/``MODEL.TYPE`` is a
    timm or official model name, as in the authors' checkpoints) built with the checkpoint's
    ``model_kwargs`` if it stores them, then ``model_kwargs``, and ``num_classes`` = the number of
    class folders; the weights load strictly through :func:`polaformer.checkpoint.load_checkpoint`
    (``weights``: ``'auto'``, ``'ema'``, ``'raw'``). The transform is :func:`eval_transform`: the
    model's timm data config, with the image size ``img_size``, else the checkpoint config's
    ``DATA.IMG_SIZE``, else the model's; interpolation and ``TEST.CROP`` from the checkpoint config
    when it has them, else the model's (for every family the official bicubic and crop); ``crop_pct``
    overrides the crop. NaN/inf weights are refused unless ``allow_nonfinite``.
    """
    data_path = Path(data_path).expanduser()
    val_dir = data_path / "val"
    if not data_path.is_dir():
        raise EvalError(f"data folder not found: {data_path}")
    shards = find_info(data_path) is not None
    if not shards and not val_dir.is_dir():
        raise EvalError(f"no val folder in {data_path}: expected {val_dir}/<class>/<image> (or tar shards listed in "
                        f"{INFO_NAMES[0]})")
    device = resolve_device(device)

    meta = _checkpoint_metadata(checkpoint, weights)
    arch = model or meta.get("arch") or meta["config_model"]
    if arch is None:
        raise EvalError(f"{checkpoint} does not name its architecture: give --model NAME")
    if model and meta.get("arch") not in (None, model):
        raise ArchitectureMismatchError(
            f"checkpoint {checkpoint} holds architecture {meta['arch']!r}, not the requested {model!r}"
        )
    kwargs = {**(meta.get("model_kwargs", {}) if meta.get("arch") == arch else {}), **(model_kwargs or {})}
    kwargs.pop("num_classes", None)
    if img_size is not None:  # before the model is built at that size, or an image decoded
        _check_eval_memory(batch_size, img_size, crop_pct, device)

    # The layout is checked first: its errors come before the model is built.
    if shards:
        val_dir = data_path
        dataset = open_eval_split(data_path, meta.get("num_classes", 1000), "the checkpoint's" if "num_classes" in meta
                                  else "ImageNet's, the file names no number")
        num_classes = dataset.num_classes
    else:
        dataset = ImageFolderDataset(str(val_dir))
        num_classes = len(dataset.classes)
    network = create_model(arch, num_classes, **kwargs)
    if _input_channels(network, kwargs) != 3:
        raise EvalError(
            f"model {arch!r} takes {_input_channels(network, kwargs)}-channel images; image folders are read as RGB"
        )
    file_classes = _classifier_classes(network, meta["shapes"])
    if file_classes is not None and file_classes != num_classes:
        raise EvalError(
            f"the classifier in {checkpoint} has {file_classes} classes but {val_dir} has {num_classes} class "
            "folders: evaluate on a folder of the classes the model was trained on"
        )
    trained = meta.get("class_names")
    if trained is not None and dataset.classes is not None and trained != dataset.classes:
        other = [f"{ours} (trained: {theirs})" for ours, theirs in zip(dataset.classes, trained) if ours != theirs]
        detail = (f"{len(other)} differ, e.g. {', '.join(other[:3])}" if other
                  else f"{len(dataset.classes)} folders, {len(trained)} classes trained")
        raise EvalError(
            f"the class folders of {val_dir} are not those {checkpoint} was trained on, so its class indices "
            f"would be scored against other classes: {detail}"
        )

    config = meta["config"]
    size = img_size or _config_value(config, "DATA", "IMG_SIZE", int) or _default_img_size(network, kwargs)
    data_config = eval_config(network, size, interpolation=_config_value(config, "DATA", "INTERPOLATION", str),
                              crop=_config_value(config, "TEST", "CROP", bool), crop_pct=crop_pct)
    _check_eval_memory(batch_size, size, data_config["crop_pct"], device)
    check_forward(network, (_input_channels(network, kwargs), size, size), arch, EvalError)
    loaded = load_checkpoint(network, checkpoint, weights=weights, allow_nonfinite=allow_nonfinite)
    dataset.transform = create_transform(**data_config, is_training=False)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        collate_fn=dataset.collate_fn, pin_memory=device.type == "cuda")
    interpolation = data_config["interpolation"]
    crop_text = "no crop" if data_config["crop_pct"] == 1 else f"crop_pct {data_config['crop_pct']:g}"
    source = f"{loaded.entry!r} weights" if loaded.entry else "state dict"
    log.info("evaluating %s (%s) on %s: %d images, %d classes, %dx%d %s, %s, device %s",
             arch, source, val_dir, len(dataset), num_classes, size, size, interpolation, crop_text, device)
    metrics = evaluate_loader(place_model(network, device, inference=True), loader, device, amp=amp)
    if metrics["skipped"]:
        log.warning("skipped %d unreadable images in %s", metrics["skipped"], val_dir)
    return FolderEvaluation(metrics, arch, loaded, size, crop_text, num_classes, device)


def _check_eval_memory(batch_size: int, size: int, crop_pct: float | None, device: torch.device) -> None:
    if crop_pct is not None and not 0 < crop_pct <= 1:
        raise EvalError(f"crop_pct must be in (0, 1], got {crop_pct}")
    check_batch_memory(batch_size, 3, size, size, device, EvalError)
    resized = math.floor(size / (crop_pct or 1.0))  # each image is resized to this square before the crop
    check_batch_memory(1, 3, resized, resized, "cpu", EvalError, what=f"an image resized for crop_pct {crop_pct:g}"
                       if crop_pct else "an image resized")


# --- throughput ------------------------------------------------------------------------------

@dataclass
class Throughput:
    images_per_s: float
    batch_size: int
    input_size: tuple[int, int, int]
    iters: int
    warmup: int
    seconds: float  # the timed iterations only
    device: torch.device
    amp: bool

    @property
    def ms_per_batch(self) -> float:
        return 1000.0 * self.seconds / self.iters


@torch.no_grad()
def measure_throughput(
    model: nn.Module,
    *,
    batch_size: int = 64,
    input_size: tuple[int, int, int] = (3, 224, 224),
    warmup: int = 10,
    iters: int = 30,
    device: str | torch.device = "auto",
    amp: bool = False,
    seed: int = 0,
) -> Throughput:
    """Images per second of ``model``'s forward pass on one fixed random batch (official ``--throughput``).

    ``warmup`` untimed iterations (allocator, cuDNN autotuning, lazy initialisation), then
    ``iters`` iterations timed with ``time.perf_counter`` between two device synchronisations
    (CUDA kernels run asynchronously: without them only the launches would be timed).
    """
    if batch_size < 1 or iters < 1 or warmup < 0:
        raise EvalError(f"need batch_size >= 1, iters >= 1, warmup >= 0 (got {batch_size}, {iters}, {warmup})")
    device = resolve_device(device)
    model = model.to(device).eval()
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn((batch_size, *input_size), generator=generator).to(device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with autocast(device, amp_dtype(device, amp)):
        for _ in range(warmup):
            model(images)
        synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            model(images)
        synchronize()
        seconds = time.perf_counter() - start
    return Throughput(
        images_per_s=iters * batch_size / seconds if seconds > 0 else math.inf,
        batch_size=batch_size, input_size=tuple(input_size), iters=iters, warmup=warmup, seconds=seconds,
        device=device, amp=amp,
    )


def model_throughput(
    arch: str,
    *,
    model_kwargs: dict | None = None,
    num_classes: int | None = None,
    img_size: int | None = None,
    **kwargs,
) -> Throughput:
    """Build ``arch`` (random weights) and :func:`measure_throughput` it at ``img_size`` (default: its own)."""
    kwargs_ = dict(model_kwargs or {})
    if num_classes is not None:
        kwargs_["num_classes"] = num_classes
    classes = kwargs_.pop("num_classes", None)
    if classes is None:
        import timm

        classes = timm.get_pretrained_cfg_value(arch, "num_classes") if timm.is_model(arch) else None
    device = resolve_device(kwargs.pop("device", "auto"))
    if img_size is not None:  # a lower bound (one channel) before the model is built
        check_batch_memory(kwargs.get("batch_size", 64), 1, img_size, img_size, device, EvalError)
    network = create_model(arch, classes if classes is not None else 1000, **kwargs_)
    size = img_size or _default_img_size(network, kwargs_)
    channels = _input_channels(network, kwargs_)
    check_batch_memory(kwargs.get("batch_size", 64), channels, size, size, device, EvalError)
    check_forward(network, (channels, size, size), arch, EvalError)
    check_forward_memory(network, kwargs.get("batch_size", 64), (channels, size, size), device, EvalError,
                         half=kwargs.get("amp", False))
    network = place_model(network, device, inference=True)
    return measure_throughput(network, input_size=(channels, size, size), device=device, **kwargs)
