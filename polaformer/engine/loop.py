"""The one training loop under every task (classification, detection, segmentation, LRA, language models,
super-resolution, diffusion).

A task (:class:`~.task.Task`) supplies its model, training set, optimizer, schedule, the loss of one batch and its
evaluation; :class:`Engine` runs it as :class:`~.task.LoopSettings` say, once for all tasks. The run is put together
by :mod:`.build` (the output folder locked by :mod:`.folder`, the checkpoint it continues checked and restored by
:mod:`.resume`), and its state written by :mod:`.state`; this module is the loop itself:

- epochs of a :class:`~.distributed.TrainSampler` (the same order for every process count; a streamed set, as
  :mod:`polaformer.data.shards`, orders its own samples), gradient accumulation, autocast (:mod:`.device`), a
  GradScaler for float16, gradient clipping (by norm or by value), a weight EMA, the schedule stepped per update, a
  progress bar;
- evaluation every ``eval_every`` updates (or at each epoch's end), one JSON line per evaluation in
  ``metrics.jsonl``, the task's summary in ``metrics.json``, the best checkpoints per the task's metrics;
- checkpoints (written atomically): the last state every ``save_every_steps`` updates and at every evaluation (per
  ``save_every_epochs`` in epoch mode), so that with ``num_workers = 0`` a resumed run ends bit-identical to an
  uninterrupted one;
- no host synchronisation per batch: the losses (and a task's tensor statistics) stay on the device and are read
  together every :attr:`Engine.read_every` batches, at log lines and before an evaluation or a checkpoint;
- faults: a NaN/inf loss raises :class:`TrainingDivergedError` at the next read, naming the step it first appeared
  at; Ctrl-C :class:`TrainingInterrupted` naming the last checkpoint written, a full disk a one-line
  :class:`~polaformer.files.WriteError`.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from .build import build_run
from .config import SEED, ConfigError
from .device import autocast, resolve_device
from .distributed import SampleDraws, all_reduce_sum, barrier, init_distributed, shutdown
from .folder import METRICS_JSON, METRICS_JSONL, RunFolder, write_json  # noqa: F401  (re-exported)
from .optim import unwrap
from .parallel import check_execution, gathered
from .resume import flat_settings  # noqa: F401  (re-exported)
from .state import Window, rng_state, save as save_state, seed_everything, set_rng_state  # noqa: F401  (re-exported)
from .task import LoopSettings, StepOutput, Task  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

READ_EVERY = 50  # batches between reads of the losses off the CPU when print_freq is 0


class TrainingDivergedError(FloatingPointError):
    """The training loss became NaN or infinite (one line)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; ``checkpoint`` is the last file saved by this run (or None)."""

    def __init__(self, checkpoint: Path | None):
        super().__init__()
        self.checkpoint = checkpoint


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


class Engine:
    """One training run of ``task`` as ``settings`` say; :meth:`fit` runs it, :meth:`close` releases it. Its parts
    (``model``, ``optimizer``, ``train_loader``...) and position (``epoch``, ``num_updates``, ``history``, ``best``...)
    are set by :func:`~.build.build_run`."""

    def __init__(self, task: Task, settings: LoopSettings):
        if (settings.epochs is None) == (settings.steps is None):
            raise ConfigError("give a number of epochs or of steps, not both")
        SEED.check("the seed", settings.seed)
        check_execution(settings.parallel, settings.compile, settings.grad_checkpointing,
                        ("parallel", "compile", "grad_checkpointing"))
        self.task, self.settings = task, settings
        self.device = resolve_device(settings.device)
        self.folder: RunFolder | None = None
        self.last_saved: Path | None = None  # the last checkpoint this run wrote
        self.ctx = init_distributed(self.device.type)
        try:
            build_run(self)
        except BaseException:
            self._release()
            shutdown(self.ctx)
            raise

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
        return self.folder.files

    # the run

    def fit(self) -> dict:
        """Train the remaining updates; returns what ``metrics.json`` holds at the end."""
        ctx = self.ctx
        self.started = time.perf_counter()
        self.writer = None
        if ctx.is_main:
            self.folder.prepare(self.history, replace=self.settings.overwrite and self.resume_path is None)
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
            self.folder.write_summary(summary)
        return summary

    def close(self) -> None:
        try:
            barrier(self.ctx)
            shutdown(self.ctx)
        finally:
            self._release()

    def _release(self) -> None:
        if self.folder is not None:
            self.folder.release()

    def save(self, names: list[str]) -> None:
        """Write the training state to ``names`` in the output folder (rank 0; all processes call)."""
        save_state(self, names)

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
        self.folder.append_record(record, self.task.summary(self))
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
