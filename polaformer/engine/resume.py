"""Continuing a run: which checkpoint, whether this run may continue it, and its state put back.

- :func:`find_resume`: ``resume='auto'`` is the output folder's last checkpoint if there is one (else a fresh
  start), any other value a file;
- :func:`check_same_settings`: every setting of the task's configuration (:meth:`~.task.Task.settings`) must equal
  the checkpoint's, except those the task lets change (:attr:`~.task.Task.resume_may_change`, its
  :attr:`~.task.Task.execution_keys`) and those named in ``allow_changed`` (``--allow-changed KEY``);
- :func:`restore`: model (when sharded), EMA, optimizer, schedule, scaler, the position in the epoch, history, best
  values and every process's random states into the built engine, so that with ``num_workers = 0`` a resumed run
  ends bit-identical to an uninterrupted one; then :func:`check_updates_left`.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from ..checkpoint import CorruptCheckpointError
from .config import ConfigError
from .optim import unwrap
from .parallel import SHARDED, load_sharded, load_whole_into_sharded
from .state import Window, seed_everything, set_rng_state

__all__ = ["check_same_settings", "check_updates_left", "find_resume", "flat_settings", "restore"]

log = logging.getLogger(__name__)


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


# --- whether to resume, and from what --------------------------------------------------------------

def find_resume(settings, last_path: Path, is_main: bool) -> Path | None:
    """The checkpoint the run continues from, or None."""
    resume = settings.resume
    if resume and resume != "auto":
        return Path(resume)
    if resume == "auto":
        if last_path.is_file():
            return last_path
        if is_main:
            log.info("no checkpoint %s yet: starting from scratch", last_path)
    return None


def check_same_settings(task, checkpoint: dict, allowed: tuple[str, ...], path: Path) -> None:
    """Continuing a run with another learning rate, batch size or model would silently mix two runs: every setting
    must be the checkpoint's, except those the task lets change and those the user names (``allowed``). Keys a
    checkpoint of an earlier version lacks are not compared."""
    ours, saved = task.settings(), task.saved_settings(checkpoint)
    if ours is None or saved is None:
        return
    ours, saved = flat_settings(ours), flat_settings(saved)
    unknown = [name for name in allowed if not any(_covered(key, [name]) for key in ours)]
    if unknown:
        raise ConfigError(f"--allow-changed {unknown[0]}: no setting of a {task.name} run has this name "
                          f"(settings: {', '.join(ours)})")
    may_change = (*task.resume_may_change, *task.execution_keys, *allowed)
    for key, value in ours.items():
        if key in saved and saved[key] != value and not _covered(key, may_change):
            raise ConfigError(
                f"{path} was trained with {key} = {saved[key]!r}, this run asks for {value!r}: "
                f"--allow-changed {key} continues the run with the new value")


def check_updates_left(engine) -> None:
    """A resumed run with nothing left writes nothing: refuse, unless it is ``--resume auto`` (a job script
    rerunning the same command on a finished folder)."""
    if not engine.finished:
        return
    unit, done, total = ("epochs", engine.epoch, engine.settings.epochs) if engine.epoch_mode else (
        "steps", engine.num_updates, engine.total_updates)
    if engine.settings.resume != "auto":
        raise ConfigError(
            f"nothing to train: {engine.resume_path} has completed {done} {unit} and the run has {total}; "
            f"give more {unit} to continue it"
        )
    if engine.ctx.is_main:
        log.info("%s has completed all %d %s: nothing to train", engine.resume_path, total, unit)


# --- the state put back ----------------------------------------------------------------------

def restore(engine, checkpoint: dict) -> None:
    """``checkpoint``'s training state into the built ``engine``; tampered data is one
    :class:`~polaformer.checkpoint.CorruptCheckpointError` line."""
    try:
        _restore_state(engine, checkpoint)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as e:
        # load_state_dict and the RNG setters fail with all of these on tampered data.
        reason = (str(e).strip().splitlines() or [""])[0]
        raise CorruptCheckpointError(
            engine.resume_path, f"its training state cannot be restored: {type(e).__name__}: {reason}"
        ) from e


def _restore_state(engine, checkpoint: dict) -> None:
    ctx, path = engine.ctx, engine.resume_path
    ema = engine.model_ema.module if engine.model_ema is not None else None
    if SHARDED in checkpoint:
        load_sharded(path.parent / checkpoint[SHARDED], unwrap(engine.model), engine.optimizer, ema,
                     has_ema=checkpoint.get("ema_saved", False))
    elif engine.sharded:
        load_whole_into_sharded(checkpoint, unwrap(engine.model), engine.optimizer, ema)
    else:
        if ema is not None and checkpoint.get("model_ema") is not None:
            ema.load_state_dict(checkpoint["model_ema"])
        engine.optimizer.load_state_dict(checkpoint["optimizer"])
    if ema is not None and checkpoint.get("model_ema") is None and not checkpoint.get("ema_saved"):
        log.warning("%s has no EMA weights: the EMA restarts from the model's", path)
        ema.load_state_dict(unwrap(engine.model).state_dict())
    _check_optimizer_shapes(engine)
    if checkpoint["lr_scheduler"] is not None:
        engine.task.restore_scheduler(engine.scheduler, checkpoint["lr_scheduler"])
    engine.epoch = int(checkpoint["epoch"])
    engine.num_updates = int(checkpoint.get("num_updates", engine.epoch * engine.updates_per_epoch))
    for name in ("epoch", "num_updates"):
        if getattr(engine, name) < 0:
            raise ValueError(f"{name} {getattr(engine, name)} is negative")
    if checkpoint["lr_scheduler"] is None and not hasattr(engine.scheduler, "step_update"):
        # an earlier version's file without the schedule's state: the rate of update num_updates
        engine.scheduler.last_epoch = engine.num_updates - 1
        engine.scheduler.step()
    if checkpoint.get("scaler") and engine.scaler.is_enabled():
        engine.scaler.load_state_dict(checkpoint["scaler"])
    engine.history = list(checkpoint.get("history", []))
    engine.elapsed_before = float(checkpoint.get("elapsed_s", 0.0))
    engine.best = {k: float(v) for k, v in checkpoint.get("best", {}).items()}
    engine.best_at = {k: int(v) for k, v in checkpoint.get("best_at", {}).items()}
    _restore_position(engine, checkpoint)
    states = checkpoint.get("rng") or []
    if len(states) == ctx.world_size:
        set_rng_state(states[ctx.rank], engine.device)
    else:
        log.warning("%s holds random states for %d processes, not %d: reseeding", path, len(states),
                    ctx.world_size)
        seed_everything(engine.settings.seed + ctx.rank + 1000 * engine.epoch + engine.num_updates)
    if ctx.is_main:
        log.info("resumed from %s: epoch %d, step %d of %d, %d updates", path, engine.epoch,
                 engine.batches, engine.batches_per_epoch, engine.num_updates)


def _check_optimizer_shapes(engine) -> None:
    """A per-parameter state (Adam's moments, SGD's momentum) of another shape would fail only at the first update,
    deep inside the optimizer; scalars such as Adam's step count are exempt."""
    names = {param: name for name, param in unwrap(engine.model).named_parameters()}
    for param, state in engine.optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {key!r} of {names.get(param, 'a parameter')!r} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}"
                )


