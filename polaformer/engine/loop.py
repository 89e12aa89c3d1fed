"""The one training loop under every task (classification, detection, segmentation, LRA, language models,
super-resolution, diffusion).

A task (:class:`Task`) supplies its model, training set, optimizer, schedule, the loss of one
batch and its evaluation; :class:`Engine` does everything else, once for all tasks:

- the output folder: an exclusive lock (:class:`~.output.OutputLock`), leftovers of a killed
  write removed, a finished run never replaced unless asked (``overwrite``) or continued
  (``resume``);
- resuming continues the run the checkpoint was started as: every setting of the task's configuration
  (:meth:`Task.settings`) must equal the checkpoint's, except those the task lets change
  (:attr:`Task.resume_may_change`: the length of the run, how often it evaluates, its workers) and those
  named in ``allow_changed`` (``--allow-changed KEY``);
- the loop: epochs of a :class:`~.distributed.TrainSampler` (the same order for every process
  count; a streamed set, as :mod:`polaformer.data.shards`, orders its own samples), gradient
  accumulation, device and autocast (:mod:`.device`), a GradScaler for float16, gradient clipping
  (by norm or by value), a weight EMA, the schedule stepped per update, a progress bar;
- how the model runs (:mod:`.parallel`, one order for every task): gradient checkpointing, then under torchrun
  FSDP2 sharding (``parallel='fsdp'``, checkpoints sharded with ``torch.distributed.checkpoint``), then
  ``torch.compile``, then DDP (``parallel='ddp'``);
- evaluation every ``eval_every`` updates (or at each epoch's end), one JSON line per evaluation
  in ``metrics.jsonl``, the task's summary in ``metrics.json``;
- checkpoints (:mod:`.checkpoint`, written atomically): the last state every ``save_every_steps``
  updates and at every evaluation (per ``save_every_epochs`` in epoch mode), the best weights per
  the task's metrics; resuming restores model, EMA, optimizer, schedule, scaler, position in the
  epoch, history, best values and every process's random states, so that with
  ``num_workers = 0`` a resumed run ends bit-identical to an uninterrupted one;
- no host synchronisation per batch: the losses (and a task's tensor statistics) stay on the device and
  are read together every :attr:`Engine.read_every` batches, at log lines and before an evaluation or a
  checkpoint;
- faults: a NaN/inf loss raises :class:`TrainingDivergedError` at the next read, naming the step it first
  appeared at; Ctrl-C :class:`TrainingInterrupted` naming the last checkpoint written, a full disk a one-line
  :class:`~polaformer.checkpoint.WriteError`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import secrets
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm import tqdm

from ..checkpoint import CorruptCheckpointError, atomic_write, read_checkpoint
from .checkpoint import load_task_weights, read_training_state, save_training_state
from .config import SEED, ConfigError
from .device import amp_dtype, autocast, place_model, resolve_device
from .distributed import (SampleDraws, TrainSampler, all_gather_object, all_reduce_sum, barrier, init_distributed,
                          shutdown)
from .optim import unwrap
from .output import OutputLock
from .parallel import (SHARDED, check_execution, compile_options, gathered, load_sharded, load_whole_into_sharded,
                       new_folder_name, prepare_model, remove_unused_folders, save_sharded, sync_from_rank0)

log = logging.getLogger(__name__)

METRICS_JSONL = "metrics.jsonl"
METRICS_JSON = "metrics.json"
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # atomic_write's temporary files


READ_EVERY = 50  # batches between reads of the losses off the CPU when print_freq is 0


class TrainingDivergedError(FloatingPointError):
    """The training loss became NaN or infinite (one line)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; ``checkpoint`` is the last file saved by this run (or None)."""

    def __init__(self, checkpoint: Path | None):
        super().__init__()
        self.checkpoint = checkpoint


@dataclass
class StepOutput:
    """What a task's :meth:`Task.step` returns for one batch."""

    loss: torch.Tensor
    samples: int  # samples the mean training loss counts (0 for a stand-in batch)
    # Further sums, e.g. correct predictions: numbers, or 0-d tensors left on the device until the next read.
    stats: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass
class Window:
    """This process's training totals since the last evaluation (saved in checkpoints)."""

    loss_sum: float = 0.0
    samples: int = 0
    time: float = 0.0
    stats: dict = field(default_factory=dict)

    def add(self, samples: int, loss: float, stats: dict[str, float]) -> None:
        self.loss_sum += loss * samples
        self.samples += samples
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def to_dict(self) -> dict:
        return {"loss_sum": self.loss_sum, "samples": self.samples, "time": self.time, "stats": dict(self.stats)}


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


def flat_settings(settings: Mapping, prefix: str = "") -> dict:
    """``{'train': {'lr': 1e-3}}`` as ``{'train.lr': 1e-3}`` (lists are values)."""
    flat = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_settings(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _covered(key: str, names) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in names)


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

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
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

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        raise NotImplementedError

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        """The metrics.jsonl line of an evaluation; ``results`` has 'model' (and 'ema')."""
        raise NotImplementedError

    def start_message(self, engine: Engine) -> str:
        """The log line that opens the training (empty: none)."""
        return ""

    def describe(self, record: dict, improved: bool) -> str:
        """The log line of an evaluation."""
        return json.dumps(record)

    def summary(self, engine: Engine) -> dict:
        """metrics.json, rewritten after every evaluation."""
        return {"history": engine.history}

    def finish(self, engine: Engine) -> dict:
        """metrics.json at the end of the run."""
        return self.summary(engine)

    def metadata(self, engine: Engine) -> dict:
        """Entries of every checkpoint besides the training state (what rebuilds the model)."""
        return {}


