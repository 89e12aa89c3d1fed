"""What the step-based tasks (language models, super-resolution, diffusion, LRA) share, so that each states only its
model, data, loss and evaluation.

Each such task is configured by one config tree (:class:`~.config.Config`) whose ``train`` section says how the
loop runs. Its ``train_*`` function checks the tree once, builds its :class:`StepTask` (the data) and hands both to
the engine through :func:`step_settings`; its ``load_*_model`` reads a checkpoint of one of its runs back through
:func:`load_task_model`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..checkpoint import CorruptCheckpointError
from .checkpoint import load_task_weights, read_task_checkpoint
from .config import Config, ConfigError
from .loop import Engine, LoopSettings, Task
from .parallel import check_execution

__all__ = ["EXECUTION_DEFAULTS", "EXECUTION_KEYS", "OPTIONAL_TRAIN_KEYS", "StepTask", "check_execution_keys",
           "load_task_model", "saved_config", "step_settings", "train_defaults"]

# How the engine runs the model (engine/parallel.py), in every step task's ``train`` section and the dense
# recipes': 'ddp' or 'fsdp' under torchrun; torch.compile (null/false: off, true: inductor, an inductor mode such as
# 'reduce-overhead', or a backend name such as 'eager'); gradient checkpointing of every block. None changes what is
# computed, so a resumed run may change them.
EXECUTION_DEFAULTS = {"parallel": "ddp", "compile": None, "grad_checkpointing": False}
EXECUTION_KEYS = tuple(f"train.{key}" for key in EXECUTION_DEFAULTS)

# ``train`` keys a task's configuration may have -> the LoopSettings field each sets (clipping and EMA: 0 is off)
OPTIONAL_TRAIN_KEYS = {"clip_grad_norm": "clip_grad_norm", "clip_grad_value": "clip_grad_value",
                       "ema_decay": "ema_decay", "amp": "amp", "save_every": "save_every_steps",
                       **{key: key for key in EXECUTION_DEFAULTS}}
_ZERO_IS_OFF = ("clip_grad_norm", "clip_grad_value", "ema_decay")


def train_defaults(*, steps: int, batch_size: int, eval_every: int, seed: int = 0, **task_keys: Any) -> dict:
    """A step task's default ``train`` section: what :func:`step_settings` reads (``steps``, ``batch_size``,
    ``eval_every``, ``seed``; no loader workers; ``amp`` off, which when on is bfloat16 on the CPU and float16 with a
    GradScaler on CUDA; :data:`EXECUTION_DEFAULTS`) around the task's own keys (its optimiser, schedule and
    evaluation size)."""
    return {"steps": steps, "batch_size": batch_size, **task_keys, "eval_every": eval_every, "seed": seed,
            "num_workers": 0, "amp": False, **EXECUTION_DEFAULTS}


def check_execution_keys(train: Config | dict, error: type[Exception] = ConfigError, *,
                         unsharded: str | None = None) -> None:
    """The :data:`EXECUTION_DEFAULTS` keys of a ``train`` section, one line for a value no run can use;
    ``unsharded``: the task's models, when it does not train them with ``parallel: fsdp``."""
    values = [train.get(key, default) for key, default in EXECUTION_DEFAULTS.items()]
    try:
        check_execution(*values, keys=EXECUTION_KEYS)
    except ConfigError as e:
        raise error(str(e)) from None
    if unsharded and values[0] == "fsdp":
        raise error(f"train.parallel fsdp is not supported for {unsharded}: use ddp")


