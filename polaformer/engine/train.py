"""The training engine: one loop for the digits demo and for ImageNet-scale runs.

:func:`run_training` takes a :class:`~polaformer.engine.config.Config` (the official key tree) or
the digits demo's :class:`~polaformer.engine.config.TrainConfig`, and runs :class:`Trainer`:

- data: the embedded ``digits`` set, or an ImageNet-layout folder (``DATA.DATA_PATH``) through
  :mod:`polaformer.data.folder` (timm transforms, Mixup/CutMix, unreadable images skipped and
  counted);
- optimisation (:mod:`.optim`): AdamW without weight decay on norms/biases/position tables/
  attention temperatures, lr scaled with the global batch, cosine schedule with warm-up and
  cool-down stepped per update, gradient clipping and accumulation, AMP (bfloat16 on the CPU,
  float16 with a GradScaler or bfloat16 on CUDA), weight EMA (timm ``ModelEmaV3``) evaluated
  next to the raw weights, activation checkpointing;
- distribution (:mod:`.distributed`): DDP under torchrun, metrics summed over the processes,
  only rank 0 writing files;
- crash safety: ``last.pth`` after every epoch (and every ``TRAIN.SAVE_FREQ_STEPS`` updates),
  ``best.pth`` (and ``best_ema.pth``) when the top-1 improves, all written atomically; a resumed
  run restores model, optimizer, scheduler, scaler, EMA, epoch/step, best accuracy and every
  process's RNG states, and skips the batches of the epoch already trained: with
  ``DATA.NUM_WORKERS = 0`` it ends bit-identical to an uninterrupted run;
- observability: a progress bar per epoch (loss, lr, images/s), one JSON line per epoch in
  ``metrics.jsonl``, ``metrics.json`` (configuration, all epochs, final and best accuracy),
  TensorBoard when it is installed.
"""
from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ..checkpoint import ArchitectureMismatchError, CorruptCheckpointError
from ..data import DATASETS, DEFAULT_DATA, get_data_spec
from .checkpoint import atomic_write, load_checkpoint, load_model_state
from .config import (
    DIGITS_EVAL_BATCH_SIZE,
    Config,
    ConfigError,
    TrainConfig,
    check_config,
    config_from_train_config,
    merge_opts,
    resolve_model_name,
)
from .distributed import (
    DistContext,
    ShardSampler,
    TrainSampler,
    all_gather_object,
    all_reduce_sum,
    barrier,
    init_distributed,
    shutdown,
)
from .factory import create_model, create_model_from_checkpoint
from .output import OutputLock
from .optim import build_optimizer, build_scheduler, global_batch_size, lr_scale, unwrap

log = logging.getLogger(__name__)

EVAL_BATCH_SIZE = DIGITS_EVAL_BATCH_SIZE  # `polaformer eval` on digits batches like training did
BEST_CHECKPOINT = "best.pth"
BEST_EMA_CHECKPOINT = "best_ema.pth"
METRICS_JSONL = "metrics.jsonl"
METRICS_JSON = "metrics.json"


class TrainingDivergedError(FloatingPointError):
    """The training loss became NaN or infinite (one line)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; ``checkpoint`` is the last file saved by this run (or None)."""

    def __init__(self, checkpoint: Path | None):
        super().__init__()
        self.checkpoint = checkpoint


# --- one epoch -------------------------------------------------------------------------------

@dataclass
class EpochProgress:
    """Running totals of the epoch in progress (saved in mid-epoch checkpoints)."""

    batches: int = 0  # batches of this process done in this epoch
    loss_sum: float = 0.0  # sum over samples of the training loss
    seen: int = 0  # samples that contributed to loss_sum
    skipped: int = 0  # unreadable images dropped by the collate function
    train_time: float = 0.0  # seconds spent in this epoch's training loop

    def to_dict(self) -> dict:
        return dict(vars(self))


def unpack_batch(batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(images, targets)`` or ``(images, targets, num_skipped)`` -> all three."""
    if len(batch) == 3:
        images, targets, skipped = batch
        return images, targets, int(skipped)
    images, targets = batch
    return images, targets, 0


def autocast(device: torch.device | str, amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=amp_dtype)


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler,
    criterion: nn.Module,
    *,
    num_updates: int = 0,
    clip_grad: float | None = None,
    device: torch.device | str = "cpu",
    desc: str = "train",
    accumulation_steps: int = 1,
    amp_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    mixup_fn: Callable | None = None,
    model_ema: nn.Module | None = None,
    progress: EpochProgress | None = None,
    on_update: Callable[[int, EpochProgress], None] | None = None,
    show_progress: bool = True,
    world_size: int = 1,
    print_freq: int = 0,
) -> dict:
    """Train over ``loader`` (the rest of an epoch when ``progress`` comes from a checkpoint).

    The optimizer steps every ``accumulation_steps`` batches (trailing batches that do not fill
    an accumulation group are left out), then the scheduler is stepped with the update count and
    the EMA updated; ``on_update(num_updates, progress)`` follows (for step checkpoints). Under
    DDP, gradients are synchronised only on the batch that completes an accumulation group.

    Returns ``{'loss': mean training loss of this process, 'lr': last learning rate,
    'num_updates': total so far, 'progress': EpochProgress}``.
    """
    model.train()
    progress = progress or EpochProgress()
    accumulation_steps = max(1, accumulation_steps)
    usable = (progress.batches + len(loader)) // accumulation_steps * accumulation_steps - progress.batches
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    scaler = scaler if scaler is not None and scaler.is_enabled() else None
    params = [p for p in model.parameters() if p.requires_grad]
    previous = None  # the last non-empty batch, stand-in for a batch with no readable image

    bar = tqdm(total=usable, desc=desc, leave=False, disable=None if show_progress else True)
    start = time.perf_counter()
    window_start, window_images = start, 0
    for index, batch in enumerate(loader):
        if index >= usable:
            break
        images, targets, skipped = unpack_batch(batch)
        progress.skipped += skipped
        weight = 1.0
        if len(targets) == 0:
            # Every image unreadable. Under DDP all processes must still run backward together,
            # so the previous batch goes through with a zero loss.
            if previous is None:
                raise RuntimeError("the first batch of the epoch has no readable image")
            images, targets, weight = *previous, 0.0
        previous = (images, targets)
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)

        completes_update = (progress.batches + 1) % accumulation_steps == 0
        with model.no_sync() if ddp and not completes_update else nullcontext():
            with autocast(device, amp_dtype):
                loss = criterion(model(images), targets)
            if weight == 0.0:
                loss = loss * 0.0
            scaled = loss / accumulation_steps
            (scaler.scale(scaled) if scaler else scaled).backward()

        if completes_update:
            if scaler:
                if clip_grad:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(params, clip_grad)
                scaler.step(optimizer)
                scaler.update()
            else:
                if clip_grad:
                    nn.utils.clip_grad_norm_(params, clip_grad)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            num_updates += 1
            scheduler.step_update(num_updates=num_updates)
            if model_ema is not None:
                model_ema.update(unwrap(model))

        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise TrainingDivergedError(
                f"training diverged at step {num_updates}, loss {loss_value} (lower the learning rate, "
                "or clip gradients with TRAIN.CLIP_GRAD)"
            )
        count = len(targets) if weight else 0
        progress.loss_sum += loss_value * count
        progress.seen += count
        progress.batches += 1
        window_images += count

        lr = optimizer.param_groups[0]["lr"]
        now = time.perf_counter()
        speed = window_images * world_size / max(now - window_start, 1e-9)
        bar.update()
        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", img_s=f"{speed:.0f}", refresh=False)
        if print_freq and (index + 1) % print_freq == 0:
            log.info("%s [%d/%d] loss %.4f lr %.3e %.0f images/s", desc, index + 1, usable, loss_value, lr, speed)
            window_start, window_images = now, 0
        if completes_update and on_update is not None:
            progress.train_time += time.perf_counter() - start
            start = time.perf_counter()
            on_update(num_updates, progress)
    bar.close()
    progress.train_time += time.perf_counter() - start
    return {
        "loss": progress.loss_sum / max(progress.seen, 1),
        "lr": optimizer.param_groups[0]["lr"],
        "num_updates": num_updates,
        "progress": progress,
    }


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device | str = "cpu",
    *,
    amp_dtype: torch.dtype | None = None,
    ctx: DistContext | None = None,
) -> dict:
    """Top-1 / top-5 accuracy (in percent) and mean cross-entropy over ``loader``.

    Under DDP each process evaluates its shard; the sums are combined before dividing.
    ``skipped`` counts unreadable images.
    """
    model.eval()
    correct1 = correct5 = loss_sum = 0.0
    seen = skipped = 0
    for batch in loader:
        images, targets, num_skipped = unpack_batch(batch)
        skipped += num_skipped
        if len(targets) == 0:
            continue
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top == targets[:, None]
        correct1 += hits[:, 0].sum().item()
        correct5 += hits.any(dim=1).sum().item()
        seen += len(targets)
    if ctx is not None:
        correct1, correct5, loss_sum, seen, skipped = all_reduce_sum(
            [correct1, correct5, loss_sum, seen, skipped], ctx, torch.device(device)
        )
    denominator = max(int(seen), 1)  # every image of the split may have been unreadable
    return {
        "top1": 100.0 * correct1 / denominator,
        "top5": 100.0 * correct5 / denominator,
        "loss": loss_sum / denominator,
        "images": int(seen),
        "skipped": int(skipped),
    }


# --- building blocks -------------------------------------------------------------------------

@dataclass
class TrainData:
    """What the engine trains and evaluates on."""

    train: Dataset
    val: Dataset
    num_classes: int
    model_kwargs: dict = field(default_factory=dict)  # what the data imposes on the model (in_chans, img_size)
    mixup: Callable | None = None
    train_collate: Callable | None = None
    val_collate: Callable | None = None


def build_data(cfg: Config, ctx: DistContext | None = None) -> TrainData:
    """The embedded data set named by ``DATA.DATASET`` (digits), else the folder ``DATA.DATA_PATH``."""
    if cfg.DATA.DATASET in DATASETS:
        spec = get_data_spec(cfg.DATA.DATASET)
        train_set, val_set = spec.build(augment=cfg.AUG.DIGITS_SHIFT)
        return TrainData(train_set, val_set, spec.num_classes, {"in_chans": spec.in_chans, "img_size": spec.img_size})
    from ..data.folder import build_folder_datasets, build_mixup

    train_set, val_set, num_classes = build_folder_datasets(cfg, is_distributed=bool(ctx and ctx.is_distributed))
    return TrainData(
        train_set, val_set, num_classes, mixup=build_mixup(cfg, num_classes),
        train_collate=getattr(train_set, "collate_fn", None), val_collate=getattr(val_set, "collate_fn", None),
    )


def model_kwargs_from_config(cfg: Config, arch: str, data_kwargs: dict) -> dict:
    """Everything but ``num_classes`` that ``timm.create_model`` gets (stored in checkpoints)."""
    kwargs = dict(data_kwargs)
    if cfg.MODEL.DROP_RATE:
        kwargs["drop_rate"] = cfg.MODEL.DROP_RATE
    kwargs["drop_path_rate"] = cfg.MODEL.DROP_PATH_RATE
    if "img_size" not in kwargs and cfg.DATA.IMG_SIZE != _default_img_size(arch):
        kwargs["img_size"] = cfg.DATA.IMG_SIZE
    kwargs.update(cfg.MODEL.KWARGS.to_dict())
    return kwargs


def _default_img_size(arch: str) -> int:
    return _default_input_size(arch)[-1]


def _default_input_size(arch: str) -> tuple[int, int, int]:
    from timm.models import get_pretrained_cfg

    pretrained_cfg = get_pretrained_cfg(arch)
    return tuple(pretrained_cfg.input_size) if pretrained_cfg is not None else (3, 224, 224)


def build_criterion(cfg: Config, mixup_fn: Callable | None) -> nn.Module:
    """As the official code: soft targets under Mixup/CutMix, else label smoothing, else plain CE."""
    if mixup_fn is not None:
        return SoftTargetCrossEntropy()  # Mixup folds the label smoothing into its targets
    if cfg.MODEL.LABEL_SMOOTHING > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.MODEL.LABEL_SMOOTHING)
    return nn.CrossEntropyLoss()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} requested but MPS is not available")
    if resolved.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {device!r} cannot run models: use 'cpu' or 'cuda'")
    return resolved


def amp_dtype_for(cfg: Config, device: torch.device) -> torch.dtype | None:
    if not cfg.AMP:
        return None
    if device.type != "cuda":
        return torch.bfloat16
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[cfg.AMP_DTYPE]


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


def _tensorboard(folder: Path):
    """A SummaryWriter when TensorBoard is installed, else None (silently)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder / "tensorboard"))