# --- random states ---------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """This process's random number generators, as plain data (loadable with weights_only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(_tuples(state["python"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode): an atomic write replaces it with another."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def _tensorboard(folder: Path):
    """A SummaryWriter when TensorBoard is installed, else None (silently)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder / "tensorboard"))


def _advance(scheduler, num_updates: int) -> None:
    if hasattr(scheduler, "step_update"):  # timm: the rate of update num_updates
        scheduler.step_update(num_updates=num_updates)
    else:
        scheduler.step()


# --- the engine ------------------------------------------------------------------------------

class Engine:
    """One training run of ``task`` as ``settings`` say; :meth:`fit` runs it, :meth:`close` releases it."""

    def __init__(self, task: Task, settings: LoopSettings):
        if (settings.epochs is None) == (settings.steps is None):
            raise ConfigError("give a number of epochs or of steps, not both")
        SEED.check("the seed", settings.seed)
        check_execution(settings.parallel, settings.compile, settings.grad_checkpointing,
                        ("parallel", "compile", "grad_checkpointing"))
        self.task, self.settings = task, settings
        self.device = resolve_device(settings.device)
        self.lock: OutputLock | None = None
        self.last_saved: Path | None = None  # the last checkpoint this run wrote
        self.ctx = init_distributed(self.device.type)
        try:
            self._setup()
        except BaseException:
            self._release()
            shutdown(self.ctx)
            raise

    # building

    def _setup(self) -> None:
        s, ctx, task = self.settings, self.ctx, self.task
        if self.device.type == "cuda" and ctx.is_distributed:
            self.device = torch.device("cuda", ctx.local_rank)
        seed_everything(s.seed + ctx.rank)
        self.output = Path(s.output)
        if ctx.is_main:  # before anything is built: a busy or unwritable folder fails at once
            self.lock = OutputLock(self.output)
        self.resume_path = self._find_resume()
        resume = read_training_state(self.resume_path, task.name, task.resume_hint) if self.resume_path else None
        model = task.build(self, resuming=resume is not None)
        self._check_no_finished_run()
        if resume is not None:
            task.check_resume(resume, self.resume_path)
            self._check_same_settings(resume)
            if SHARDED not in resume:  # a sharded state is loaded once the model is sharded
                task.load_weights(model, resume, self.resume_path)
        # the compiler traces the plain modules, not the CPU backend's fused ones
        place_model(model, self.device, fused=compile_options(s.compile) is None)
        self.amp_dtype = amp_dtype(self.device, s.amp, s.amp_cuda_dtype)
        self.sharded = s.parallel == "fsdp" and ctx.is_distributed  # the model's parameters are shards
        # under FSDP mixed precision is its policy, not autocast
        self.autocast_dtype = None if self.sharded else self.amp_dtype

        from timm.utils import ModelEmaV3

        self.model_ema = None
        if self.sharded:  # rank 0's weights (and the EMA's copy of them), sharded by prepare_model
            sync_from_rank0(model)
        if s.ema_decay is not None and self.sharded:
            self.model_ema = ModelEmaV3(model, decay=s.ema_decay)
        self.model = prepare_model(
            model, ctx=ctx, device=self.device, parallel=s.parallel, compile=s.compile,
            grad_checkpointing=s.grad_checkpointing, amp_dtype=self.amp_dtype,
            find_unused_parameters=s.find_unused_parameters,
            ema=self.model_ema.module if self.model_ema is not None else None)
        self.optimizer = task.build_optimizer(model)
        if s.ema_decay is not None and not self.sharded:  # after DDP: a copy of the weights all processes share
            self.model_ema = ModelEmaV3(model, decay=s.ema_decay)

        self.accumulation_steps = max(1, s.accumulation_steps)
        self._build_loader()
        self.updates_per_epoch = self.batches_per_epoch // self.accumulation_steps
        if self.updates_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(task.train_set)} examples) is smaller than one optimizer update "
                f"(batch {s.batch_size} x {ctx.world_size} processes x {self.accumulation_steps} accumulation steps)"
            )
        self.total_updates = s.steps if s.steps is not None else s.epochs * self.updates_per_epoch
        self.scheduler = task.build_scheduler(self.optimizer, self.updates_per_epoch, self.total_updates)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)

        self.epoch = s.start_epoch if s.epochs is not None else 0  # epochs of data completed
        self.batches = 0  # batches of this process done in the current epoch
        self.num_updates = self.epoch * self.updates_per_epoch
        self.window = Window()
        self.pending: list[tuple[int, StepOutput]] = []  # (update count, output) of the batches not yet read
        self.last_loss: float | None = None  # the loss of the last batch read
        self.history: list[dict] = []
        self.best: dict[str, float] = {}  # record key -> best value so far
        self.best_at: dict[str, int] = {}  # record key -> update count of that value
        self.lr = self.optimizer.param_groups[0]["lr"]  # the rate of the last update
        self.elapsed_before = 0.0  # seconds the runs this one continues took
        self.started = time.perf_counter()
        if resume is not None:
            self._restore(resume)
            self._check_updates_left()
        if hasattr(self.scheduler, "step_update"):
            self.scheduler.step_update(num_updates=self.num_updates)

    def _build_loader(self) -> None:
        s, ctx, train_set = self.settings, self.ctx, self.task.train_set
        sampler = None
        if isinstance(train_set, IterableDataset):
            # A streamed set (polaformer.data.shards) orders its own samples per epoch, process and loader
            # worker, and takes the sampler's part (set_epoch, set_start); len() is its samples per process.
            train_set.set_layout(ctx.rank, ctx.world_size, num_workers=s.num_workers, batch_size=s.batch_size,
                                 seed=s.seed)
            self.sampler = train_set
        else:
            self.sampler = sampler = TrainSampler(train_set, ctx, seed=s.seed)
        # Its own generator: creating an iterator must not draw from the global RNG (resuming
        # restores that), and it seeds the workers per epoch and process (see _train_epoch).
        self.loader_generator = torch.Generator()
        self.train_loader = DataLoader(
            train_set, batch_size=s.batch_size, sampler=sampler, drop_last=True,
            num_workers=s.num_workers, pin_memory=self.device.type == "cuda" and s.pin_memory,
            collate_fn=self.task.train_collate, generator=self.loader_generator,
        )
        self.batches_per_epoch = len(self.train_loader) // self.accumulation_steps * self.accumulation_steps

    @property
    def elapsed(self) -> float:
        """Seconds of training so far, the runs this one continues included."""
        return self.elapsed_before + time.perf_counter() - self.started

    @property
    def finished(self) -> bool:
        """Whether the run has trained all it should (epochs in epoch mode, else updates)."""
        if self.epoch_mode:
            return self.epoch >= self.settings.epochs
        return self.num_updates >= self.total_updates

    @property
    def read_every(self) -> int:
        """Batches between reads of the losses from the device (besides log lines, evaluations, checkpoints).

        A read waits for the device to finish the work queued so far; on the CPU there is nothing to wait for,
        so it reads every batch and a divergence stops the run at once."""
        s = self.settings
        if s.read_every:
            return s.read_every
        return 1 if self.device.type == "cpu" else s.print_freq or READ_EVERY

    @property
    def epoch_mode(self) -> bool:
        return self.settings.epochs is not None

    @property
    def last_path(self) -> Path:
        return self.output / self.settings.last_name

    @property
    def run_files(self) -> list[Path]:
        """The files of a run (this one or an earlier one) present in the output folder."""
        names = (self.settings.last_name, *self.task.best_files, METRICS_JSONL, METRICS_JSON)
        return [self.output / name for name in names if (self.output / name).exists()]

    def _find_resume(self) -> Path | None:
        resume = self.settings.resume
        if resume and resume != "auto":
            return Path(resume)
        if resume == "auto":
            if self.last_path.is_file():
                return self.last_path
            if self.ctx.is_main:
                log.info("no checkpoint %s yet: starting from scratch", self.last_path)
        return None

    def _check_no_finished_run(self) -> None:
        """Starting afresh must not silently replace (and first empty the metrics of) an earlier run;
        and files this run will replace must be replaceable (an immutable one would fail only at the
        first checkpoint)."""
        for path in self.run_files if self.ctx.is_main else []:
            try:
                open(path, "ab").close()  # writes nothing
            except OSError as e:
                raise ConfigError(f"cannot write {path}: {(e.strerror or str(e)).lower()}") from None
        s = self.settings
        if self.resume_path is not None or s.resume == "auto" or s.overwrite:
            return
        found = [path.name for path in self.run_files]
        if found:
            raise ConfigError(
                f"the output folder {self.output} already holds a run ({', '.join(found)}): --resume auto "
                "continues it, --overwrite replaces it, or choose another --output"
            )

    def _check_same_settings(self, checkpoint: dict) -> None:
        """Continuing a run with another learning rate, batch size or model would silently mix two runs:
        every setting must be the checkpoint's, except those the task lets change and those the user names
        (``allow_changed``). Keys a checkpoint of an earlier version lacks are not compared."""
        ours, saved = self.task.settings(), self.task.saved_settings(checkpoint)
        if ours is None or saved is None:
            return
        ours, saved = flat_settings(ours), flat_settings(saved)
        allowed = self.settings.allow_changed
        unknown = [name for name in allowed if not any(_covered(key, [name]) for key in ours)]
        if unknown:
            raise ConfigError(f"--allow-changed {unknown[0]}: no setting of a {self.task.name} run has this name "
                              f"(settings: {', '.join(ours)})")
        may_change = (*self.task.resume_may_change, *self.task.execution_keys, *allowed)
        for key, value in ours.items():
            if key in saved and saved[key] != value and not _covered(key, may_change):
                raise ConfigError(
                    f"{self.resume_path} was trained with {key} = {saved[key]!r}, this run asks for {value!r}: "
                    f"--allow-changed {key} continues the run with the new value")

    def _check_updates_left(self) -> None:
        """A resumed run with nothing left writes nothing: refuse, unless it is ``--resume auto`` (a job script
        rerunning the same command on a finished folder)."""
        if not self.finished:
            return
        unit, done, total = ("epochs", self.epoch, self.settings.epochs) if self.epoch_mode else (
            "steps", self.num_updates, self.total_updates)
        if self.settings.resume != "auto":
            raise ConfigError(
                f"nothing to train: {self.resume_path} has completed {done} {unit} and the run has {total}; "
                f"give more {unit} to continue it"
            )
        if self.ctx.is_main:
            log.info("%s has completed all %d %s: nothing to train", self.resume_path, total, unit)

    # resuming

    def _restore(self, checkpoint: dict) -> None:
        try:
            self._restore_state(checkpoint)
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as e:
            # load_state_dict and the RNG setters fail with all of these on tampered data.
            reason = (str(e).strip().splitlines() or [""])[0]
            raise CorruptCheckpointError(
                self.resume_path, f"its training state cannot be restored: {type(e).__name__}: {reason}"
            ) from e

    def _restore_state(self, checkpoint: dict) -> None:
        ctx = self.ctx
        ema = self.model_ema.module if self.model_ema is not None else None
        if SHARDED in checkpoint:
            load_sharded(self.resume_path.parent / checkpoint[SHARDED], unwrap(self.model), self.optimizer, ema,
                         has_ema=checkpoint.get("ema_saved", False))
        elif self.sharded:
            load_whole_into_sharded(checkpoint, unwrap(self.model), self.optimizer, ema)
        else:
            if ema is not None and checkpoint.get("model_ema") is not None:
                ema.load_state_dict(checkpoint["model_ema"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        if ema is not None and checkpoint.get("model_ema") is None and not checkpoint.get("ema_saved"):
            log.warning("%s has no EMA weights: the EMA restarts from the model's", self.resume_path)
            ema.load_state_dict(unwrap(self.model).state_dict())
        self._check_optimizer_shapes()
        if checkpoint["lr_scheduler"] is not None:
            self.task.restore_scheduler(self.scheduler, checkpoint["lr_scheduler"])
        self.epoch = int(checkpoint["epoch"])
        self.num_updates = int(checkpoint.get("num_updates", self.epoch * self.updates_per_epoch))
        for name in ("epoch", "num_updates"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} is negative")
        if checkpoint["lr_scheduler"] is None and not hasattr(self.scheduler, "step_update"):
            # an earlier version's file without the schedule's state: the rate of update num_updates
            self.scheduler.last_epoch = self.num_updates - 1
            self.scheduler.step()
        if checkpoint.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(checkpoint["scaler"])
        self.history = list(checkpoint.get("history", []))
        self.elapsed_before = float(checkpoint.get("elapsed_s", 0.0))
        self.best = {k: float(v) for k, v in checkpoint.get("best", {}).items()}
        self.best_at = {k: int(v) for k, v in checkpoint.get("best_at", {}).items()}
        self._restore_position(checkpoint)
        states = checkpoint.get("rng") or []
        if len(states) == ctx.world_size:
            set_rng_state(states[ctx.rank], self.device)
        else:
            log.warning("%s holds random states for %d processes, not %d: reseeding", self.resume_path, len(states),
                        ctx.world_size)
            seed_everything(self.settings.seed + ctx.rank + 1000 * self.epoch + self.num_updates)
        if ctx.is_main:
            log.info("resumed from %s: epoch %d, step %d of %d, %d updates", self.resume_path, self.epoch,
                     self.batches, self.batches_per_epoch, self.num_updates)

    def _check_optimizer_shapes(self) -> None:
        """A per-parameter state (Adam's moments, SGD's momentum) of another shape would fail only at
        the first update, deep inside the optimizer; scalars such as Adam's step count are exempt."""
        names = {param: name for name, param in unwrap(self.model).named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of {names.get(param, 'a parameter')!r} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(param.shape)}"
                    )

    def _restore_position(self, checkpoint: dict) -> None:
        """Where in the epoch the checkpoint was written, and the running totals since the last evaluation."""
        ctx, batch_size = self.ctx, self.settings.batch_size
        windows = checkpoint.get("window") or [{}]
        step = int(checkpoint.get("step", 0))
        if step < 0:
            raise ValueError(f"step {step} is negative")
        layout = (checkpoint.get("world_size"), checkpoint.get("batch_size"))
        if layout == (ctx.world_size, batch_size) and len(windows) == ctx.world_size:
            self.batches = step
            self.window = Window(**windows[ctx.rank])
            return
        # Another process count or batch size: continue after the samples of the epoch's
        # permutation already trained, rounded down to whole updates; rank 0 carries the totals.
        done = step * (layout[1] or batch_size) * (layout[0] or 1)
        batches = done // (batch_size * ctx.world_size)
        self.batches = batches - batches % self.accumulation_steps
        if step:
            log.warning("resuming mid-epoch with %d processes x batch %d (checkpoint: %s x %s): continuing at "
                        "batch %d of the epoch", ctx.world_size, batch_size, *layout, self.batches)
        if ctx.is_main:
            totals = Window()
            for w in windows:
                other = Window(**w)
                totals.loss_sum += other.loss_sum
                totals.samples += other.samples
                totals.time = max(totals.time, other.time)
                for key, value in other.stats.items():
                    totals.stats[key] = totals.stats.get(key, 0) + value
            self.window = totals

    # saving

    def _state(self, per_process: list[dict], folder: str | None) -> dict:
        if folder is not None:  # model, EMA and optimizer are in the shard folder
            weights = {SHARDED: folder, "ema_saved": self.model_ema is not None}
        else:
            weights = {"model": unwrap(self.model).state_dict(),
                       **({"model_ema": self.model_ema.module.state_dict()} if self.model_ema is not None else {}),
                       "optimizer": self.optimizer.state_dict()}
        return {
            "task": self.task.name,
            **weights,
            "lr_scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,  # epochs of data completed
            "step": self.batches,  # batches of each process done in the current epoch
            "num_updates": self.num_updates,
            "window": [p["window"] for p in per_process],  # per process
            "history": self.history,
            "best": dict(self.best),
            "best_at": dict(self.best_at),
            "metrics": self.history[-1] if self.history else {},
            "elapsed_s": self.elapsed,
            "world_size": self.ctx.world_size,
            "batch_size": self.settings.batch_size,
            "rng": [p["rng"] for p in per_process],  # per process
            **({"config": settings} if (settings := self.task.settings()) is not None else {}),
            **self.task.metadata(self),
        }

    def save(self, names: list[str]) -> None:
        """Write the training state to ``names`` in the output folder (rank 0; all processes call)."""
        per_process = all_gather_object({"rng": rng_state(self.device), "window": self.window.to_dict(),
                                         "names": names, "token": secrets.token_hex(6)}, self.ctx)
        names = per_process[0]["names"]  # rank 0 decides, so that every process joins the sharded write
        folder = None
        if self.settings.parallel == "fsdp" and names:
            folder = new_folder_name(self.num_updates, per_process[0]["token"])
            save_sharded(self.output, folder, unwrap(self.model), self.optimizer,
                         self.model_ema.module if self.model_ema is not None else None, self.ctx)
        if not self.ctx.is_main or not names:
            return
        first = self.output / names[0]
        before = _identity(first)
        try:
            self.last_saved = save_training_state(self.output, names, self._state(per_process, folder))
        except KeyboardInterrupt:
            if _identity(first) != before:  # Ctrl-C while the copies were made: the first file is complete
                self.last_saved = first
            raise
        finally:
            if folder is not None:
                remove_unused_folders(self.output, self._shard_folders_in_use())

    def _shard_folders_in_use(self) -> set[str]:
        """The shard folders the run's checkpoint files name."""
        used = set()
        for path in self.run_files:
            if path.suffix == ".pth":
                try:
                    folder = read_checkpoint(path).get(SHARDED)
                except (CorruptCheckpointError, OSError, AttributeError):
                    continue
                if isinstance(folder, str):
                    used.add(folder)
        return used

    # the run

    def fit(self) -> dict:
        """Train the remaining updates; returns what ``metrics.json`` holds at the end."""
        ctx = self.ctx
        self.started = time.perf_counter()
        self.writer = None
        if ctx.is_main:
            self._prepare_output()
            self.writer = _tensorboard(self.output)
            message = self.task.start_message(self)
            if message:
                log.info("%s", message)
        try:
            while not self.finished:
                self._train_epoch()
        finally:
            if self.writer is not None:
                self.writer.close()
        summary = self.task.finish(self)
        if ctx.is_main:
            write_json(self.output / METRICS_JSON, summary)
        return summary

    def close(self) -> None:
        try:
            barrier(self.ctx)
            shutdown(self.ctx)
        finally:
            self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _prepare_output(self) -> None:
        for path in self.output.iterdir():  # left by a run killed while writing
            if _TEMPORARY.match(path.name):
                path.unlink(missing_ok=True)
        if self.settings.overwrite and self.resume_path is None:  # no file of the old run stays
            for path in self.run_files:
                path.unlink()
        remove_unused_folders(self.output, self._shard_folders_in_use())  # and shards no checkpoint names
        # metrics.jsonl holds exactly the evaluations of the checkpoint we continue from.
        lines = "".join(json.dumps(record) + "\n" for record in self.history)
        atomic_write(self.output / METRICS_JSONL, lambda f: f.write(lines.encode()))

    def _train_epoch(self) -> None:
        s, ctx = self.settings, self.ctx
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(self.batches * s.batch_size)
        if isinstance(self.task.train_set, SampleDraws):
            self.task.train_set.set_epoch(self.epoch)
        # Workers (if any) are seeded from this: the same per epoch and process whatever came before.
        self.loader_generator.manual_seed(s.seed + 1_000_003 * self.epoch + ctx.rank)
        model, params = self.model, [p for p in self.model.parameters() if p.requires_grad]
        model.train()
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        fsdp = unwrap(model) if self.sharded else None
        scaler = self.scaler if self.scaler.is_enabled() else None
        # The batches still to train in this epoch, up to the end of the run.
        usable = self.batches_per_epoch - self.batches
        if not self.epoch_mode:
            usable = min(usable, (self.total_updates - self.num_updates) * self.accumulation_steps)
        desc = (f"epoch {self.epoch + 1}/{s.epochs}" if self.epoch_mode
                else f"{self.task.name} {self.num_updates}/{self.total_updates}")
        bar = tqdm(total=usable, desc=desc, leave=False, disable=None if s.show_progress and ctx.is_main else True)
        start = time.perf_counter()
        speed_start, speed_samples = start, 0
        try:
            for index, batch in enumerate(self.train_loader):
                if index >= usable:
                    break
                completes_update = (self.batches + 1) % self.accumulation_steps == 0
                if fsdp is not None and self.accumulation_steps > 1:  # reduce the gradients once per update
                    fsdp.set_requires_gradient_sync(completes_update)
                with model.no_sync() if ddp and not completes_update else nullcontext():
                    with autocast(self.device, self.autocast_dtype):
                        output = self.task.step(model, batch, self.device)
                    scaled = output.loss / self.accumulation_steps
                    (scaler.scale(scaled) if scaler else scaled).backward()
                if completes_update:
                    self._update(params, scaler)
                output.loss = output.loss.detach()
                self.pending.append((self.num_updates, output))
                self.batches += 1
                speed_samples += output.samples
                bar.update()
                # The same batches on every process: a read raises where the losses diverged.
                log_line = s.print_freq and (index + 1) % s.print_freq == 0
                action = self._update_action() if completes_update else None
                if log_line or action or len(self.pending) >= self.read_every:
                    loss = self._read()
                    now = time.perf_counter()
                    speed = speed_samples * ctx.world_size / max(now - speed_start, 1e-9)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.lr:.2e}", samples_s=f"{speed:.0f}",
                                    refresh=False)
                    if log_line and ctx.is_main:
                        log.info("%s [%d/%d] loss %.4f lr %.3e %.0f samples/s", desc, index + 1, usable, loss,
                                 self.lr, speed)
                        speed_start, speed_samples = now, 0
                if completes_update:
                    self.window.time += time.perf_counter() - start
                    self._after_update(action)
                    start = time.perf_counter()
        finally:
            bar.close()
        self._read()  # the epoch's time includes the device's work
        self.window.time += time.perf_counter() - start
        if self.batches >= self.batches_per_epoch:
            self.epoch, self.batches = self.epoch + 1, 0
            if self.epoch_mode:
                self._evaluate(end_of_epoch=True)

    def _update(self, params: list, scaler) -> None:
        s = self.settings
        if scaler is not None and (s.clip_grad_norm or s.clip_grad_value):
            scaler.unscale_(self.optimizer)
        if s.clip_grad_norm:
            nn.utils.clip_grad_norm_(params, s.clip_grad_norm)
        if s.clip_grad_value:
            nn.utils.clip_grad_value_(params, s.clip_grad_value)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.num_updates += 1
        _advance(self.scheduler, self.num_updates)
        if self.model_ema is not None:
            self.model_ema.update(unwrap(self.model))

    def _read(self) -> float | None:
        """Bring the losses and tensor statistics of the batches since the last read to the host, in one
        transfer (the only wait for the device in the loop); add them to the window, raise at the first
        non-finite loss. Returns the last loss read."""
        if not self.pending:
            return self.last_loss
        pending, self.pending = self.pending, []
        # float64 holds every float32 loss and integer count exactly; MPS has no float64.
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        tensors = [t.reshape(1).to(dtype) for _, output in pending
                   for t in (output.loss, *(v for v in output.stats.values() if torch.is_tensor(v)))]
        values = iter(torch.cat(tensors).tolist())
        for step, output in pending:
            loss = next(values)
            if not math.isfinite(loss):
                raise TrainingDivergedError(
                    f"training diverged at step {step}, loss {loss} (lower the learning rate, or clip gradients)"
                )
            stats = {key: next(values) if torch.is_tensor(value) else value for key, value in output.stats.items()}
            self.window.add(output.samples, loss, stats)
        self.last_loss = loss
        return loss

    def _update_action(self) -> str | None:
        """What follows the update just made: 'evaluate', 'save' (the last checkpoint) or None."""
        s, n = self.settings, self.num_updates
        saves = bool(s.save_every_steps) and n % s.save_every_steps == 0
        if self.epoch_mode:  # the epoch's end evaluates and saves
            return "save" if saves and self.batches < self.batches_per_epoch else None
        if n == self.total_updates or (s.eval_every and n % s.eval_every == 0):
            return "evaluate"
        return "save" if saves else None

    def _after_update(self, action: str | None) -> None:
        s = self.settings
        if not self.epoch_mode and self.batches >= self.batches_per_epoch:
            # An update that ends the epoch moves the position first, so a resumed run starts the next one.
            self.epoch, self.batches = self.epoch + 1, 0
        if action == "evaluate":
            self._evaluate(end_of_epoch=False)
        elif action == "save":
            self.save([s.last_name])
        if s.on_update is not None:
            s.on_update(self.num_updates)

    def _evaluate(self, end_of_epoch: bool) -> None:
        ctx = self.ctx
        eval_start = time.perf_counter()
        samples, loss_sum, train_time = all_reduce_sum(
            [self.window.samples, self.window.loss_sum, self.window.time], ctx, self.device)
        stats = dict(zip(self.window.stats, all_reduce_sum(list(self.window.stats.values()), ctx, self.device)))
        train = {"loss": loss_sum / max(samples, 1), "samples": samples, "time": train_time / ctx.world_size,
                 "stats": stats, "lr": self.lr, "eval_start": eval_start}
        with gathered(unwrap(self.model)) as model:  # whole on every process: each may run its own batches
            results = {"model": self.task.evaluate(model.eval(), self)}
        if self.model_ema is not None:
            with gathered(self.model_ema.module) as ema:
                results["ema"] = self.task.evaluate(ema.eval(), self)
        self.model.train()
        record = self.task.record(self, train, results)
        self.history.append(record)
        improved_files = []
        for name, key in self.task.best_files.items():
            if key not in record:
                continue
            value, best = record[key], self.best.get(key)
            if best is None or value > best or (self.task.ties_improve and value == best):
                self.best[key], self.best_at[key] = value, self.num_updates
                improved_files.append(name)
        self.window = Window()

        s = self.settings
        names = []
        final = self.finished
        if not end_of_epoch or self.epoch % s.save_every_epochs == 0 or final:
            names.append(s.last_name)
        self.save(names + improved_files)
        if ctx.is_main:
            self._write_metrics(record)
            log.info("%s", self.task.describe(record, bool(improved_files)))

    def _write_metrics(self, record: dict) -> None:
        with open(self.output / METRICS_JSONL, "a") as f:
            f.write(json.dumps(record) + "\n")
        write_json(self.output / METRICS_JSON, self.task.summary(self))
        if self.writer is not None:
            x = record.get("epoch", record.get("step", self.num_updates))
            for key, value in record.items():
                if key not in ("epoch", "step") and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, x)
            self.writer.flush()


def train(task: Task, settings: LoopSettings) -> dict:
    """Run ``task`` to the end (see :class:`Engine`); returns the contents of ``metrics.json``.

    Ctrl-C becomes :class:`TrainingInterrupted` naming the last checkpoint this run wrote.
    """
    engine = Engine(task, settings)
    try:
        return engine.fit()
    except KeyboardInterrupt:
        raise TrainingInterrupted(engine.last_saved) from None
    finally:
        engine.close()
