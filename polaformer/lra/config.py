"""LRA run configuration: one YAML file per task (``configs/lra/``), strict keys, CLI overrides.

A file has four top-level keys::

    task: listops                  # listops | text | retrieval | image | pathfinder
    attention: softmax             # any name of polaformer.lra.attention.ATTENTIONS
    attention_options: {}          # that attention's own options (alpha, gate_init, num_landmarks...)
    model: {dim: 64, ...}          # LRAModelConfig fields other than the task's vocabulary/classes/length
    train: {batch_size: 32, ...}   # TrainSettings

Unknown keys are an error naming the valid ones, so a typo never silently falls back to a default.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ..engine.config import load_yaml

__all__ = ["LRAConfigError", "TrainSettings", "LRAConfig", "load_lra_config", "MODEL_KEYS", "RECIPES"]

# LRAModelConfig fields a file may set; the task decides vocab_size, num_classes, max_len and dual.
MODEL_KEYS = ("dim", "hidden_dim", "num_heads", "head_dim", "num_layers", "dropout", "attention_dropout")


class LRAConfigError(ValueError):
    """A bad configuration file or value (one line)."""


@dataclass
class TrainSettings:
    """The optimisation recipe (Skyformer's protocol: AdamW, one-cycle linear schedule, clipping)."""

    batch_size: int = 32
    lr: float = 1e-4
    warmup_steps: int = 1000
    steps: int = 50_000
    weight_decay: float = 0.0
    adam_eps: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad_value: float = 1.0  # element-wise gradient clipping, as the Skyformer code; 0 disables
    eval_every: int = 500
    eval_batches: int = 0  # dev batches per evaluation; 0 = the whole dev split
    save_every: int = 500  # also write last.pth every N steps (evaluations always write it)
    seed: int = 42
    amp: bool = False  # bfloat16 on the CPU, float16 with a GradScaler on CUDA
    num_workers: int = 0
    limit_train: int | None = None  # keep the first N examples of a split (quick runs)
    limit_dev: int | None = None
    limit_test: int | None = None


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


@dataclass
class LRAConfig:
    task: str
    attention: str = "softmax"
    attention_options: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    train: TrainSettings = field(default_factory=TrainSettings)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["train"]["betas"] = list(self.train.betas)
        return out

    def check(self) -> None:
        from .attention import ATTENTIONS, attention_options
        from .data import TASKS

        if self.task not in TASKS:
            raise LRAConfigError(f"unknown task {self.task!r} (known: {', '.join(TASKS)})")
        if self.attention not in ATTENTIONS:
            raise LRAConfigError(f"unknown attention {self.attention!r} (known: {', '.join(ATTENTIONS)})")
        known = attention_options(self.attention)
        unknown = sorted(set(self.attention_options) - set(known))
        if unknown:
            takes = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
            raise LRAConfigError(f"unknown option(s) {', '.join(unknown)} for attention {self.attention!r}; "
                                 f"its options: {takes}")
        unknown = sorted(set(self.model) - set(MODEL_KEYS))
        if unknown:
            raise LRAConfigError(f"unknown model key(s) {', '.join(unknown)} (valid: {', '.join(MODEL_KEYS)})")
        t = self.train
        for name in ("batch_size", "steps", "eval_every", "save_every"):
            if getattr(t, name) < 1:
                raise LRAConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
        if not 0 <= t.warmup_steps < t.steps:
            raise LRAConfigError(f"train.warmup_steps must be in [0, steps={t.steps}), got {t.warmup_steps}")
        if t.lr <= 0:
            raise LRAConfigError(f"train.lr must be > 0, got {t.lr}")


_TRAIN_FIELDS = {f.name: f for f in fields(TrainSettings)}


def _coerce(name: str, value: Any, default: Any) -> Any:
    """YAML reads ``1e-4`` as a string; numbers and tuples get their field's type."""
    if value is None:
        return None
    try:
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if isinstance(default, int) or name.startswith("limit_"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise TypeError
            return int(float(value))
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            return tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise LRAConfigError(f"train.{name} must be like {default!r}, got {value!r}") from None
    return value


def train_settings(values: dict, base: TrainSettings | None = None) -> TrainSettings:
    base = base or TrainSettings()
    unknown = sorted(set(values) - set(_TRAIN_FIELDS))
    if unknown:
        raise LRAConfigError(f"unknown train key(s) {', '.join(unknown)} (valid: {', '.join(_TRAIN_FIELDS)})")
    return replace(base, **{k: _coerce(k, v, getattr(base, k)) for k, v in values.items()})


def load_lra_config(path: str | Path | None = None, *, task: str | None = None) -> LRAConfig:
    """Read a config file (or the defaults for ``task``); the file's task must agree with ``task``."""
    if path is None:
        if task is None:
            raise LRAConfigError("give a config file or a task")
        if task not in RECIPES:
            raise LRAConfigError(f"unknown task {task!r} (known: {', '.join(RECIPES)})")
        return LRAConfig(task=task, train=TrainSettings(**RECIPES[task]))
    path = Path(path)
    if not path.is_file():
        raise LRAConfigError(f"config file {path} does not exist")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise LRAConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:
        raise LRAConfigError(f"{path} is not UTF-8 text (byte {e.start})") from None
    if not isinstance(raw, dict):
        raise LRAConfigError(f"{path} must hold a mapping of keys, found {type(raw).__name__}")
    valid = ("task", "attention", "attention_options", "model", "train")
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise LRAConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(valid)})")
    file_task = raw.get("task", task)
    if file_task is None:
        raise LRAConfigError(f"{path} names no task")
    if task is not None and task != file_task:
        raise LRAConfigError(f"{path} is a config for task {file_task!r}, not {task!r}")
    for key in ("attention_options", "model", "train"):
        if not isinstance(raw.get(key) or {}, dict):
            raise LRAConfigError(f"{path}: {key} must be a mapping")
    try:
        return LRAConfig(
            task=file_task,
            attention=raw.get("attention", "softmax"),
            attention_options=dict(raw.get("attention_options") or {}),
            model=dict(raw.get("model") or {}),
            train=train_settings(raw.get("train") or {}, TrainSettings(**RECIPES.get(file_task, {}))),
        )
    except LRAConfigError as e:
        raise LRAConfigError(f"{path}: {e}") from None