_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # polaformer.checkpoint.atomic_write's temporary files


# --- the trainer -----------------------------------------------------------------------------

class Trainer:
    """Everything one training run needs; :meth:`fit` runs it. See the module docstring."""

    def __init__(self, config: Config | TrainConfig, *, data: TrainData | None = None, opts: Sequence = ()):
        self.given_config = config
        cfg = config_from_train_config(config) if isinstance(config, TrainConfig) else config.clone().defrost()
        merge_opts(cfg, opts)
        check_config(cfg)
        self.device = resolve_device(cfg.DEVICE)
        self.lock: OutputLock | None = None
        self.last_saved: Path | None = None  # the last checkpoint this run wrote
        self.ctx = init_distributed(self.device.type)
        try:
            self._setup(cfg, data)
        except BaseException:
            self._release()
            shutdown(self.ctx)
            raise

    def _setup(self, cfg: Config, data: TrainData | None) -> None:
        ctx = self.ctx
        if self.device.type == "cuda" and ctx.is_distributed:
            self.device = torch.device("cuda", ctx.local_rank)
        seed_everything(cfg.SEED + ctx.rank)  # the official per-process seed
        self.output = Path(cfg.OUTPUT or Path("runs") / cfg.MODEL.NAME)
        cfg.OUTPUT = str(self.output)
        if ctx.is_main:  # before anything is built: a busy or unwritable folder fails at once
            self.lock = OutputLock(self.output)
        self.data = data or build_data(cfg, ctx)
        self.arch = resolve_model_name(cfg)
        self.model_kwargs = model_kwargs_from_config(cfg, self.arch, self.data.model_kwargs)
        cfg.MODEL.NUM_CLASSES = self.data.num_classes
        self.cfg = cfg.freeze()
        self.resume_path = self._find_resume()
        self._check_no_finished_run()
        self._check_channels()

        model = create_model(self.arch, self.data.num_classes, **self.model_kwargs)
        if cfg.TRAIN.USE_CHECKPOINT:
            if not hasattr(model, "set_grad_checkpointing"):
                raise ConfigError(f"TRAIN.USE_CHECKPOINT: model {self.arch!r} has no set_grad_checkpointing()")
            model.set_grad_checkpointing(True)
        resume = self._read_resume(self.resume_path) if self.resume_path else None
        if resume is not None:
            load_model_state(model, resume, arch=self.arch, path=self.resume_path)
        elif cfg.MODEL.PRETRAINED:
            from ..finetune import load_for_finetune

            result = load_for_finetune(model, cfg.MODEL.PRETRAINED)
            log.info("fine-tuning from %s (%s weights)", cfg.MODEL.PRETRAINED, result.entry or "state dict")
        model.to(self.device)

        self.optimizer = build_optimizer(cfg, model)
        self.model = model
        if ctx.is_distributed:  # rank 0's weights go to every process here
            self.model = nn.parallel.DistributedDataParallel(
                model, device_ids=[ctx.local_rank] if self.device.type == "cuda" else None,
                find_unused_parameters=cfg.TRAIN.FIND_UNUSED_PARAMETERS,
            )
        self.model_ema = None
        if cfg.TRAIN.EMA.ENABLE:  # after DDP: a copy of the weights all processes share
            from timm.utils import ModelEmaV3

            self.model_ema = ModelEmaV3(model, decay=cfg.TRAIN.EMA.DECAY)

        self.accumulation_steps = max(1, cfg.TRAIN.ACCUMULATION_STEPS)
        self._build_loaders()
        self.updates_per_epoch = self.batches_per_epoch // self.accumulation_steps
        if self.updates_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(self.data.train)} images) is smaller than one optimizer update "
                f"(DATA.BATCH_SIZE {cfg.DATA.BATCH_SIZE} x {ctx.world_size} processes x "
                f"TRAIN.ACCUMULATION_STEPS {self.accumulation_steps})"
            )
        self.scheduler = build_scheduler(cfg, self.optimizer, self.updates_per_epoch)
        self.amp_dtype = amp_dtype_for(cfg, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.criterion = build_criterion(cfg, self.data.mixup)
        self.total_epochs = cfg.TRAIN.EPOCHS + cfg.TRAIN.COOLDOWN_EPOCHS

        self.epoch = cfg.TRAIN.START_EPOCH  # epochs completed
        self.progress = EpochProgress()  # of the epoch in progress
        self.num_updates = self.epoch * self.updates_per_epoch
        self.max_accuracy = self.max_accuracy_ema = 0.0
        self.history: list[dict] = []
        self.skip_samples = 0  # of this process's share of the first epoch (a mid-epoch resume)
        if resume is not None:
            self._restore(resume)
            self._check_epochs_left()
        self.scheduler.step_update(num_updates=self.num_updates)

    @property
    def run_files(self) -> list[Path]:
        """The files of a run (this one or an earlier one) present in the output folder."""
        names = (self.cfg.LAST_CHECKPOINT, BEST_CHECKPOINT, BEST_EMA_CHECKPOINT, METRICS_JSONL, METRICS_JSON)
        return [self.output / name for name in names if (self.output / name).exists()]

    def _check_no_finished_run(self) -> None:
        """Starting afresh must not silently replace (and first empty the metrics of) an earlier run;
        and files this run will replace must be replaceable (an immutable one would fail only at the
        end of the first epoch)."""
        for path in self.run_files if self.ctx.is_main else []:
            try:
                open(path, "ab").close()  # writes nothing
            except OSError as e:
                raise ConfigError(f"cannot write {path}: {(e.strerror or str(e)).lower()}") from None
        cfg = self.cfg
        auto = cfg.TRAIN.AUTO_RESUME or cfg.MODEL.RESUME == "auto"  # asked to start afresh if nothing was saved
        if self.resume_path is not None or auto or cfg.OVERWRITE:
            return
        found = [path.name for path in self.run_files]
        if found:
            raise ConfigError(
                f"the output folder {self.output} already holds a run ({', '.join(found)}): --resume auto "
                "continues it, --overwrite replaces it, or choose another --output"
            )

    def _check_channels(self) -> None:
        """A model for other than the data's channels would fail only at the first batch."""
        shape = getattr(self.data.train, "image_shape", None)
        channels = self.model_kwargs.get("in_chans", _default_input_size(self.arch)[0])
        if shape and channels != shape[0]:
            raise ConfigError(
                f"model {self.arch!r} is built for {channels}-channel images (in_chans={channels}) but the "
                f"images of {self.cfg.DATA.DATA_PATH} are read as {shape[0]}-channel"
            )

    def _check_epochs_left(self) -> None:
        """A resumed run with no epoch left writes nothing: refuse, unless it is this folder's own run."""
        if self.epoch < self.total_epochs:
            return
        if self.resume_path.resolve() != self.last_path.resolve():
            raise ConfigError(
                f"nothing to train: {self.resume_path} has completed {self.epoch} epochs and the run has "
                f"{self.total_epochs} (TRAIN.EPOCHS); give more epochs to continue it"
            )
        if self.ctx.is_main:
            log.info("%s has completed all %d epochs: nothing to train", self.resume_path, self.total_epochs)

    # building

    def _build_loaders(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        pin = self.device.type == "cuda" and cfg.DATA.PIN_MEMORY
        self.sampler = TrainSampler(self.data.train, ctx, seed=cfg.SEED)
        # Its own generator: creating an iterator must not draw from the global RNG (resuming
        # restores that), and it seeds the workers per epoch and process (see _train_epoch).
        self.loader_generator = torch.Generator()
        self.train_loader = DataLoader(
            self.data.train, batch_size=cfg.DATA.BATCH_SIZE, sampler=self.sampler, drop_last=True,
            num_workers=cfg.DATA.NUM_WORKERS, pin_memory=pin, collate_fn=self.data.train_collate,
            generator=self.loader_generator,
        )
        self.batches_per_epoch = len(self.train_loader) // max(1, cfg.TRAIN.ACCUMULATION_STEPS) * max(
            1, cfg.TRAIN.ACCUMULATION_STEPS)
        self.val_loader = DataLoader(
            self.data.val, batch_size=cfg.TEST.BATCH_SIZE or cfg.DATA.BATCH_SIZE, sampler=ShardSampler(self.data.val, ctx),
            num_workers=cfg.DATA.NUM_WORKERS, pin_memory=pin, collate_fn=self.data.val_collate,
        )

    # resuming

    @property
    def last_path(self) -> Path:
        return self.output / self.cfg.LAST_CHECKPOINT

    def _find_resume(self) -> Path | None:
        cfg = self.cfg
        if cfg.MODEL.RESUME and cfg.MODEL.RESUME != "auto":
            return Path(cfg.MODEL.RESUME)
        if cfg.TRAIN.AUTO_RESUME or cfg.MODEL.RESUME == "auto":
            if self.last_path.is_file():
                return self.last_path
            if self.ctx.is_main:
                log.info("no checkpoint %s yet: starting from scratch", self.last_path)
        return None

    def _read_resume(self, path: Path) -> dict:
        checkpoint = load_checkpoint(path)  # ours: weights and how to rebuild the model
        missing = [key for key in ("optimizer", "lr_scheduler", "epoch") if key not in checkpoint]
        if missing:
            raise CorruptCheckpointError(
                path, f"holds weights but no training state ({', '.join(missing)}): use --finetune to start from it"
            )
        if checkpoint["num_classes"] != self.data.num_classes:
            raise ArchitectureMismatchError(
                f"checkpoint {path} was trained for {checkpoint['num_classes']} classes, the data has "
                f"{self.data.num_classes}: use --finetune to start from it"
            )
        return checkpoint

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
        if self.model_ema is not None:
            if checkpoint.get("model_ema") is not None:
                self.model_ema.module.load_state_dict(checkpoint["model_ema"])
            else:
                log.warning("%s has no EMA weights: the EMA restarts from the model's", self.resume_path)
                self.model_ema.module.load_state_dict(unwrap(self.model).state_dict())
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["lr_scheduler"])
        if checkpoint.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(checkpoint["scaler"])
        self.epoch = int(checkpoint["epoch"])
        self.num_updates = int(checkpoint.get("num_updates", self.epoch * self.updates_per_epoch))
        self.max_accuracy = float(checkpoint.get("max_accuracy", 0.0))
        self.max_accuracy_ema = float(checkpoint.get("max_accuracy_ema", 0.0))
        self.history = list(checkpoint.get("history", []))
        self._restore_position(checkpoint)
        states = checkpoint.get("rng") or []
        if len(states) == ctx.world_size:
            set_rng_state(states[ctx.rank], self.device)
        else:
            log.warning("%s holds random states for %d processes, not %d: reseeding", self.resume_path, len(states),
                        ctx.world_size)
            seed_everything(self.cfg.SEED + ctx.rank + 1000 * self.epoch + self.num_updates)
        if ctx.is_main:
            log.info("resumed from %s: epoch %d, step %d of %d, %d updates, best top-1 %.2f%%", self.resume_path,
                     self.epoch, self.progress.batches, self.batches_per_epoch, self.num_updates, self.max_accuracy)

    def _restore_position(self, checkpoint: dict) -> None:
        """Where in the epoch a mid-epoch checkpoint was written, and the epoch's running totals."""
        ctx, batch_size = self.ctx, self.cfg.DATA.BATCH_SIZE
        step = int(checkpoint.get("step", 0))
        if not step:
            return
        progresses = checkpoint.get("epoch_progress") or [{}]
        layout = (checkpoint.get("world_size"), checkpoint.get("batch_size"))
        if layout == (ctx.world_size, batch_size) and len(progresses) == ctx.world_size:
            self.progress = EpochProgress(**progresses[ctx.rank])
        else:
            # Another process count or batch size: continue after the samples of the epoch's
            # permutation already trained, rounded down to whole updates; rank 0 carries the totals.
            done = step * layout[1] * layout[0]
            batches = done // (batch_size * ctx.world_size)
            batches -= batches % self.accumulation_steps
            log.warning("resuming mid-epoch with %d processes x batch %d (checkpoint: %d x %d): continuing at "
                        "batch %d of the epoch", ctx.world_size, batch_size, *layout, batches)
            totals = {key: sum(p.get(key, 0) for p in progresses) for key in ("loss_sum", "seen", "skipped")}
            self.progress = EpochProgress(batches=batches, **(totals if ctx.is_main else {}))
        self.skip_samples = self.progress.batches * batch_size

    # saving

    def _state(self, per_process: list[dict]) -> dict:
        return {
            "model": unwrap(self.model).state_dict(),
            **({"model_ema": self.model_ema.module.state_dict()} if self.model_ema is not None else {}),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,  # epochs completed
            "step": self.progress.batches,  # batches of each process done in the next epoch
            "num_updates": self.num_updates,
            "epoch_progress": [p["progress"] for p in per_process],  # per process
            "max_accuracy": self.max_accuracy,
            "max_accuracy_ema": self.max_accuracy_ema,
            "history": self.history,
            "metrics": self.history[-1] if self.history and not self.progress.batches else {},
            "config": self.cfg.to_dict(),
            "arch": self.arch,
            "model_kwargs": self.model_kwargs,
            "num_classes": self.data.num_classes,
            "world_size": self.ctx.world_size,
            "batch_size": self.cfg.DATA.BATCH_SIZE,
            "rng": [p["rng"] for p in per_process],  # per process
        }

    def save(self, names: list[str]) -> None:
        """Write the training state to ``names`` in the output folder (rank 0; all processes call)."""
        per_process = all_gather_object({"rng": rng_state(self.device), "progress": self.progress.to_dict()}, self.ctx)
        if not self.ctx.is_main or not names:
            return
        state = self._state(per_process)
        first = atomic_write(self.output / names[0], lambda f: torch.save(state, f))
        self.last_saved = first
        for name in names[1:]:
            atomic_write(self.output / name, lambda f: f.write(first.read_bytes()))

    def _on_update(self, num_updates: int, progress: EpochProgress) -> None:
        self.num_updates = num_updates
        every = self.cfg.TRAIN.SAVE_FREQ_STEPS
        if every and num_updates % every == 0 and progress.batches < self.batches_per_epoch:
            self.save([self.cfg.LAST_CHECKPOINT])

    # the run

    def fit(self) -> dict:
        """Train the remaining epochs; returns what ``metrics.json`` holds at the end."""
        cfg, ctx = self.cfg, self.ctx
        start = time.perf_counter()
        writer = None
        if ctx.is_main:
            self._prepare_output()
            writer = _tensorboard(self.output)
            log.info(
                "training %s (%.2fM parameters) on %s: %d train / %d val images, %d classes, %d epochs, "
                "%d processes x batch %d x %d accumulation = global batch %d, lr %.3e, device %s%s",
                self.arch, sum(p.numel() for p in self.model.parameters()) / 1e6,
                cfg.DATA.DATASET if cfg.DATA.DATASET in DATASETS else cfg.DATA.DATA_PATH,
                len(self.data.train), len(self.data.val), self.data.num_classes, self.total_epochs,
                ctx.world_size, cfg.DATA.BATCH_SIZE, self.accumulation_steps, global_batch_size(cfg),
                cfg.TRAIN.BASE_LR * lr_scale(cfg), self.device,
                f", AMP {str(self.amp_dtype).removeprefix('torch.')}" if self.amp_dtype else "",
            )
        try:
            for epoch in range(self.epoch, self.total_epochs):
                record = self._train_epoch(epoch)
                if ctx.is_main:
                    self._write_metrics(record, start, writer)
        finally:
            if writer is not None:
                writer.close()
        summary = self._summary(start)
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
        self.output.mkdir(parents=True, exist_ok=True)
        for path in self.output.iterdir():  # left by a run killed while writing
            if _TEMPORARY.match(path.name):
                path.unlink(missing_ok=True)
        if self.cfg.OVERWRITE and self.resume_path is None:  # --overwrite: no file of the old run stays
            for path in self.run_files:
                path.unlink()
        # metrics.jsonl holds exactly the epochs of the checkpoint we continue from.
        lines = "".join(json.dumps(record) + "\n" for record in self.history)
        atomic_write(self.output / METRICS_JSONL, lambda f: f.write(lines.encode()))

    def _train_epoch(self, epoch: int) -> dict:
        cfg, ctx = self.cfg, self.ctx
        self.sampler.set_epoch(epoch)
        resuming = self.progress.batches > 0
        self.sampler.set_start(self.skip_samples if resuming else 0)
        # Workers (if any) are seeded from this: the same per epoch and process whatever came before.
        self.loader_generator.manual_seed(cfg.SEED + 1_000_003 * epoch + ctx.rank)
        progress = self.progress = self.progress if resuming else EpochProgress()
        result = train_one_epoch(
            self.model, self.train_loader, self.optimizer, self.scheduler, self.criterion,
            num_updates=self.num_updates, clip_grad=cfg.TRAIN.CLIP_GRAD, device=self.device,
            desc=f"epoch {epoch + 1}/{self.total_epochs}", accumulation_steps=self.accumulation_steps,
            amp_dtype=self.amp_dtype, scaler=self.scaler, mixup_fn=self.data.mixup, model_ema=self.model_ema,
            progress=progress, on_update=self._on_update, show_progress=ctx.is_main, world_size=ctx.world_size,
            print_freq=cfg.PRINT_FREQ if ctx.is_main else 0,
        )
        self.num_updates = result["num_updates"]
        loss_sum, seen, skipped, train_time = all_reduce_sum(
            [progress.loss_sum, progress.seen, progress.skipped, progress.train_time], ctx, self.device)
        train_time /= ctx.world_size

        eval_start = time.perf_counter()
        test = evaluate(unwrap(self.model), self.val_loader, self.device, amp_dtype=self.amp_dtype, ctx=ctx)
        record = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / max(seen, 1),
            "lr": result["lr"],
            "test_top1": test["top1"],
            "test_top5": test["top5"],
            "test_loss": test["loss"],
        }
        if self.model_ema is not None:
            ema = evaluate(self.model_ema.module, self.val_loader, self.device, amp_dtype=self.amp_dtype, ctx=ctx)
            record.update(ema_top1=ema["top1"], ema_top5=ema["top5"], ema_loss=ema["loss"])
        improved = test["top1"] >= self.max_accuracy
        self.max_accuracy = max(self.max_accuracy, test["top1"])
        improved_ema = self.model_ema is not None and record["ema_top1"] >= self.max_accuracy_ema
        if self.model_ema is not None:
            self.max_accuracy_ema = max(self.max_accuracy_ema, record["ema_top1"])
        record.update(
            max_test_top1=self.max_accuracy,
            images_per_s=seen / max(train_time, 1e-9),
            skipped_images=int(skipped + test["skipped"]),
            num_updates=self.num_updates,
            epoch_time_s=train_time + time.perf_counter() - eval_start,
        )
        self.history.append(record)
        self.epoch, self.progress = epoch + 1, EpochProgress()

        names = []
        if (epoch + 1) % cfg.SAVE_FREQ == 0 or epoch + 1 == self.total_epochs:
            names.append(cfg.LAST_CHECKPOINT)
        if improved:
            names.append(BEST_CHECKPOINT)
        if improved_ema:
            names.append(BEST_EMA_CHECKPOINT)
        self.save(names)

        if ctx.is_main:
            ema_text = f", EMA top-1 {record['ema_top1']:.2f}%" if self.model_ema is not None else ""
            skipped_text = f", {record['skipped_images']} unreadable images skipped" if record["skipped_images"] else ""
            log.info(
                "epoch %d/%d: train loss %.4f, test top-1 %.2f%%%s, test loss %.4f, %.0f images/s (%.1fs)%s",
                epoch + 1, self.total_epochs, record["train_loss"], record["test_top1"], ema_text,
                record["test_loss"], record["images_per_s"], record["epoch_time_s"], skipped_text,
            )
        return record

    def _write_metrics(self, record: dict, start: float, writer) -> None:
        with open(self.output / METRICS_JSONL, "a") as f:
            f.write(json.dumps(record) + "\n")
        write_json(self.output / METRICS_JSON, self._summary(start))
        if writer is not None:
            for key, value in record.items():
                if key != "epoch":
                    writer.add_scalar(key, value, record["epoch"])
            writer.flush()

    def _summary(self, start: float) -> dict:
        given = self.given_config
        summary = {
            "config": given.to_dict(),
            "checkpoint": str(self.last_path),
            "output": str(self.output),
            "world_size": self.ctx.world_size,
            "global_batch_size": global_batch_size(self.cfg, self.ctx.world_size),
            "epochs": self.history,
        }
        if self.history:
            final = self.history[-1]
            summary.update(
                final_test_top1=final["test_top1"],
                final_test_top5=final["test_top5"],
                final_test_loss=final["test_loss"],
                best_test_top1=self.max_accuracy,
            )
            if self.model_ema is not None:
                summary.update(final_ema_top1=final["ema_top1"], best_ema_top1=self.max_accuracy_ema)
        summary["wall_time_s"] = time.perf_counter() - start
        return summary


