"""LRA run configuration on the engine's one config system: a YAML file per task (``configs/lra/``),
strict keys and types, ``KEY VALUE`` overrides (:func:`polaformer.engine.config.configure`).

The tree has five top-level keys::

    task: listops                  # listops | text | retrieval | image | pathfinder
    attention: softmax             # any name of polaformer.tasks.lra.attention.ATTENTIONS
    attention_options: {}          # that attention's own options (alpha, gate_init, num_landmarks...)
    model: {dim: 64, ...}          # the model's sizes (MODEL_DEFAULTS); the task decides vocabulary, classes, length
    train: {batch_size: 32, ...}   # the engine options (polaformer.engine.options) at TRAIN_DEFAULTS, then the task's
                                   # RECIPES entry

Unknown keys are an error naming the valid ones, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ...engine.config import COUNT, POSITIVE, POSITIVE_INT, Config, ConfigError, check_settings, configure, unit
from ...engine.steps import check_train_options, train_defaults

__all__ = ["LRAConfigError", "MODEL_DEFAULTS", "RECIPES", "RULES", "TRAIN_DEFAULTS", "check_lra_config", "lra_config",
           "load_lra_config"]


class LRAConfigError(ConfigError):
    """A bad configuration file or value (one line)."""


# The model's sizes a file may set (the Skyformer protocol's LRA model).
MODEL_DEFAULTS = dict(dim=64, hidden_dim=128, num_heads=2, head_dim=32, num_layers=2, dropout=0.1,
                      attention_dropout=0.1)

# The optimisation recipe (Skyformer's protocol: AdamW, one-cycle linear schedule, clipping): the values of the
# engine options and the task's own keys of the ``train`` section (:func:`lra_config` adds the other options).
TRAIN_DEFAULTS = dict(
    steps=50_000,
    batch_size=32,
    eval_every=500,
    seed=42,
    lr=1e-4,
    warmup_steps=1000,
    weight_decay=0.0,
    adam_eps=1e-6,
    betas=(0.9, 0.999),
    clip_grad_value=1.0,  # element-wise gradient clipping, as the Skyformer code; 0 disables
    eval_batches=0,  # dev batches per evaluation; 0 = the whole dev split
    save_every=500,  # also write last.pth every N steps (evaluations always write it)
    limit_train=None,  # keep the first N examples of a split (quick runs)
    limit_dev=None,
    limit_test=None,
)

# Per-task recipes (PolaFormer paper A.2 on the Skyformer protocol; configs/lra/*.yaml hold the same
# values, a test keeps them equal). eval_batches is Skyformer's num_eval_steps. The paper trains
# Pathfinder at 5e-4; the Skyformer config has 2e-4.
RECIPES: dict[str, dict] = {
    "listops": dict(batch_size=32, lr=1e-4, warmup_steps=1000, eval_every=500, eval_batches=62, save_every=500),
    "text": dict(batch_size=32, lr=1e-4, warmup_steps=80, eval_every=500, eval_batches=200, save_every=500),
    "retrieval": dict(batch_size=16, lr=2e-4, warmup_steps=800, eval_every=1000, eval_batches=300, save_every=1000),
    "image": dict(batch_size=256, lr=1e-4, warmup_steps=175, eval_every=50, eval_batches=20, save_every=50),
    "pathfinder": dict(batch_size=128, lr=5e-4, warmup_steps=312, eval_every=500, eval_batches=156, save_every=500),
}


# the range of every numeric setting besides the engine options (engine/config.py checks them, naming the key)
RULES = {
    **{f"model.{name}": POSITIVE_INT for name in ("dim", "hidden_dim", "num_heads", "head_dim", "num_layers")},
    "model.dropout": unit(), "model.attention_dropout": unit(),
    "train.eval_batches": COUNT.but(note="0: all"),
    **{f"train.limit_{split}": POSITIVE_INT.but(optional=True) for split in ("train", "dev", "test")},
    "train.adam_eps": POSITIVE, "train.betas": unit(),
}


def lra_config(task: str, values: Mapping | None = None) -> Config:
    """The defaults of ``task`` (its recipe), with ``values`` (a nested mapping) merged in."""
    if task not in RECIPES:
        raise LRAConfigError(f"unknown task {task!r} (known: {', '.join(RECIPES)})")
    cfg = Config({
        "task": task,
        "attention": "softmax",
        "attention_options": Config(new_allowed=True, path="attention_options"),
        "model": dict(MODEL_DEFAULTS),
        "train": train_defaults("lra", **{**TRAIN_DEFAULTS, **RECIPES[task]}),
    })
    if values:
        cfg.merge(values)
    if cfg.task != task:
        raise LRAConfigError(f"this is a config for task {cfg.task!r}, not {task!r}")
    return cfg


def _file_task(path: str | os.PathLike) -> str | None:
    """The ``task`` a file (or its BASE files) names, read with the engine's strict reader."""
    probe = Config({"task": None}, new_allowed=True)
    configure(probe, path)
    return probe.task


def load_lra_config(path: str | os.PathLike | None = None, *, task: str | None = None, opts: Sequence[str] = (),
                    overrides: Mapping[str, Any] | None = None, check: bool = True) -> Config:
    """Defaults of the task, then the file at ``path``, then ``opts``, then ``overrides`` (``{'train.lr': 1e-4}``,
    from command-line flags); the file's task must agree with ``task``. Every key and type is checked
    (:func:`check_lra_config`), unless ``check`` is false (a caller that changes the configuration further and
    hands it to :func:`~polaformer.tasks.lra.train.train_lra`, which checks it)."""
    file_task = _file_task(path) if path is not None else None
    if file_task is not None and not isinstance(file_task, str):
        raise LRAConfigError(f"{path}: task must be a name, got {file_task!r}")
    if task is not None and file_task is not None and task != file_task:
        raise LRAConfigError(f"{path} is a config for task {file_task!r}, not {task!r}")
    chosen = file_task or task
    if chosen is None:
        raise LRAConfigError(f"{path} names no task" if path is not None else "give a config file or a task")
    return configure(lra_config(chosen), path, opts, overrides, check=check_lra_config if check else None)


def check_lra_config(cfg: Config) -> None:
    """Reject settings the LRA task cannot run with, one line each."""
    from .attention import ATTENTIONS, attention_options

    if cfg.attention not in ATTENTIONS:
        raise LRAConfigError(f"unknown attention {cfg.attention!r} (known: {', '.join(ATTENTIONS)})")
    known = attention_options(cfg.attention)
    unknown = sorted(set(cfg.attention_options) - set(known))
    if unknown:
        takes = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
        raise LRAConfigError(f"unknown option(s) {', '.join(unknown)} for attention {cfg.attention!r}; "
                             f"its options: {takes}")
    check_settings(cfg, RULES, LRAConfigError)
    t = cfg.train
    check_train_options(cfg, "lra", LRAConfigError, unsharded="the LRA models (small enough to replicate)")
    if not t.warmup_steps < t.steps:
        raise LRAConfigError(f"train.warmup_steps must be in [0, steps={t.steps}), got {t.warmup_steps}")
    if len(t.betas) != 2:
        raise LRAConfigError(f"train.betas must be two numbers in [0, 1), got {list(t.betas)}")
