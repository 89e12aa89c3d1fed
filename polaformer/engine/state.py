"""A run's state as its checkpoints hold it, and its writing.

:func:`save` writes the training state (:func:`training_state`: model, EMA, optimizer, schedule, scaler, the
position in the epoch, history, best values, every process's training totals and random states) to the run's
checkpoint files, rank 0 deciding and every process joining: under ``parallel='fsdp'`` model, EMA and optimizer
go into a shard folder (:func:`~.parallel.save_sharded`) that the file names. Reading it back is :mod:`.resume`.
"""
from __future__ import annotations

import os
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .checkpoint import save_training_state
from .distributed import all_gather_object
from .optim import unwrap
from .parallel import SHARDED, new_folder_name, remove_unused_folders, save_sharded

__all__ = ["Window", "rng_state", "save", "seed_everything", "set_rng_state", "training_state"]


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


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# --- the training state ------------------------------------------------------------------------

def training_state(engine, per_process: list[dict], folder: str | None) -> dict:
    """What a checkpoint of ``engine``'s run holds; ``per_process``: every process's random states and totals,
    ``folder``: the shard folder holding model, EMA and optimizer (None: they are in the file)."""
    ema = engine.model_ema
    if folder is not None:
        weights = {SHARDED: folder, "ema_saved": ema is not None}
    else:
        weights = {"model": unwrap(engine.model).state_dict(),
                   **({"model_ema": ema.module.state_dict()} if ema is not None else {}),
                   "optimizer": engine.optimizer.state_dict()}
    return {
        "task": engine.task.name,
        **weights,
        "lr_scheduler": engine.scheduler.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "epoch": engine.epoch,  # epochs of data completed
        "step": engine.batches,  # batches of each process done in the current epoch
        "num_updates": engine.num_updates,
        "window": [p["window"] for p in per_process],  # per process
        "history": engine.history,
        "best": dict(engine.best),
        "best_at": dict(engine.best_at),
        "metrics": engine.history[-1] if engine.history else {},
        "elapsed_s": engine.elapsed,
        "world_size": engine.ctx.world_size,
        "batch_size": engine.settings.batch_size,
        "rng": [p["rng"] for p in per_process],  # per process
        **({"config": settings} if (settings := engine.task.settings()) is not None else {}),
        **engine.task.metadata(engine),
    }


def save(engine, names: list[str]) -> None:
    """Write ``engine``'s training state to ``names`` in its output folder (rank 0; all processes call), and
    remember the file as ``engine.last_saved``."""
    ctx = engine.ctx
    per_process = all_gather_object({"rng": rng_state(engine.device), "window": engine.window.to_dict(),
                                     "names": names, "token": secrets.token_hex(6)}, ctx)
    names = per_process[0]["names"]  # rank 0 decides, so that every process joins the sharded write
    folder = None
    if engine.settings.parallel == "fsdp" and names:
        folder = new_folder_name(engine.num_updates, per_process[0]["token"])
        save_sharded(engine.output, folder, unwrap(engine.model), engine.optimizer,
                     engine.model_ema.module if engine.model_ema is not None else None, ctx)
    if not ctx.is_main or not names:
        return
    first = engine.output / names[0]
    before = _identity(first)
    try:
        engine.last_saved = save_training_state(engine.output, names, training_state(engine, per_process, folder))
    except KeyboardInterrupt:
        if _identity(first) != before:  # Ctrl-C while the copies were made: the first file is complete
            engine.last_saved = first
        raise
    finally:
        if folder is not None:
            remove_unused_folders(engine.output, engine.folder.shard_folders_in_use())


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode): an atomic write replaces it with another."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino
