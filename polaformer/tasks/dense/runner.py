"""What ``polaformer detect`` and ``polaformer segment`` do: data from a recipe, train, evaluate, predict.

Training is a task of the one engine (:mod:`polaformer.engine.loop`): AdamW with no weight decay
on norms, biases and position tables, or, where a recipe names ``train.no_decay_keys``, on exactly the
parameters whose name holds one of them (mmcv's ``custom_keys``, as the official LightHam configs), linear
warm-up, then step decay (detection: x0.1 at the milestones) or polynomial decay (segmentation). ADE20K-layout
data is scored at mmseg's test scale (``data.test_scale``). The engine
writes ``last.pth`` every ``save_every`` steps and at each evaluation, ``best.pth`` by the key
metric (box AP, mIoU), and resumes exactly (``--resume``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ...engine.checkpoint import DENSE_KEY_METRICS, load_task_weights, read_task_checkpoint
from ...engine.config import ConfigError
from ...engine.device import place_model, resolve_device
from ...engine.distributed import ShardSampler
from ...engine.loop import Engine, LoopSettings, StepOutput, Task, train
from ...engine.optim import param_groups, unwrap
from ...engine.options import loop_kwargs, resumable_keys, section_values
from ...engine.output import claim_outputs, distinct_names, write_image
from .config import DEFAULTS
from .data import AdeSegmentation, CocoInstances, DigitScenes, RandomCrop, _load_rgb, collate
from .detection import build_detector, detection_loss, draw_predictions, evaluate_detector
from .segmentation import build_segmenter, evaluate_segmenter, segmentation_loss

__all__ = ["DenseTask", "Schedule", "detection_data", "segmentation_data", "train_task", "evaluate_checkpoint",
           "predict_images"]

NO_DECAY_NAMES = ("pos_embed", "pos_block", "relative_position_bias_table", "absolute_pos_embed", "cls_token")

_logger = logging.getLogger(__name__)

# The digit scenes have a background class for semantic segmentation (label 0), none for detection.
SEGMENT_DIGIT_CLASSES = ("background",) + DigitScenes.classes


def detection_data(data: dict, *, train: bool = True):
    """``(train set or None, validation set)``."""
    if data["format"] == "digits":
        train_set = DigitScenes("train", size=data["train_size"]) if train else None
        return train_set, DigitScenes("val", size=data["val_size"])
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


def segmentation_data(data: dict, *, train: bool = True, seed: int = 0):
    """``(train set or None, val set, num_classes, class names)``; ``seed``: of the training crops."""
    if data["format"] == "digits":
        train = DigitScenes("train", size=data["train_size"]) if train else None
        val = DigitScenes("val", size=data["val_size"])
        return train, val, len(SEGMENT_DIGIT_CLASSES), SEGMENT_DIGIT_CLASSES
    if data["format"] == "ade":
        if not data.get("root"):
            raise ConfigError("ADE20K-layout data needs data.root (--root)")
        kwargs = dict(num_classes=data["num_classes"], reduce_zero_label=data["reduce_zero_label"])
        train = (RandomCrop(AdeSegmentation(data["root"], "training", **kwargs), data["crop_size"], seed) if train
                 else None)
        val = AdeSegmentation(data["root"], "validation", **kwargs)
        return train, val, data["num_classes"], val.classes
    raise ConfigError(f"segmentation data.format must be 'digits' or 'ade', got {data['format']!r}")


def _test_scale(data: dict):
    """The scale ADE20K-layout validation images are rescaled within (mmseg's test pipeline); none for the
    digit scenes."""
    if data["format"] != "ade":
        return ()
    return tuple(data.get("test_scale", DEFAULTS["segment"]["data"]["test_scale"]))  # recipes older than the key


def _decay_groups(model: nn.Module, weight_decay: float, no_decay_keys) -> list[dict]:
    """With weight decay, then without: norms, biases and position tables, or the names holding a key."""
    if not no_decay_keys:
        return param_groups(model, weight_decay, NO_DECAY_NAMES)
    decay, no_decay = [], []
    for name, param in unwrap(model).named_parameters():
        if param.requires_grad:
            (no_decay if any(key in name for key in no_decay_keys) else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


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
                           backbone_kwargs=m["backbone_kwargs"], decoder_channels=m["decoder_channels"],
                           decoder_dropout=m.get("decoder_dropout", 0.2))  # recipes older than the key: smp's


@dataclass
class Schedule:
    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int = 0
    policy: str = "step"  # 'step': x gamma at each milestone; 'poly': (1 - t/T) ** power
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    power: float = 1.0

    def factor(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if self.policy == "poly":
            return warm * max(0.0, 1 - step / self.steps) ** self.power
        return warm * self.gamma ** sum(step >= m for m in self.milestones)


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
                    gamma=float(train["gamma"]), power=float(train["power"]))


class DenseTask(Task):
    """Detection (box AP) or semantic segmentation (mIoU) on a recipe's data."""

    resume_hint = "it holds weights only; use --backbone-weights or another --output"
    # the run's length and cadence, its workers, how the model runs (the engine options' declarations), its
    # evaluation canvases; the backbone weights only start a run
    execution_keys = resumable_keys("dense")
    resume_may_change = ("data.val_size", "model.backbone_weights")

    def __init__(self, task: str, recipe: dict, train_set, val_set, num_classes: int, classes, schedule: Schedule):
        self.name, self.recipe, self.schedule = task, recipe, schedule
        self.train_set, self.train_collate = train_set, collate
        self.val_set, self.num_classes, self.classes = val_set, num_classes, classes
        self.key_metric = DENSE_KEY_METRICS[task]
        self.best_files = {"best.pth": self.key_metric}
        self.loss_fn = detection_loss if task == "detect" else segmentation_loss
        self.config = {**recipe, "classes": list(classes), "num_classes": num_classes}

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        t = self.recipe["train"]
        # each process scores every K-th validation image; the evaluation adds up the processes' results
        self.val_loader = DataLoader(self.val_set, batch_size=t["batch_size"], collate_fn=collate,
                                     num_workers=t["num_workers"], sampler=ShardSampler(self.val_set, engine.ctx))
        if self.name == "detect":
            self.coco_gt, self.category_ids = self.val_set.coco(), self.val_set.category_ids()
        return _build(self.name, self.recipe, self.num_classes, load_weights=not resuming)

    def settings(self) -> dict:
        return self.config

    def saved_settings(self, checkpoint: dict) -> dict | None:
        saved = super().saved_settings(checkpoint)
        return upgrade_recipe(saved) if saved is not None else None

    def check_resume(self, checkpoint: dict, path: Path) -> None:
        saved = checkpoint.get("config", {})
        if saved.get("num_classes") != self.num_classes:
            raise ConfigError(f"{path} was trained for {saved.get('num_classes')} classes, the data has "
                              f"{self.num_classes}")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        wd = self.schedule.weight_decay
        groups = _decay_groups(model, wd, self.recipe["train"].get("no_decay_keys"))
        head_mult = self.recipe["train"].get("head_lr_mult", 1.0)
        if head_mult != 1.0:  # mmseg's paramwise 'head' lr_mult: the decoder learns faster than the encoder
            encoder = {id(p) for n, p in unwrap(model).named_parameters() if n.startswith("net.encoder.")}
            groups = [dict(group, params=[p for p in group["params"] if (id(p) in encoder) == is_encoder],
                           **({} if is_encoder else {"lr": self.schedule.lr * head_mult}))
                      for group in groups for is_encoder in (True, False)]
        return torch.optim.AdamW(groups, lr=self.schedule.lr, weight_decay=wd)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule.factor)

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        losses = self.loss_fn(model, batch)
        return StepOutput(sum(losses.values()), len(batch[0]))

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        if self.name == "detect":
            return evaluate_detector(model, self.val_loader, self.coco_gt, self.category_ids, engine.ctx)
        return evaluate_segmenter(model, self.val_loader, self.num_classes, _test_scale(self.recipe["data"]),
                                  engine.ctx)

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        return {"step": engine.num_updates, "train_loss": train["loss"], "lr": train["lr"], **results["model"]}

    def describe(self, record: dict, improved: bool) -> str:
        values = ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step" and isinstance(v, float))
        return f"step {record['step']}: {values}"

    def summary(self, engine: Engine) -> dict:
        metrics = {k: v for k, v in engine.history[-1].items() if k != "step"} if engine.history else {}
        return {"step": engine.num_updates, "best": engine.best.get(self.key_metric), **metrics}


