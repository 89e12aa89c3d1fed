"""The training loop, as plain functions.

``train_one_epoch`` and ``evaluate`` know nothing about data sets or files; ``fit`` alternates
them; ``run_training`` builds everything from a :class:`TrainConfig` and writes the checkpoint
and metrics. Distributed training, AMP, EMA and resuming are meant to slot into these functions.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..data import DEFAULT_DATA, get_data_spec
from .checkpoint import atomic_write, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .factory import create_model, create_model_from_checkpoint

log = logging.getLogger(__name__)

# Fixed so that `polaformer eval` batches the test set exactly like training's final evaluation
# did: batched matmuls may round differently for other batch sizes, which could flip a near-tie.
EVAL_BATCH_SIZE = 256


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: CosineLRScheduler,
    criterion: nn.Module,
    *,
    num_updates: int = 0,
    clip_grad: float | None = None,
    device: torch.device | str = "cpu",
    desc: str = "train",
) -> dict:
    """One pass over ``loader``. The scheduler is stepped per optimizer update, not per epoch.

    Returns ``{'loss': mean training loss, 'lr': last learning rate, 'num_updates': total so far}``.
    """
    model.train()
    loss_sum, seen = 0.0, 0
    bar = tqdm(loader, desc=desc, leave=False, disable=None)  # disable=None: no bar unless on a terminal
    for images, targets in bar:
        images, targets = images.to(device), targets.to(device)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
        num_updates += 1
        scheduler.step_update(num_updates=num_updates)

        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"training loss became {loss_value} at update {num_updates}")
        loss_sum += loss_value * len(targets)
        seen += len(targets)
        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
    return {"loss": loss_sum / seen, "lr": optimizer.param_groups[0]["lr"], "num_updates": num_updates}


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device | str = "cpu") -> dict:
    """Top-1 / top-5 accuracy (in percent) and mean cross-entropy over ``loader``."""
    model.eval()
    correct1 = correct5 = 0
    loss_sum, seen = 0.0, 0
    for images, targets in loader:
        images, targets = images.to(device), targets.to(device)
        logits = model(images)
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top == targets[:, None]
        correct1 += hits[:, 0].sum().item()
        correct5 += hits.any(dim=1).sum().item()
        seen += len(targets)
    return {"top1": 100.0 * correct1 / seen, "top5": 100.0 * correct5 / seen, "loss": loss_sum / seen}


def fit(
    model: nn.Module,
    train_loader: DataLoader,
    test_loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: CosineLRScheduler,
    criterion: nn.Module,
    *,
    epochs: int,
    clip_grad: float | None = None,
    device: torch.device | str = "cpu",
    on_epoch_end: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train for ``epochs`` epochs, evaluating after each; returns one record per epoch.

    ``on_epoch_end(record)`` is called after every epoch (``run_training`` saves files there).
    """
    history = []
    num_updates = 0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        train = train_one_epoch(
            model, train_loader, optimizer, scheduler, criterion,
            num_updates=num_updates, clip_grad=clip_grad, device=device, desc=f"epoch {epoch}/{epochs}",
        )
        num_updates = train["num_updates"]
        test = evaluate(model, test_loader, device)
        record = {
            "epoch": epoch,
            "train_loss": train["loss"],
            "lr": train["lr"],
            "test_top1": test["top1"],
            "test_top5": test["top5"],
            "test_loss": test["loss"],
            "epoch_time_s": time.perf_counter() - start,
        }
        log.info(
            "epoch %d/%d: train loss %.4f, test top-1 %.2f%%, test loss %.4f (%.1fs)",
            epoch, epochs, record["train_loss"], record["test_top1"], record["test_loss"], record["epoch_time_s"],
        )
        history.append(record)
        if on_epoch_end is not None:
            on_epoch_end(record)
    return history


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_loaders(config: TrainConfig) -> tuple[DataLoader, DataLoader]:
    train_set, test_set = get_data_spec(config.data).build(augment=config.augment)
    shuffle_rng = torch.Generator().manual_seed(config.seed)
    train_loader = DataLoader(
        train_set, batch_size=config.batch_size, shuffle=True, drop_last=True,
        generator=shuffle_rng, num_workers=config.num_workers,
    )
    return train_loader, make_test_loader(test_set, config.num_workers)


def make_test_loader(test_set, num_workers: int = 0) -> DataLoader:
    return DataLoader(test_set, batch_size=EVAL_BATCH_SIZE, shuffle=False, num_workers=num_workers)


def model_kwargs_for(config: TrainConfig) -> dict:
    """Everything but ``num_classes`` that ``timm.create_model`` gets; stored in the checkpoint."""
    spec = get_data_spec(config.data)
    return {"in_chans": spec.in_chans, "img_size": spec.img_size, **config.model_kwargs}


def run_training(config: TrainConfig) -> dict:
    """Train ``config.model`` on ``config.data``; write ``checkpoint.pth`` and ``metrics.json``.

    Both files are rewritten atomically after every epoch, so an interrupted run leaves the last
    finished epoch behind. Returns the contents of ``metrics.json``.
    """
    start = time.perf_counter()
    torch.manual_seed(config.seed)  # model initialisation and augmentation draws
    device = resolve_device(config.device)
    spec = get_data_spec(config.data)
    model_kwargs = model_kwargs_for(config)
    model = create_model(config.model, spec.num_classes, **model_kwargs).to(device)
    train_loader, test_loader = build_loaders(config)
    log.info(
        "training %s (%.2fM parameters) on %s: %d train / %d test images, %d epochs, device %s",
        config.model, sum(p.numel() for p in model.parameters()) / 1e6, config.data,
        len(train_loader.dataset), len(test_loader.dataset), config.epochs, device,
    )

    optimizer = create_optimizer_v2(model, opt="adamw", lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = CosineLRScheduler(
        optimizer,
        t_initial=config.epochs * steps_per_epoch,
        lr_min=config.min_lr,
        warmup_t=config.warmup_epochs * steps_per_epoch,
        warmup_lr_init=config.min_lr,
        t_in_epochs=False,  # t counts optimizer updates
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)

    output = Path(config.output)
    checkpoint_path = output / "checkpoint.pth"
    metrics_path = output / "metrics.json"
    metrics = {"config": config.to_dict(), "checkpoint": str(checkpoint_path), "epochs": []}

    def save(record: dict) -> None:
        metrics["epochs"].append(record)
        save_checkpoint(
            checkpoint_path, model,
            arch=config.model, model_kwargs=model_kwargs, num_classes=spec.num_classes,
            epoch=record["epoch"], metrics=record, config=config.to_dict(),
        )
        write_json(metrics_path, metrics)

    history = fit(
        model, train_loader, test_loader, optimizer, scheduler, criterion,
        epochs=config.epochs, clip_grad=config.clip_grad, device=device, on_epoch_end=save,
    )
    final = history[-1]
    metrics["final_test_top1"] = final["test_top1"]
    metrics["final_test_top5"] = final["test_top5"]
    metrics["final_test_loss"] = final["test_loss"]
    metrics["wall_time_s"] = time.perf_counter() - start
    write_json(metrics_path, metrics)
    return metrics


def evaluate_checkpoint(
    path, data: str | None = None, arch: str | None = None, device: str = "auto"
) -> tuple[dict, dict]:
    """Rebuild the model saved at ``path`` and evaluate it on the test split of ``data``.

    ``data`` defaults to the data set the checkpoint was trained on; ``arch``, if given, must
    match the checkpoint's architecture. Returns ``(metrics, checkpoint)``.
    """
    checkpoint = load_checkpoint(path)
    model = create_model_from_checkpoint(checkpoint, path, arch=arch)
    data = data or checkpoint.get("config", {}).get("data", DEFAULT_DATA)
    _, test_set = get_data_spec(data).build(augment=False)
    device = resolve_device(device)
    return evaluate(model.to(device), make_test_loader(test_set), device), checkpoint


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))
