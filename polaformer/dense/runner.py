"""What ``polaformer detect`` and ``polaformer segment`` do: data from a recipe, train, evaluate, predict."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ..engine.config import ConfigError
from .data import AdeSegmentation, CocoInstances, DigitScenes, RandomCrop, _load_rgb, collate
from .detection import build_detector, detection_loss, draw_predictions, evaluate_detector
from .loop import Schedule, load_dense_checkpoint, train_steps
from .segmentation import build_segmenter, evaluate_segmenter, segmentation_loss

__all__ = ["detection_data", "segmentation_data", "train_task", "evaluate_checkpoint", "predict_images"]

_logger = logging.getLogger(__name__)

# The digit scenes have a background class for semantic segmentation (label 0), none for detection.
SEGMENT_DIGIT_CLASSES = ("background",) + DigitScenes.classes


def detection_data(data: dict, *, train: bool = True):
    """``(train set or None, validation set)``."""
    if data["format"] == "digits":
        return DigitScenes("train", size=data["train_size"]) if train else None, DigitScenes("val", size=data["val_size"])
    if data["format"] == "coco":
        for key in ("train_images", "train_annotations", "val_images", "val_annotations")[0 if train else 2:]:
            if not data.get(key):
                raise ConfigError(f"COCO-format data needs data.{key} (--{key.replace('_', '-')})")
        train = CocoInstances(data["train_images"], data["train_annotations"]) if train else None
        val = CocoInstances(data["val_images"], data["val_annotations"])
        if train is not None and train.classes != val.classes:
            raise ConfigError("the training and validation annotation files list different categories")
        return train, val
    raise ConfigError(f"detection data.format must be 'digits' or 'coco', got {data['format']!r}")


def segmentation_data(data: dict, *, train: bool = True):
    """``(train set or None, val set, num_classes, class names)``."""
    if data["format"] == "digits":
        train = DigitScenes("train", size=data["train_size"]) if train else None
        val = DigitScenes("val", size=data["val_size"])
        return train, val, len(SEGMENT_DIGIT_CLASSES), SEGMENT_DIGIT_CLASSES
    if data["format"] == "ade":
        if not data.get("root"):
            raise ConfigError("ADE20K-layout data needs data.root (--root)")
        kwargs = dict(num_classes=data["num_classes"], reduce_zero_label=data["reduce_zero_label"])
        train = RandomCrop(AdeSegmentation(data["root"], "training", **kwargs), data["crop_size"]) if train else None
        val = AdeSegmentation(data["root"], "validation", **kwargs)
        return train, val, data["num_classes"], val.classes
    raise ConfigError(f"segmentation data.format must be 'digits' or 'ade', got {data['format']!r}")


def _build(task: str, recipe: dict, num_classes: int, *, load_weights: bool = True):
    m = recipe["model"]
    weights = m["backbone_weights"] if load_weights else None
    if task == "detect":
        return build_detector(
            m["detector"], m["backbone"], num_classes, backbone_weights=weights, backbone_kwargs=m["backbone_kwargs"],
            min_size=m["min_size"], max_size=m["max_size"], anchor_sizes=m["anchor_sizes"],
            fpn_channels=m["fpn_channels"], roi_batch=m["roi_batch"],
        )
    return build_segmenter(m["decoder"], m["backbone"], num_classes, backbone_weights=weights,
                           backbone_kwargs=m["backbone_kwargs"], decoder_channels=m["decoder_channels"])


def _device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _schedule(train: dict, steps_per_epoch: int) -> Schedule:
    if train["steps"]:
        steps = int(train["steps"])
    elif train["epochs"]:
        steps = math.ceil(train["epochs"] * steps_per_epoch)
    else:
        raise ConfigError("set train.steps or train.epochs")
    if not all(0 < m < 1 for m in train["milestones"]):
        raise ConfigError(f"train.milestones are fractions of the schedule in (0, 1), got {train['milestones']}")
    milestones = tuple(int(round(m * steps)) for m in train["milestones"])
    return Schedule(steps=steps, lr=float(train["lr"]), weight_decay=float(train["weight_decay"]),
                    warmup_steps=int(train["warmup_steps"]), policy=train["policy"], milestones=milestones,
                    gamma=float(train["gamma"]), power=float(train["power"]), clip_grad=train["clip_grad"])


def train_task(task: str, recipe: dict, output: Path, *, resume: str | None = None, device: str | None = None,
               progress: bool = True):
    """Train ``task`` ('detect' or 'segment') as ``recipe`` says; returns the loop's result."""
    dev = _device(device)
    data, train_cfg = recipe["data"], recipe["train"]
    torch.manual_seed(train_cfg["seed"])
    if task == "detect":
        train_set, val_set = detection_data(data)
        num_classes, classes = train_set.num_classes, train_set.classes
    else:
        train_set, val_set, num_classes, classes = segmentation_data(data)
    model = _build(task, recipe, num_classes).to(dev)

    def make_loader(epoch: int):
        generator = torch.Generator().manual_seed(train_cfg["seed"] * 1000 + epoch)
        return DataLoader(train_set, batch_size=data["batch_size"], shuffle=True, drop_last=len(train_set) > data["batch_size"],
                          collate_fn=collate, num_workers=data["workers"], generator=generator)

    val_loader = DataLoader(val_set, batch_size=data["batch_size"], collate_fn=collate, num_workers=data["workers"])
    if task == "detect":
        coco_gt, category_ids = val_set.coco(), val_set.category_ids()
        evaluate = lambda m: evaluate_detector(m, val_loader, coco_gt, category_ids)  # noqa: E731
        loss_fn, key = detection_loss, "bbox_AP"
    else:
        evaluate = lambda m: evaluate_segmenter(m, val_loader, num_classes)  # noqa: E731
        loss_fn, key = segmentation_loss, "mIoU"
    schedule = _schedule(train_cfg, len(make_loader(0)))
    config = {**recipe, "classes": list(classes), "num_classes": num_classes}
    return train_steps(
        model, loss_fn, make_loader, schedule, output=output, task=task, config=config, evaluate=evaluate,
        key_metric=key, eval_every=train_cfg["eval_every"] or schedule.steps, save_every=train_cfg["save_every"],
        resume=resume, progress=progress,
    )


