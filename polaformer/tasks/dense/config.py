"""Recipes for ``detect train`` and ``segment train`` on the engine's one config system: defaults, YAML
files (configs/dense/), ``--opts`` and flag overrides (:func:`polaformer.engine.config.configure`).

A recipe has sections ``model``, ``data`` and ``train`` (and ``task``, which must match the command). The
defaults are the embedded CPU recipes measured in docs/dense.md (150 Mask R-CNN steps, 300 Semantic FPN
steps); the files in configs/dense/ are the papers' schedules. Unknown keys and wrong types are an error,
so a typo never silently keeps a default.

``train.no_decay_keys``: empty, weight decay spares norms, biases and position tables; otherwise exactly the
parameters whose name holds one of the keys (mmcv's ``paramwise_cfg.custom_keys`` with ``decay_mult=0``).
``data.test_scale`` (segmentation): ADE20K-layout images are scored as mmseg's test pipeline, rescaled within
``[long, short]`` keeping their ratio, then to a multiple of 32, the logits resized back; ``[]`` scores them
at their own size. Digit scenes are scored at their own size.
"""
from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence

from ...engine.config import Config, ConfigError, configure
from ...engine.limits import check_batch_memory

__all__ = ["DEFAULTS", "check_recipe", "dense_config", "load_recipe"]

DEFAULTS = {
    "detect": {
        "model": {
            "detector": "maskrcnn", "backbone": "pola_pvt_tiny", "backbone_weights": None, "backbone_kwargs": {},
            "min_size": 128, "max_size": 128, "anchor_sizes": [16, 32, 64, 128, 256], "fpn_channels": 96,
            "roi_batch": 128,
        },
        "data": {
            "format": "digits", "train_images": None, "train_annotations": None, "val_images": None,
            "val_annotations": None, "train_size": 800, "val_size": 100, "batch_size": 8, "workers": 0,
        },
        "train": {
            "steps": None, "epochs": 1.5, "lr": 2e-4, "weight_decay": 0.05, "warmup_steps": 50, "policy": "step",
            "milestones": [0.75], "gamma": 0.1, "power": 1.0, "clip_grad": None, "eval_every": None,
            "save_every": 50, "seed": 0, "no_decay_keys": [],
        },
    },
    "segment": {
        "model": {
            "decoder": "fpn", "backbone": "pola_pvt_tiny", "backbone_weights": None, "backbone_kwargs": {},
            "decoder_channels": 128,
        },
        "data": {
            "format": "digits", "root": None, "num_classes": 150, "reduce_zero_label": True, "crop_size": 512,
            "test_scale": [2048, 512], "train_size": 800, "val_size": 100, "batch_size": 8, "workers": 0,
        },
        "train": {
            "steps": None, "epochs": 3, "lr": 1e-3, "weight_decay": 1e-3, "warmup_steps": 50, "policy": "poly",
            "milestones": [], "gamma": 0.1, "power": 0.9, "clip_grad": None, "eval_every": None, "save_every": 50,
            "seed": 0, "head_lr_mult": 1.0, "no_decay_keys": [],
        },
    },
}


def dense_config(task: str) -> Config:
    """The defaults of ``task`` ('detect' or 'segment') as a strict tree (``model.backbone_kwargs`` takes any keys)."""
    if task not in DEFAULTS:
        raise ConfigError(f"unknown dense task {task!r} (known: {', '.join(DEFAULTS)})")
    tree = copy.deepcopy(DEFAULTS[task])
    tree["model"]["backbone_kwargs"] = Config(new_allowed=True, path="model.backbone_kwargs")
    return Config({"task": task, **tree})


def load_recipe(task: str, path: str | os.PathLike | None = None, overrides: dict | None = None,
                opts: Sequence[str] = ()) -> dict:
    """Defaults < the YAML file (with its BASE files) < ``opts`` (``KEY VALUE`` pairs) < ``overrides``
    (``{'train.lr': 1e-4, ...}`` from command-line flags, None values skipped), checked key by key and
    type by type by the engine's config system; returned as plain nested dicts."""
    cfg = configure(dense_config(task), path, opts)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            cfg.set_path(dotted, value, source="the command line")
    if cfg.task != task:
        raise ConfigError(f"{path} is a {cfg.task!r} recipe, not a {task!r} one")
    check_recipe(cfg)
    recipe = cfg.to_dict()
    del recipe["task"]
    return recipe


def check_recipe(cfg: Config) -> None:
    """Reject values no run can use, one line each."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    train, data = cfg.train, cfg.data
    if not (number(train.lr) and train.lr > 0):
        raise ConfigError(f"train.lr must be a finite number > 0, got {train.lr!r}")
    if not (number(train.weight_decay) and train.weight_decay >= 0):
        raise ConfigError(f"train.weight_decay must be a finite number >= 0, got {train.weight_decay!r}")
    if train.steps is not None and not (count(train.steps) and train.steps >= 1):
        raise ConfigError(f"train.steps must be a positive integer or null, got {train.steps!r}")
    if train.epochs is not None and not (number(train.epochs) and train.epochs > 0):
        raise ConfigError(f"train.epochs must be a finite number > 0 or null, got {train.epochs!r}")
    if train.clip_grad is not None and not (number(train.clip_grad) and train.clip_grad > 0):
        raise ConfigError(f"train.clip_grad must be a finite number > 0 or null, got {train.clip_grad!r}")
    if train.eval_every is not None and not (count(train.eval_every) and train.eval_every >= 1):
        raise ConfigError(f"train.eval_every must be a positive integer or null, got {train.eval_every!r}")
    for name in ("warmup_steps", "seed"):
        if not (count(train[name]) and train[name] >= 0):
            raise ConfigError(f"train.{name} must be an integer >= 0, got {train[name]!r}")
    if not (count(train.save_every) and train.save_every >= 1):
        raise ConfigError(f"train.save_every must be a positive integer, got {train.save_every!r}")
    if not (count(data.batch_size) and data.batch_size >= 1):
        raise ConfigError(f"data.batch_size must be a positive integer, got {data.batch_size!r}")
    if not (count(data.workers) and data.workers >= 0):
        raise ConfigError(f"data.workers must be an integer >= 0, got {data.workers!r}")
    if "crop_size" in data:
        if not (count(data.crop_size) and data.crop_size >= 1):
            raise ConfigError(f"data.crop_size must be a positive integer, got {data.crop_size!r}")
        if data.format == "ade":  # each image is padded to the crop: a batch that cannot fit fails here
            check_batch_memory(data.batch_size, 3, data.crop_size, data.crop_size, "cpu", ConfigError,
                               what=f"a batch of data.crop_size {data.crop_size} crops")
    if not all(isinstance(key, str) and key for key in train.no_decay_keys):
        raise ConfigError(f"train.no_decay_keys must be a list of parameter-name parts, got {train.no_decay_keys!r}")
    if cfg.task == "segment":
        scale = data.test_scale
        if scale and not (len(scale) == 2 and all(count(side) and side > 0 for side in scale)):
            raise ConfigError(f"data.test_scale must be [long, short] in pixels or [], got {list(scale)!r}")
        if not (number(train.head_lr_mult) and train.head_lr_mult > 0):
            raise ConfigError(f"train.head_lr_mult must be a finite number > 0, got {train.head_lr_mult!r}")
        channels = cfg.model.decoder_channels
        if cfg.model.decoder == "lightham" and not (count(channels) and channels > 0 and channels % 32 == 0):
            raise ConfigError(f"model.decoder_channels must be a positive multiple of 32 for lightham (GroupNorm(32)), "
                              f"got {channels!r}")