def run_training(config: Config | TrainConfig, *, data: TrainData | None = None, opts: Sequence = ()) -> dict:
    """Train as ``config`` says (see :class:`Trainer`); returns the contents of ``metrics.json``.

    ``data`` replaces the data sets the configuration names (tests, custom data); ``opts`` are
    ``KEY VALUE`` overrides applied to the configuration (a TrainConfig's after its conversion).
    """
    trainer = Trainer(config, data=data, opts=opts)
    try:
        return trainer.fit()
    except KeyboardInterrupt:
        raise TrainingInterrupted(trainer.last_saved) from None
    finally:
        trainer.close()


# --- digits helpers kept for `polaformer eval` -----------------------------------------------

def make_test_loader(test_set, num_workers: int = 0) -> DataLoader:
    return DataLoader(test_set, batch_size=EVAL_BATCH_SIZE, shuffle=False, num_workers=num_workers)


def model_kwargs_for(config: TrainConfig) -> dict:
    """The kwargs (besides ``num_classes``) a digits run builds ``config.model`` with."""
    cfg = config_from_train_config(config)
    spec = get_data_spec(config.data)
    arch = resolve_model_name(cfg)
    return model_kwargs_from_config(cfg, arch, {"in_chans": spec.in_chans, "img_size": spec.img_size})


def evaluate_checkpoint(
    path, data: str | None = None, arch: str | None = None, device: str = "auto", *, allow_nonfinite: bool = False
) -> tuple[dict, dict]:
    """Rebuild the model saved at ``path`` and evaluate it on the test split of ``data``.

    ``data`` defaults to the data set the checkpoint was trained on; ``arch``, if given, must
    match the checkpoint's architecture; NaN/inf weights are refused unless ``allow_nonfinite``.
    Returns ``(metrics, checkpoint)``.
    """
    checkpoint = load_checkpoint(path)
    model = create_model_from_checkpoint(checkpoint, path, arch=arch, allow_nonfinite=allow_nonfinite)
    data = data or _trained_on(checkpoint.get("config"))
    _, test_set = get_data_spec(data).build(augment=False)
    device = resolve_device(device)
    return evaluate(model.to(device), make_test_loader(test_set), device), checkpoint


def _trained_on(config: Any) -> str:
    if not isinstance(config, dict):
        return DEFAULT_DATA
    if isinstance(config.get("DATA"), dict):  # the official key tree
        return config["DATA"].get("DATASET", DEFAULT_DATA)
    return config.get("data", DEFAULT_DATA)  # a TrainConfig of earlier versions


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))