def train_task(task: str, recipe: dict, output: Path, *, resume: str | None = None, overwrite: bool = False,
               device: str | None = None, progress: bool = True, allow_changed=()) -> dict:
    """Train ``task`` ('detect' or 'segment') as ``recipe`` says; returns what metrics.json holds."""
    data, train_cfg = recipe["data"], recipe["train"]
    if task == "detect":
        train_set, val_set = detection_data(data)
        num_classes, classes = train_set.num_classes, train_set.classes
    else:
        train_set, val_set, num_classes, classes = segmentation_data(data, seed=train_cfg["seed"])
    schedule = _schedule(train_cfg, max(1, len(train_set) // train_cfg["batch_size"]))
    settings = LoopSettings(
        output=Path(output), device=device or "auto", resume=resume, allow_changed=tuple(allow_changed),
        overwrite=overwrite, show_progress=progress,
        **{**loop_kwargs(section_values(train_cfg)), "steps": schedule.steps, "epochs": None,
           "eval_every": train_cfg["eval_every"] or schedule.steps},
    )
    return train(DenseTask(task, recipe, train_set, val_set, num_classes, classes, schedule), settings)


def upgrade_recipe(recipe: dict) -> dict:
    """A recipe of an earlier version (``data.batch_size``, ``data.workers``, ``train.clip_grad``) in today's
    layout, where they are engine options in ``train``."""
    data, train_cfg = dict(recipe.get("data", {})), dict(recipe.get("train", {}))
    for old, section, new in (("batch_size", data, "batch_size"), ("workers", data, "num_workers"),
                              ("clip_grad", train_cfg, "clip_grad_norm")):
        if old in section:
            train_cfg.setdefault(new, section.pop(old))
    return {**recipe, "data": data, "train": train_cfg}


def load_model(task: str, path: str, device: str | None = None):
    """The model of a ``detect``/``segment`` checkpoint (of any version), and its recipe."""
    checkpoint = read_task_checkpoint(path, task)
    config = upgrade_recipe(checkpoint["config"])
    model = _build(task, config, config["num_classes"], load_weights=False)
    load_task_weights(model, checkpoint["model"], path)
    return place_model(model, resolve_device(device or "auto"), inference=True), config


def evaluate_checkpoint(task: str, path: str, data_overrides: dict | None = None, device: str | None = None) -> dict:
    """Score a checkpoint on its recipe's validation data (or on ``data_overrides``)."""
    model, config = load_model(task, path, device)
    data = {**config["data"], **{k: v for k, v in (data_overrides or {}).items() if v is not None}}
    t = config["train"]
    loader_kwargs = dict(batch_size=t["batch_size"], collate_fn=collate, num_workers=t["num_workers"])
    if task == "detect":
        _, val_set = detection_data(data, train=False)
        if len(val_set.classes) != config["num_classes"]:
            raise ConfigError(f"the data has {len(val_set.classes)} categories, the checkpoint {config['num_classes']}")
        return evaluate_detector(model, DataLoader(val_set, **loader_kwargs), val_set.coco(), val_set.category_ids())
    _, val_set, num_classes, _ = segmentation_data(data, train=False)
    if num_classes != config["num_classes"]:
        raise ConfigError(f"the data has {num_classes} classes, the checkpoint {config['num_classes']}")
    return evaluate_segmenter(model, DataLoader(val_set, **loader_kwargs), num_classes, _test_scale(data))


def predict_images(path: str, images: list[str], out_dir: Path, *, score_threshold: float = 0.5,
                   device: str | None = None, overwrite: bool = False) -> list[Path]:
    """Draw a detector checkpoint's boxes (and masks) on each image; write ``out_dir/<stem>.png``
    (``<stem>-2.png``, ``-3``... for later images whose name is taken, so no drawing replaces another; an existing
    file is refused before anything runs, unless ``overwrite``)."""
    if not 0 <= score_threshold <= 1:
        raise ConfigError(f"the score threshold must be a number in [0, 1], got {score_threshold}")
    targets = distinct_names([Path(name).stem for name in images], out_dir, ".png")
    claim_outputs(targets, overwrite, "--out")
    model, config = load_model("detect", path, device)
    dev = next(model.parameters()).device
    written = []
    for name, target in zip(images, targets):
        image = _load_rgb(Path(name))
        with torch.no_grad():
            pred = {k: v.cpu() for k, v in model([image.to(dev)])[0].items()}
        drawn = draw_predictions(image, pred, config["classes"], score_threshold=score_threshold)
        write_image(target, drawn.permute(1, 2, 0).numpy().astype(np.uint8))
        _logger.info("%s: %d detections above %.2f -> %s", name, int((pred["scores"] >= score_threshold).sum()),
                     score_threshold, target)
        written.append(target)
    return written