def load_model(task: str, path: str, device: str | None = None):
    """The model of a ``detect``/``segment`` checkpoint, and its recipe."""
    checkpoint = load_dense_checkpoint(path, task)
    config = checkpoint["config"]
    model = _build(task, config, config["num_classes"], load_weights=False)
    model.load_state_dict(checkpoint["model"])
    return model.to(_device(device)).eval(), config


def evaluate_checkpoint(task: str, path: str, data_overrides: dict | None = None, device: str | None = None) -> dict:
    """Score a checkpoint on its recipe's validation data (or on ``data_overrides``)."""
    model, config = load_model(task, path, device)
    data = {**config["data"], **{k: v for k, v in (data_overrides or {}).items() if v is not None}}
    loader_kwargs = dict(batch_size=data["batch_size"], collate_fn=collate, num_workers=data["workers"])
    if task == "detect":
        _, val_set = detection_data(data, train=False)
        if len(val_set.classes) != config["num_classes"]:
            raise ConfigError(f"the data has {len(val_set.classes)} categories, the checkpoint {config['num_classes']}")
        return evaluate_detector(model, DataLoader(val_set, **loader_kwargs), val_set.coco(), val_set.category_ids())
    _, val_set, num_classes, _ = segmentation_data(data, train=False)
    if num_classes != config["num_classes"]:
        raise ConfigError(f"the data has {num_classes} classes, the checkpoint {config['num_classes']}")
    return evaluate_segmenter(model, DataLoader(val_set, **loader_kwargs), num_classes)


def predict_images(path: str, images: list[str], out_dir: Path, *, score_threshold: float = 0.5,
                   device: str | None = None) -> list[Path]:
    """Draw a detector checkpoint's boxes (and masks) on each image; write ``out_dir/<stem>.png``."""
    model, config = load_model("detect", path, device)
    dev = next(model.parameters()).device
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in images:
        image = _load_rgb(Path(name))
        with torch.no_grad():
            pred = {k: v.cpu() for k, v in model([image.to(dev)])[0].items()}
        drawn = draw_predictions(image, pred, config["classes"], score_threshold=score_threshold)
        target = out_dir / f"{Path(name).stem}.png"
        Image.fromarray(drawn.permute(1, 2, 0).numpy().astype(np.uint8)).save(target)
        _logger.info("%s: %d detections above %.2f -> %s", name, int((pred["scores"] >= score_threshold).sum()),
                     score_threshold, target)
        written.append(target)
    return written