def step_settings(cfg: Config, output: str | os.PathLike, *, resume: str | os.PathLike | None = None,
                  overwrite: bool = False, device: str = "auto", show_progress: bool = True, allow_changed=(),
                  on_update: Callable[[int], None] | None = None) -> LoopSettings:
    """The engine's settings of a step-based run: ``cfg.train``'s ``steps``, ``batch_size``, ``eval_every``,
    ``seed`` and ``num_workers``, and those of :data:`OPTIONAL_TRAIN_KEYS` it has; the rest from the command.

    ``resume``: ``'auto'`` (``output/last.pth`` if it exists) or a checkpoint; ``allow_changed``: settings a
    resumed run may change (see :class:`~.loop.Engine`); ``on_update(step)``: called after every update."""
    t = cfg.train
    optional = {field: t[key] for key, field in OPTIONAL_TRAIN_KEYS.items() if key in t}
    optional.update({key: optional[key] or None for key in _ZERO_IS_OFF if key in optional})
    return LoopSettings(
        output=Path(output), batch_size=t.batch_size, steps=t.steps, eval_every=t.eval_every, seed=t.seed,
        num_workers=t.num_workers, device=device, resume=None if resume is None else str(resume),
        allow_changed=tuple(allow_changed), overwrite=overwrite, show_progress=show_progress, on_update=on_update,
        **optional,
    )


class StepTask(Task):
    """A step-based task: its configuration (``cfg``) is the run's settings, compared on resume. A subclass gives
    the model, data, loss and evaluation; :meth:`opening`, :meth:`evaluation_line` and :meth:`run_summary` give
    its log lines and ``metrics.json`` the form of every other step-based task's."""

    execution_keys = EXECUTION_KEYS

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def settings(self) -> dict:
        return self.cfg.to_dict()

    def opening(self, engine: Engine, subject: str, data: str) -> str:
        """``training SUBJECT: N parameters, DATA, S steps of batch B`` (for :meth:`start_message`)."""
        t = self.cfg.train
        return (f"training {subject}: {parameter_count(engine.model)} parameters, {data}, {t.steps} steps of batch "
                f"{t.batch_size}")

    def evaluation_line(self, record: dict, improved: bool, scores: str) -> str:
        """``step K/S: SCORES`` and `` (best)`` when the record is the best yet (for :meth:`describe`)."""
        return f"step {record['step']}/{self.cfg.train.steps}: {scores}{' (best)' if improved else ''}"

    def run_summary(self, engine: Engine, subject: dict, scores: dict) -> dict:
        """``metrics.json``: what was trained (``subject``), the configuration, parameters and steps, ``scores``,
        then the history, the output folder and the time so far (for :meth:`summary`)."""
        return {**subject, "config": self.cfg.to_dict(), "parameters": parameter_count(engine.model),
                "steps": engine.num_updates, **scores, "history": engine.history, "output": str(engine.output),
                "wall_time_s": engine.elapsed}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def saved_config(checkpoint: dict, defaults: Config, check: Callable[[Config], None]) -> Config:
    """The configuration a run checkpoint was trained with: ``defaults`` (changed in place) with the checkpoint's
    ``config`` merged in, checked by ``check``."""
    saved = checkpoint["config"]
    if not isinstance(saved, Mapping):
        raise TypeError(f"its 'config' is a {type(saved).__name__}, not a tree of settings")
    defaults.merge(saved)
    check(defaults)
    return defaults


def load_task_model(path: str | os.PathLike, task: str, what: str, rebuild: Callable[[dict], tuple],
                    *, ema: bool = False) -> tuple:
    """The model a checkpoint of one of ``task``'s runs holds, in eval mode, with what ``rebuild`` returned.

    ``rebuild(checkpoint)`` returns ``(model, *more)``: the model built as the checkpoint's configuration says
    (:func:`saved_config`), on the CPU. A ``KeyError``, ``TypeError``, ``RuntimeError`` or ``ConfigError`` there
    makes the file an unusable ``WHAT`` checkpoint (one line). The weights (the EMA's with ``ema`` where the file
    has them) must fit the model exactly; NaN/inf values and casts are refused. Returns ``(model, *more)``."""
    checkpoint = read_task_checkpoint(path, task)
    try:
        model, *more = rebuild(checkpoint)
    except (KeyError, TypeError, RuntimeError, ConfigError) as e:
        raise CorruptCheckpointError(path, f"not a usable {what} checkpoint: {first_line(e)}") from None
    weights: Any = checkpoint["model_ema"] if ema and checkpoint.get("model_ema") is not None else checkpoint["model"]
    load_task_weights(model, weights, path)
    return (model.eval(), *more)
