"""The step-based training loop shared by ``detect train`` and ``segment train``.

AdamW with no weight decay on norms, biases and position tables (as the papers' mmdet/mmseg
recipes), linear warm-up, then step decay (detection: x0.1 at the milestones) or polynomial
decay (segmentation). ``last.pth`` is written atomically every ``save_every`` steps and at the
end, so a crash loses at most that many steps; ``--resume`` continues from it exactly
(optimizer, schedule, data order). ``best.pth`` holds the weights of the best evaluation.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn
from tqdm import tqdm

from ..checkpoint import CheckpointError, atomic_write, read_checkpoint

__all__ = ["Schedule", "make_optimizer", "train_steps", "save_dense_checkpoint", "load_dense_checkpoint"]

_logger = logging.getLogger(__name__)

NO_DECAY_NAMES = ("pos_embed", "pos_block", "relative_position_bias_table", "absolute_pos_embed", "cls_token")


@dataclass
class Schedule:
    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int = 0
    policy: str = "step"  # 'step': x gamma at each milestone; 'poly': (1 - t/T) ** power
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    power: float = 1.0
    clip_grad: float | None = None

    def factor(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if self.policy == "poly":
            return warm * max(0.0, 1 - step / self.steps) ** self.power
        return warm * self.gamma ** sum(step >= m for m in self.milestones)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or any(k in name for k in NO_DECAY_NAMES) else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )


def save_dense_checkpoint(path: Path, model: nn.Module, *, task: str, config: dict, step: int,
                          metrics: dict, optimizer=None, best: float | None = None) -> Path:
    state = {"task": task, "config": config, "model": model.state_dict(), "step": step, "metrics": metrics, "best": best}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return atomic_write(path, lambda f: torch.save(state, f))


def load_dense_checkpoint(path: str | os.PathLike, task: str) -> dict:
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint, dict) or "task" not in checkpoint or "config" not in checkpoint:
        raise CheckpointError(f"{path}: not a checkpoint of 'polaformer {task} train'")
    if checkpoint["task"] != task:
        raise CheckpointError(f"{path}: a '{checkpoint['task']}' checkpoint, not a '{task}' one")
    return checkpoint


def _batches(make_loader: Callable[[int], Iterable], start_epoch: int):
    """Batches forever; epoch e's order depends on e only, so a resumed run sees the same batches."""
    epoch = start_epoch
    while True:
        yield from ((epoch, b) for b in make_loader(epoch))
        epoch += 1


@dataclass
class TrainResult:
    step: int
    metrics: dict
    best: float | None
    history: list = field(default_factory=list)


def train_steps(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, object], dict[str, torch.Tensor]],
    make_loader: Callable[[int], Iterable],
    schedule: Schedule,
    *,
    output: Path,
    task: str,
    config: dict,
    evaluate: Callable[[nn.Module], dict],
    key_metric: str,
    eval_every: int,
    save_every: int,
    resume: str | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train for ``schedule.steps`` optimizer steps; ``make_loader(epoch)`` gives a seeded loader."""
    output.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, schedule.lr, schedule.weight_decay)
    start, best = 0, None
    if resume:
        path = output / "last.pth" if resume == "auto" else Path(resume)
        if path.exists() or resume != "auto":
            state = load_dense_checkpoint(path, task)
            model.load_state_dict(state["model"])
            if "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            start, best = int(state["step"]), state.get("best")
            _logger.info("resumed from %s at step %d", path, start)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor, last_epoch=start - 1) if start else \
        torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    steps_per_epoch = max(1, len(make_loader(0)))
    epoch0, skip = divmod(start, steps_per_epoch)
    batches = _batches(make_loader, epoch0)
    for _ in range(skip):  # same data order as an uninterrupted run
        next(batches)
    metrics: dict = {}
    history: list = []
    model.train()
    bar = tqdm(range(start, schedule.steps), initial=start, total=schedule.steps, desc=f"{task} train",
               disable=not progress, dynamic_ncols=True)
    for step in bar:
        _, batch = next(batches)
        losses = loss_fn(model, batch)
        loss = sum(losses.values())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: the loss is {loss.item()} ({ {k: round(v.item(), 4) for k, v in losses.items()} })")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if schedule.clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), schedule.clip_grad)
        optimizer.step()
        scheduler.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        done = step + 1
        if done % eval_every == 0 or done == schedule.steps:
            model.eval()
            metrics = evaluate(model)
            model.train()
            history.append({"step": done, **metrics})
            with open(output / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": done, **metrics}) + "\n")
            _logger.info("step %d: %s", done, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            score = metrics[key_metric]
            if best is None or score > best:
                best = score
                save_dense_checkpoint(output / "best.pth", model, task=task, config=config, step=done,
                                      metrics=metrics, best=best)
        if done % save_every == 0 or done == schedule.steps:
            save_dense_checkpoint(output / "last.pth", model, task=task, config=config, step=done,
                                  metrics=metrics, optimizer=optimizer, best=best)
    atomic_write(output / "metrics.json", lambda f: f.write(json.dumps({"step": schedule.steps, "best": best, **metrics}, indent=1).encode()))
    return TrainResult(schedule.steps, metrics, best, history)


def epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    return max(1, math.ceil(epochs * steps_per_epoch))
