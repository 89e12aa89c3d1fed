"""Recipes for ``detect train`` and ``segment train``: defaults, YAML files (configs/dense/), overrides.

A recipe is a nested dict with sections ``model``, ``data`` and ``train``. The defaults are the
embedded CPU recipes measured in docs/dense.md (150 Mask R-CNN steps, 300 Semantic FPN steps); the
files in configs/dense/ are the papers' schedules. Unknown keys are an error, so a typo never silently keeps a default.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from ..engine.config import ConfigError

__all__ = ["DEFAULTS", "load_recipe"]

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
            "save_every": 50, "seed": 0,
        },
    },
    "segment": {
        "model": {
            "decoder": "fpn", "backbone": "pola_pvt_tiny", "backbone_weights": None, "backbone_kwargs": {},
            "decoder_channels": 128,
        },
        "data": {
            "format": "digits", "root": None, "num_classes": 150, "reduce_zero_label": True, "crop_size": 512,
            "train_size": 800, "val_size": 100, "batch_size": 8, "workers": 0,
        },
        "train": {
            "steps": None, "epochs": 3, "lr": 1e-3, "weight_decay": 1e-3, "warmup_steps": 50, "policy": "poly",
            "milestones": [], "gamma": 0.1, "power": 0.9, "clip_grad": None, "eval_every": None, "save_every": 50,
            "seed": 0,
        },
    },
}


def _merge(base: dict, override: dict, where: str) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key not in base:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(base))})")
        if isinstance(base[key], dict) and key != "backbone_kwargs":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key!r} must be a mapping")
            out[key] = _merge(base[key], value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def load_recipe(task: str, path: str | None = None, overrides: dict | None = None) -> dict:
    """Defaults < the YAML file < ``overrides`` (``{'train.lr': 1e-4, ...}``, None values skipped)."""
    recipe = copy.deepcopy(DEFAULTS[task])
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{file}: no such config file")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: expected a mapping with 'model', 'data' and 'train'")
        data.pop("task", None)
        recipe = _merge(recipe, data, str(file))
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, key = dotted.split(".")
        recipe = _merge(recipe, {section: {key: value}}, "option")
    return recipe
