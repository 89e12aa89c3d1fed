"""Recipes for ``detect train`` and ``segment train`` on the engine's one config system: defaults, YAML
files (configs/dense/), ``--opts`` and flag overrides (:func:`polaformer.engine.config.configure`).

A recipe has sections ``model``, ``data`` and ``train`` (and ``task``, which must match the command); ``train``
holds the engine options (:mod:`polaformer.engine.options`: ``batch_size``, ``num_workers``, ``clip_grad_norm``...)
and the schedule. The defaults are the embedded CPU recipes measured in docs/dense.md (150 Mask R-CNN steps, 300
Semantic FPN steps); the files in configs/dense/ are the papers' schedules. Unknown keys and wrong types are an
error, so a typo never silently keeps a default.

``model.decoder_dropout`` (segmentation): the FPN decoder's spatial dropout (smp's default 0.2).
``train.no_decay_keys``: empty, weight decay spares norms, biases and position tables; otherwise exactly the
parameters whose name holds one of the keys (mmcv's ``paramwise_cfg.custom_keys`` with ``decay_mult=0``).
``data.test_scale`` (segmentation): ADE20K-layout images are scored as mmseg's test pipeline, rescaled within
``[long, short]`` keeping their ratio, then to a multiple of 32, the logits resized back; ``[]`` scores them
at their own size. Digit scenes are scored at their own size.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from ...engine.config import POSITIVE, POSITIVE_INT, Config, ConfigError, check_settings, configure, fraction, unit
from ...engine.steps import check_train_options, train_defaults
from ...limits import check_allocation, check_batch_memory

__all__ = ["DEFAULTS", "RULES", "check_recipe", "dense_config", "load_recipe"]

DEFAULTS = {
    "detect": {
        "model": {
            "detector": "maskrcnn", "backbone": "pola_pvt_tiny", "backbone_weights": None, "backbone_kwargs": {},
            "min_size": 128, "max_size": 128, "anchor_sizes": [16, 32, 64, 128, 256], "fpn_channels": 96,
            "roi_batch": 128,
        },
        "data": {
            "format": "digits", "train_images": None, "train_annotations": None, "val_images": None,
            "val_annotations": None, "train_size": 800, "val_size": 100,
        },
        # the engine options' values (the other options at their defaults) and the schedule
        "train": {
            "steps": None, "epochs": 1.5, "batch_size": 8, "lr": 2e-4, "weight_decay": 0.05, "warmup_steps": 50,
            "policy": "step", "milestones": [0.75], "gamma": 0.1, "power": 1.0, "save_every": 50, "no_decay_keys": [],
        },
    },
    "segment": {
        "model": {
            "decoder": "fpn", "backbone": "pola_pvt_tiny", "backbone_weights": None, "backbone_kwargs": {},
            "decoder_channels": 128, "decoder_dropout": 0.2,
        },
        "data": {
            "format": "digits", "root": None, "num_classes": 150, "reduce_zero_label": True, "crop_size": 512,
            "test_scale": [2048, 512], "train_size": 800, "val_size": 100,
        },
        "train": {
            "steps": None, "epochs": 3.0, "batch_size": 8, "lr": 1e-3, "weight_decay": 1e-3, "warmup_steps": 50,
            "policy": "poly", "milestones": [], "gamma": 0.1, "power": 0.9, "save_every": 50, "head_lr_mult": 1.0,
            "no_decay_keys": [],
        },
    },
}


def dense_config(task: str) -> Config:
    """The defaults of ``task`` ('detect' or 'segment') as a strict tree (``model.backbone_kwargs`` takes any keys)."""
    if task not in DEFAULTS:
        raise ConfigError(f"unknown dense task {task!r} (known: {', '.join(DEFAULTS)})")
    tree = copy.deepcopy(DEFAULTS[task])
    tree["model"]["backbone_kwargs"] = Config(new_allowed=True, path="model.backbone_kwargs")
    tree["train"] = train_defaults("dense", **tree["train"])
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


# the range of every numeric setting of both tasks besides the engine options (engine/config.py checks them, naming
# the key)
RULES = {
    "model.min_size": POSITIVE_INT, "model.max_size": POSITIVE_INT, "model.fpn_channels": POSITIVE_INT,
    "model.roi_batch": POSITIVE_INT, "model.anchor_sizes": POSITIVE_INT.but(optional=True),
    "model.decoder_channels": POSITIVE_INT, "model.decoder_dropout": unit(),
    "data.train_size": POSITIVE_INT, "data.val_size": POSITIVE_INT, "data.num_classes": POSITIVE_INT,
    "data.crop_size": POSITIVE_INT, "train.milestones": fraction(), "train.gamma": POSITIVE, "train.power": POSITIVE,
    "train.head_lr_mult": POSITIVE,
}


def check_recipe(cfg: Config) -> None:
    """Reject values no run can use, one line each: every key of :data:`RULES` the recipe has in its range, a
    batch of crops that fits in memory, LightHam's GroupNorm width."""
    check_settings(cfg, {key: rule for key, rule in RULES.items() if _has(cfg, key)})
    check_train_options(cfg, "dense", unsharded="detection and segmentation models")
    data = cfg.data
    if "crop_size" in data and data.format == "ade":  # each image is padded to the crop: a batch that cannot fit
        check_batch_memory(cfg.train.batch_size, 3, data.crop_size, data.crop_size, "cpu", ConfigError,
                           what=f"a batch of data.crop_size {data.crop_size} crops")
    if not all(isinstance(key, str) and key for key in cfg.train.no_decay_keys):
        raise ConfigError(
            f"train.no_decay_keys must be a list of parameter-name parts, got {cfg.train.no_decay_keys!r}")
    if cfg.task == "segment":
        if data.format == "ade":  # the evaluation's int64 confusion matrix, before a class is counted
            classes = data.num_classes
            check_allocation(f"the {classes} x {classes} confusion matrix of data.num_classes {classes}",
                             8 * classes**2, "cpu", ConfigError, "use fewer classes")
        scale = data.test_scale
        if scale and not (len(scale) == 2 and all(isinstance(side, int) and not isinstance(side, bool) and side > 0
                                                  for side in scale)):
            raise ConfigError(f"data.test_scale must be [long, short] in pixels or [], got {list(scale)!r}")
        channels = cfg.model.decoder_channels
        if cfg.model.decoder == "lightham" and channels % 32:
            raise ConfigError(f"model.decoder_channels must be a positive multiple of 32 for lightham (GroupNorm(32)), "
                              f"got {channels!r}")


def _has(cfg: Config, dotted: str) -> bool:
    section, key = dotted.split(".")
    return key in cfg[section]
