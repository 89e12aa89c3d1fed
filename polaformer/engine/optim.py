"""Optimizer and learning-rate schedule, as the official ``optimizer.py`` / ``lr_scheduler.py``.

- Learning rates scale linearly with the global batch (official ``main.py``): ``BASE_LR``,
  ``WARMUP_LR`` and ``MIN_LR`` are per ``TRAIN.BASE_BATCH_SIZE`` (512) images; the global batch
  is ``DATA.BATCH_SIZE x processes x TRAIN.ACCUMULATION_STEPS``. (Paper A.2's "1e-3 per 1024
  images" is the same ratio.)
- No weight decay on 1-D parameters (norms, biases), on ``*.bias``, and on what the model's
  ``no_weight_decay()`` names (position tables, the attention's ``scale``/``power``/
  ``positional_encoding``/``s1``/``s2``) or ``no_weight_decay_keywords()`` matches.
- Cosine schedule with a linear warm-up from ``WARMUP_LR`` over ``WARMUP_EPOCHS``, reaching
  ``MIN_LR`` after ``EPOCHS``; the ``COOLDOWN_EPOCHS`` that follow stay at ``MIN_LR``. It counts
  optimizer updates (``t_in_epochs=False``): call ``scheduler.step_update(num_updates)``.
"""
from __future__ import annotations

import math

import torch
from timm.scheduler import CosineLRScheduler, StepLRScheduler
from torch import nn

from .config import Config, ConfigError


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel (or torch.compile) wrapper."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_batch_size(cfg: Config, num_processes: int | None = None) -> int:
    processes = world_size() if num_processes is None else num_processes
    return cfg.DATA.BATCH_SIZE * processes * max(1, cfg.TRAIN.ACCUMULATION_STEPS)


def lr_scale(cfg: Config, num_processes: int | None = None) -> float:
    """The factor applied to BASE_LR, WARMUP_LR and MIN_LR: global batch / TRAIN.BASE_BATCH_SIZE."""
    if not cfg.TRAIN.BASE_BATCH_SIZE:
        return 1.0
    return global_batch_size(cfg, num_processes) / cfg.TRAIN.BASE_BATCH_SIZE


def no_weight_decay_names(model: nn.Module, keywords: tuple[str, ...] = ()) -> set[str]:
    """Names of the parameters trained without weight decay (see the module docstring), and those containing
    one of ``keywords`` (for wrappers such as a detector, whose backbone's ``no_weight_decay`` is not on top)."""
    model = unwrap(model)
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    keywords = tuple(keywords)
    if hasattr(model, "no_weight_decay_keywords"):
        keywords += tuple(model.no_weight_decay_keywords())
    return {
        name
        for name, param in model.named_parameters()
        if param.ndim <= 1 or name.endswith(".bias") or name in skip or any(k in name for k in keywords)
    }


def param_groups(model: nn.Module, weight_decay: float, keywords: tuple[str, ...] = ()) -> list[dict]:
    """Two groups, as the official code: with weight decay, then without (frozen weights left out)."""
    no_decay = no_weight_decay_names(model, keywords)
    decay_params, no_decay_params = [], []
    for name, param in unwrap(model).named_parameters():
        if param.requires_grad:
            (no_decay_params if name in no_decay else decay_params).append(param)
    return [{"params": decay_params}, {"params": no_decay_params, "weight_decay": 0.0}]


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (or SGD with Nesterov momentum) at the scaled ``TRAIN.BASE_LR``."""
    opt = cfg.TRAIN.OPTIMIZER
    lr = cfg.TRAIN.BASE_LR * lr_scale(cfg)
    groups = param_groups(model, cfg.TRAIN.WEIGHT_DECAY)
    name = opt.NAME.lower()
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(opt.BETAS), eps=opt.EPS,
                                 weight_decay=cfg.TRAIN.WEIGHT_DECAY)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=opt.MOMENTUM, nesterov=True, weight_decay=cfg.TRAIN.WEIGHT_DECAY)
    raise ConfigError(f"TRAIN.OPTIMIZER.NAME must be 'adamw' or 'sgd', got {opt.NAME!r}")


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """The per-update schedule; ``steps_per_epoch`` counts optimizer updates, not batches."""
    train = cfg.TRAIN
    scale = lr_scale(cfg)
    warmup_steps = int(train.WARMUP_EPOCHS * steps_per_epoch)
    name = train.LR_SCHEDULER.NAME.lower()
    if name == "cosine":
        return CosineLRScheduler(
            optimizer,
            t_initial=int(train.EPOCHS * steps_per_epoch),
            lr_min=train.MIN_LR * scale,
            warmup_lr_init=train.WARMUP_LR * scale,
            warmup_t=warmup_steps,
            cycle_limit=1,  # after EPOCHS the rate stays at MIN_LR: the cool-down
            t_in_epochs=False,
        )
    if name == "step":
        return StepLRScheduler(
            optimizer,
            decay_t=int(train.LR_SCHEDULER.DECAY_EPOCHS * steps_per_epoch),
            decay_rate=train.LR_SCHEDULER.DECAY_RATE,
            warmup_lr_init=train.WARMUP_LR * scale,
            warmup_t=warmup_steps,
            t_in_epochs=False,
        )
    raise ConfigError(f"TRAIN.LR_SCHEDULER.NAME must be 'cosine' or 'step', got {train.LR_SCHEDULER.NAME!r}")


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The step tasks' schedule: a linear warm-up over ``warmup_steps`` updates, then a cosine to 0 at ``steps``
    (stepped once per update)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
