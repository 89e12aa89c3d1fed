"""What a task gives the engine (:class:`Task`, and per batch :class:`StepOutput`) and how the engine runs it
(:class:`LoopSettings`, which a task's configuration fills: see :mod:`.options`).

The ``engine`` the methods of :class:`Task` receive is the running :class:`~.loop.Engine`."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from .checkpoint import load_task_weights

__all__ = ["LoopSettings", "StepOutput", "Task"]


@dataclass
class StepOutput:
    """What a task's :meth:`Task.step` returns for one batch."""

    loss: torch.Tensor
    samples: int  # samples the mean training loss counts (0 for a stand-in batch)
    # Further sums, e.g. correct predictions: numbers, or 0-d tensors left on the device until the next read.
    stats: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass
class LoopSettings:
    """How the engine trains; a task's configuration fills it."""

    output: Path
    batch_size: int
    epochs: int | None = None  # epoch mode: evaluate at each epoch's end
    steps: int | None = None  # step mode: train this many optimizer updates
    eval_every: int | None = None  # step mode: updates between evaluations (None: only at the end)
    save_every_steps: int = 0  # also write the last checkpoint every N updates (0: off)
    save_every_epochs: int = 1  # epoch mode: epochs between last checkpoints (the last one always)
    start_epoch: int = 0
    accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    amp: bool = False  # mixed precision: autocast (under FSDP its MixedPrecisionPolicy), bfloat16 on the CPU
    amp_cuda_dtype: str = "float16"
    parallel: str = "ddp"  # under torchrun: 'ddp' (replicated) or 'fsdp' (sharded, see .parallel)
    compile: bool | str | None = False  # torch.compile of the model: True (inductor), a mode, or a backend name
    grad_checkpointing: bool = False  # recompute each block's activations in the backward pass
    ema_decay: float | None = None
    seed: int = 0
    num_workers: int = 0
    pin_memory: bool = True
    device: str = "auto"
    resume: str | None = None  # 'auto' (the output folder's last checkpoint, if any) or a file
    allow_changed: tuple[str, ...] = ()  # settings (dotted keys, or a section) a resumed run may change
    overwrite: bool = False  # start afresh in a folder holding a run, replacing its files
    last_name: str = "last.pth"
    find_unused_parameters: bool = False
    print_freq: int = 0  # batches between log lines (0: none)
    read_every: int | None = None  # batches between reads of the losses (None: see Engine.read_every)
    show_progress: bool = True
    on_update: Callable[[int], None] | None = None  # called after each update (and its checkpoint)


class Task:
    """What a task gives the engine. Subclasses set the attributes and override the methods."""

    name = "task"  # stored in checkpoints as 'task'
    best_files: dict[str, str] = {"best.pth": "metric"}  # checkpoint name -> record key it maximises
    # settings (dotted keys of settings(), or sections) a resumed run may change without --allow-changed
    resume_may_change: tuple[str, ...] = ()
    # the settings of how the model runs (parallel, compile, grad checkpointing): a resumed run may change them too
    execution_keys: tuple[str, ...] = ()
    ties_improve = False  # whether an equal value replaces the best checkpoint
    resume_hint = "use another --output"  # how to start from a checkpoint the task cannot resume
    # a map-style Dataset, or a streamed IterableDataset with set_layout, set_epoch and set_start (data.shards)
    train_set: Dataset
    train_collate: Callable | None = None

    def build(self, engine, resuming: bool) -> nn.Module:
        """Build data and model (the model on the CPU); ``resuming``: weights will be loaded."""
        raise NotImplementedError

    def settings(self) -> dict | None:
        """This run's configuration as plain nested data: the engine stores it in every checkpoint as ``'config'``
        and compares it with the checkpoint's on resume (None: nothing to compare)."""
        return None

    def saved_settings(self, checkpoint: dict) -> dict | None:
        """The configuration a checkpoint was trained with (a task may fill in what older files left out)."""
        saved = checkpoint.get("config")
        return saved if isinstance(saved, Mapping) else None

    def check_resume(self, checkpoint: dict, path: Path) -> None:
        """Refuse a checkpoint of another task or of a model this run cannot continue, one line."""

    def load_weights(self, model: nn.Module, checkpoint: dict, path: Path) -> None:
        load_task_weights(model, checkpoint["model"], path)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def build_scheduler(self, optimizer: torch.optim.Optimizer, updates_per_epoch: int, total_updates: int):
        """A timm scheduler (``step_update``) or a torch one (``step`` per update)."""
        raise NotImplementedError

    def restore_scheduler(self, scheduler, state: dict) -> None:
        scheduler.load_state_dict(state)

    def step(self, model: nn.Module, batch: Any, device: torch.device) -> StepOutput:
        """Forward and loss of one training batch (run under the engine's autocast). ``model`` may be a wrapper
        (DistributedDataParallel under torchrun, torch.compile's): read the model's own attributes through
        :func:`~.optim.unwrap`."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, engine) -> dict:
        raise NotImplementedError

    def record(self, engine, train: dict, results: dict[str, dict]) -> dict:
        """The metrics.jsonl line of an evaluation; ``results`` has 'model' (and 'ema')."""
        raise NotImplementedError

    def start_message(self, engine) -> str:
        """The log line that opens the training (empty: none)."""
        return ""

    def describe(self, record: dict, improved: bool) -> str:
        """The log line of an evaluation."""
        return json.dumps(record)

    def summary(self, engine) -> dict:
        """metrics.json, rewritten after every evaluation."""
        return {"history": engine.history}

    def finish(self, engine) -> dict:
        """metrics.json at the end of the run."""
        return self.summary(engine)

    def metadata(self, engine) -> dict:
        """Entries of every checkpoint besides the training state (what rebuilds the model)."""
        return {}