def _restore_position(engine, checkpoint: dict) -> None:
    """Where in the epoch the checkpoint was written, and the running totals since the last evaluation."""
    ctx, batch_size = engine.ctx, engine.settings.batch_size
    windows = checkpoint.get("window") or [{}]
    step = int(checkpoint.get("step", 0))
    if step < 0:
        raise ValueError(f"step {step} is negative")
    layout = (checkpoint.get("world_size"), checkpoint.get("batch_size"))
    if layout == (ctx.world_size, batch_size) and len(windows) == ctx.world_size:
        engine.batches = step
        engine.window = Window(**windows[ctx.rank])
        return
    # Another process count or batch size: continue after the samples of the epoch's
    # permutation already trained, rounded down to whole updates; rank 0 carries the totals.
    done = step * (layout[1] or batch_size) * (layout[0] or 1)
    batches = done // (batch_size * ctx.world_size)
    engine.batches = batches - batches % engine.accumulation_steps
    if step:
        log.warning("resuming mid-epoch with %d processes x batch %d (checkpoint: %s x %s): continuing at "
                    "batch %d of the epoch", ctx.world_size, batch_size, *layout, engine.batches)
    if ctx.is_main:
        totals = Window()
        for w in windows:
            other = Window(**w)
            totals.loss_sum += other.loss_sum
            totals.samples += other.samples
            totals.time = max(totals.time, other.time)
            for key, value in other.stats.items():
                totals.stats[key] = totals.stats.get(key, 0) + value
        engine.window = totals
