"""LRA training and evaluation (the Skyformer protocol) as a task of the one engine.

:func:`train_lra` trains ``train.steps`` optimizer steps with AdamW (``eps`` 1e-6, no weight decay
by default), ``OneCycleLR`` with linear warm-up over ``warmup_steps`` and linear decay (PyTorch's
defaults otherwise, as the Skyformer code: start and end at lr/25 and lr/25e4, beta1 cycling
0.95 -> 0.85 -> 0.95) and element-wise gradient clipping. Every ``eval_every`` steps it scores the
dev split, keeps ``best.pth`` (highest dev accuracy) and ``last.pth`` (everything a resumed run
needs), and appends a line to ``metrics.jsonl``. At the end the best weights are scored on the
test split and ``metrics.json`` holds the whole run.

The loop, the output folder (lock, no finished run replaced unless ``overwrite``), checkpoints,
bit-identical resuming (``resume="auto"`` or a file), AMP and Ctrl-C are the engine's
(:mod:`polaformer.engine.loop`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ...engine.checkpoint import read_checkpoint
from ...engine.config import Config
from ...engine.device import autocast
from ...engine.distributed import DistContext, all_reduce_sum, barrier, shard
from ...engine.loop import Engine, StepOutput, train
from ...engine.optim import unwrap
from ...engine.steps import StepTask, load_task_model, step_settings
from .config import LRAConfigError, check_lra_config, lra_config
from .data import TASKS, collate_lra, load_lra_split
from .model import LRAClassifier, LRAModelConfig

log = logging.getLogger(__name__)

LAST, BEST = "last.pth", "best.pth"

__all__ = ["LRATask", "build_lra_model", "evaluate_lra", "train_lra", "load_lra_model", "LRASplits", "LAST", "BEST"]


@dataclass
class LRASplits:
    train: Dataset
    dev: Dataset
    test: Dataset


def build_lra_model(cfg: Config) -> LRAClassifier:
    spec = TASKS[cfg.task]
    model_cfg = LRAModelConfig(
        vocab_size=spec.vocab_size, num_classes=spec.num_classes, max_len=spec.max_len, dual=spec.dual,
        attention=cfg.attention, attention_options=cfg.attention_options.to_dict(), **cfg.model.to_dict(),
    )
    try:
        return LRAClassifier(model_cfg)
    except (ValueError, TypeError) as e:  # e.g. an attention option with a value its layer refuses
        raise LRAConfigError(f"cannot build the {cfg.attention} model: {e}") from None


def load_splits(cfg: Config, data_dir: str | Path) -> LRASplits:
    t = cfg.train
    return LRASplits(*(load_lra_split(cfg.task, data_dir, split, limit=limit)
                       for split, limit in (("train", t.limit_train), ("dev", t.limit_dev), ("test", t.limit_test))))


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["tokens"], batch["padding_mask"], batch.get("tokens_b"), batch.get("padding_mask_b"))


@torch.no_grad()
def evaluate_lra(model: nn.Module, loader: DataLoader, device: torch.device | str = "cpu", *,
                 max_batches: int = 0, amp_dtype: torch.dtype | None = None, ctx: DistContext = DistContext()) -> dict:
    """Accuracy (%) and mean cross-entropy over ``loader`` (its first ``max_batches`` if > 0); under torchrun
    (``ctx``) over the loaders of all processes together."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    correct = loss_sum = 0.0
    seen = 0
    for index, batch in enumerate(loader):
        if max_batches and index >= max_batches:
            break
        batch = _to_device(batch, device)
        with autocast(device, amp_dtype):
            logits = _logits(model, batch)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, batch["label"], reduction="sum").item()
        correct += (logits.argmax(dim=-1) == batch["label"]).sum().item()
        seen += len(batch["label"])
    model.train(was_training)
    correct, loss_sum, seen = all_reduce_sum([correct, loss_sum, seen], ctx, device)
    seen = int(seen)
    n = max(seen, 1)
    return {"accuracy": 100.0 * correct / n, "loss": loss_sum / n, "examples": seen}


def _eval_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    # Own generator: creating an iterator would otherwise draw from (and shift) the global RNG.
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_lra, num_workers=num_workers,
                      generator=torch.Generator())


def load_lra_model(path: str | Path) -> tuple[LRAClassifier, dict]:
    """Rebuild the model an LRA checkpoint holds (of any version), in eval mode; returns ``(model, checkpoint)``."""
    def rebuild(checkpoint):
        saved = checkpoint["config"]
        cfg = lra_config(saved["task"], {key: saved[key] for key in ("attention", "attention_options", "model")})
        check_lra_config(cfg)
        return build_lra_model(cfg), checkpoint

    return load_task_model(path, LRATask.name, "LRA", rebuild)


class LRATask(StepTask):
    """One attention on one LRA task: cross-entropy, dev accuracy, the best weights scored on test."""

    name = "lra"
    best_files = {BEST: "dev_accuracy"}
    resume_hint = "it holds weights only; use another --output"
    # the run's length, how it is evaluated and saved, and its workers
    resume_may_change = ("train.steps", "train.eval_every", "train.eval_batches", "train.save_every",
                         "train.num_workers", "train.limit_dev", "train.limit_test")

    def __init__(self, cfg: Config, splits: LRASplits):
        super().__init__(cfg)
        self.splits = splits
        self.train_set, self.train_collate = splits.train, collate_lra

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        t = self.cfg.train
        if len(self.splits.train) < t.batch_size:
            raise LRAConfigError(
                f"the training split has {len(self.splits.train)} examples, fewer than one batch of {t.batch_size}"
            )
        # train.eval_batches counts batches of the global batch (train.batch_size x processes): every process
        # count scores the same dev examples
        limit = t.eval_batches * t.batch_size * engine.ctx.world_size
        self.dev_loader = _eval_loader(shard(self.splits.dev, engine.ctx, limit), t.batch_size, t.num_workers)
        return build_lra_model(self.cfg)

    def start_message(self, engine: Engine) -> str:
        s = self.splits
        return (self.opening(engine, f"{self.cfg.attention} on LRA {self.cfg.task}",
                             f"{len(s.train)} train / {len(s.dev)} dev / {len(s.test)} test examples")
                + f", device {engine.device}")

    def saved_settings(self, checkpoint: dict) -> dict | None:
        saved = checkpoint.get("config")
        try:  # older files list only the model keys they changed: compare with the defaults filled in
            model = lra_config(saved["task"], {k: saved[k] for k in ("attention", "attention_options", "model")
                                               if k in saved}).to_dict()
        except (KeyError, TypeError, ValueError):
            return super().saved_settings(checkpoint)
        return {**saved, **{k: model[k] for k in ("task", "attention", "attention_options", "model")}}

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps,
                                 weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        t = self.cfg.train
        # OneCycleLR's warm-up phase ends at update warmup_steps - 1; one of a single update would be
        # empty (a division by zero there), and peaking at the first update is what no warm-up does.
        warmup = t.warmup_steps if t.warmup_steps > 1 else 0
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=t.lr, total_steps=t.steps, pct_start=warmup / t.steps, anneal_strategy="linear",
        )

    def restore_scheduler(self, scheduler, state: dict) -> None:
        # The schedule's shape is this run's (a resumed run may have more steps); the position is the file's.
        shape = {key: scheduler.__dict__[key] for key in ("total_steps", "_schedule_phases")}
        scheduler.load_state_dict(state)
        scheduler.__dict__.update(shape)
        scheduler.last_epoch -= 1
        scheduler.step()  # the rate and momentum of that position under this shape

    def step(self, model: nn.Module, batch: dict, device: torch.device) -> StepOutput:
        batch = _to_device(batch, device)
        logits = _logits(model, batch)
        loss = F.cross_entropy(logits.float(), batch["label"])
        correct = (logits.argmax(dim=-1) == batch["label"]).sum()  # read by the engine with the loss
        return StepOutput(loss, len(batch["label"]), {"correct": correct})

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        return evaluate_lra(model, self.dev_loader, engine.device, amp_dtype=engine.amp_dtype, ctx=engine.ctx)

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        dev = results["model"]
        return {
            "step": engine.num_updates,
            "lr": train["lr"],
            "train_loss": train["loss"],
            "train_accuracy": 100.0 * train["stats"].get("correct", 0) / max(train["samples"], 1),
            "train_samples_per_s": train["samples"] / max(train["time"], 1e-9),
            "dev_loss": dev["loss"],
            "dev_accuracy": dev["accuracy"],
            "elapsed_s": engine.elapsed,
        }

    def describe(self, record: dict, improved: bool) -> str:
        return self.evaluation_line(record, improved, f"train loss {record['train_loss']:.4f} acc "
                                                      f"{record['train_accuracy']:.2f}%, dev loss "
                                                      f"{record['dev_loss']:.4f} acc {record['dev_accuracy']:.2f}%")

    def summary(self, engine: Engine) -> dict:
        return self.run_summary(engine, {"task": self.cfg.task, "attention": self.cfg.attention}, {
            "evaluations": len(engine.history), "best_dev_accuracy": engine.best.get("dev_accuracy", -1.0),
            "best_step": engine.best_at.get("dev_accuracy", 0)})

    def finish(self, engine: Engine) -> dict:
        t = self.cfg.train
        model = unwrap(engine.model)
        best_path = engine.output / BEST
        barrier(engine.ctx)  # rank 0 has written its last best.pth
        if best_path.exists():
            model.load_state_dict(read_checkpoint(best_path)["model"])
        test_loader = _eval_loader(shard(self.splits.test, engine.ctx), t.batch_size, t.num_workers)
        test = evaluate_lra(model, test_loader, engine.device, amp_dtype=engine.amp_dtype, ctx=engine.ctx)
        summary = {
            **self.summary(engine),
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "test_examples": test["examples"],
            "majority_class_test_accuracy": majority_rate(self.splits.test),
        }
        if engine.ctx.is_main:
            log.info("test accuracy %.2f%% (best dev %.2f%% at step %d; majority class %.2f%%)", test["accuracy"],
                     summary["best_dev_accuracy"], summary["best_step"], summary["majority_class_test_accuracy"])
        return summary

    def metadata(self, engine: Engine) -> dict:
        return {"model_config": unwrap(engine.model).cfg.to_dict()}


def majority_rate(dataset: Dataset) -> float:
    """Accuracy (%) of always predicting the most frequent label of ``dataset``."""
    labels = getattr(dataset, "labels", None)  # the LRA datasets hold them; no need to decode every item
    labels = [int(x) for x in labels] if labels is not None else [int(dataset[i][1]) for i in range(len(dataset))]
    if not labels:
        return 0.0
    return 100.0 * max(labels.count(c) for c in set(labels)) / len(labels)


def train_lra(
    cfg: Config,
    data_dir: str | Path | None,
    output: str | Path,
    *,
    resume: str | Path | None = None,
    splits: LRASplits | None = None,
    on_step: Callable[[int], None] | None = None,
    **options,
) -> dict:
    """Train as ``cfg`` says on the task's files in ``data_dir`` (or on ``splits``); see the module docstring.

    ``resume``: ``"auto"`` (``output/last.pth`` if it exists, else from scratch) or a checkpoint path.
    ``on_step(step)`` is called after every step (tests use it to interrupt a run); ``options``: overwrite,
    device, show_progress, allow_changed (:func:`~polaformer.engine.steps.step_settings`). Returns the contents of
    ``metrics.json``.
    """
    check_lra_config(cfg)
    if splits is None:
        if data_dir is None:
            raise LRAConfigError("no data: give the task's data folder")
        splits = load_splits(cfg, data_dir)
    return train(LRATask(cfg, splits), step_settings(cfg, output, resume=resume, on_update=on_step, **options))
