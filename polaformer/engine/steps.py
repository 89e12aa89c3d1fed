"""What the step-based tasks (language models, super-resolution, diffusion, LRA, conversion) share, so that each
states only its model, data, loss and evaluation.

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
from .loop import Engine
from .options import OPTIONS, check_options, loop_kwargs, resumable_keys, section_values, train_section
from .task import LoopSettings, Task

__all__ = ["EXECUTION_DEFAULTS", "EXECUTION_KEYS", "OPTIONAL_TRAIN_KEYS", "StepTask", "check_execution_keys",
           "check_train_options", "load_task_model", "saved_config", "step_settings", "train_defaults"]

# Earlier names, read from the declarations (polaformer.engine.options): how the engine runs the model, and the
# ``train`` keys that set a LoopSettings field.
EXECUTION_DEFAULTS = {option.name: option.default for option in OPTIONS
                      if option.name in ("parallel", "compile", "grad_checkpointing")}
EXECUTION_KEYS = tuple(f"train.{key}" for key in EXECUTION_DEFAULTS)
OPTIONAL_TRAIN_KEYS = {option.name: option.loop_field for option in OPTIONS if option.loop_field is not None}


def train_defaults(task: str | None = None, /, **values: Any) -> dict:
    """A step task's default ``train`` section: every engine option ``task`` has (:mod:`.options`: steps, batch
    size, learning rate, evaluation and checkpoint cadence, seed, workers, precision, parallelism...), at the value
    the task gives (``steps``, ``batch_size``, ``lr`` have none of their own) or its declared default, then the
    task's own keys (its optimiser, schedule and evaluation size)."""
    return train_section(task, values)


def check_train_options(cfg: Config, task: str | None = None, error: type[Exception] = ConfigError, *,
                        unsharded: str | None = None) -> None:
    """The engine options of ``cfg.train`` against their declarations, one line naming the key; ``unsharded``: the
    task's models, when it does not train them with ``parallel: fsdp``."""
    check_options(cfg, task, error, unsharded=unsharded)


def check_execution_keys(train: Config | dict, error: type[Exception] = ConfigError, *,
                         unsharded: str | None = None) -> None:
    """:func:`check_train_options` of a ``train`` section alone (the name of earlier versions)."""
    check_options({"train": train}, None, error, unsharded=unsharded)


def step_settings(cfg: Config, output: str | os.PathLike, *, resume: str | os.PathLike | None = None,
                  overwrite: bool = False, device: str = "auto", show_progress: bool = True, allow_changed=(),
                  on_update: Callable[[int], None] | None = None) -> LoopSettings:
    """The engine's settings of a step-based run: the engine options ``cfg.train`` holds (:func:`.options.loop_kwargs`),
    the rest from the command.

    ``resume``: ``'auto'`` (``output/last.pth`` if it exists) or a checkpoint; ``allow_changed``: settings a
    resumed run may change (see :func:`~.resume.check_same_settings`); ``on_update(step)``: called after every
    update."""
    return LoopSettings(
        output=Path(output), device=device, resume=None if resume is None else str(resume),
        allow_changed=tuple(allow_changed), overwrite=overwrite, show_progress=show_progress, on_update=on_update,
        **loop_kwargs(section_values(cfg.train)),
    )


class StepTask(Task):
    """A step-based task: its configuration (``cfg``) is the run's settings, compared on resume. A subclass gives
    the model, data, loss and evaluation; :meth:`opening`, :meth:`evaluation_line` and :meth:`run_summary` give
    its log lines and ``metrics.json`` the form of every other step-based task's."""

    execution_keys = resumable_keys(None)  # the run's length and cadence, its workers, how the model runs

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
