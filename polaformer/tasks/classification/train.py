"""Image classification over the engine: the digits demo and ImageNet-scale runs.

:func:`run_training` takes a :class:`~polaformer.engine.config.Config` (the official key tree of :mod:`.config`) or
the digits demo's :class:`~.config.TrainConfig` and trains
:class:`ClassificationTask` through the one loop (:mod:`.loop`, which owns checkpoints, resume,
DDP, EMA, AMP and the output folder):

- data: the embedded ``digits`` set, or an ImageNet-layout folder (``DATA.DATA_PATH``) through
  :mod:`polaformer.data.folder` (timm transforms, Mixup/CutMix, unreadable images skipped and
  counted), or tar shards there, streamed (:mod:`polaformer.data.shards`);
- optimisation (:mod:`.optim`): AdamW without weight decay on norms/biases/position tables/
  attention temperatures, lr scaled with the global batch, cosine schedule with warm-up and
  cool-down stepped per update, gradient clipping and accumulation, AMP, weight EMA (timm
  ``ModelEmaV3``) evaluated next to the raw weights, activation checkpointing;
- files: ``last.pth`` after every epoch (and every ``TRAIN.SAVE_FREQ_STEPS`` updates),
  ``best.pth`` (and ``best_ema.pth``) when the top-1 improves, one JSON line per epoch in
  ``metrics.jsonl``, ``metrics.json`` (configuration, all epochs, final and best accuracy),
  TensorBoard when it is installed.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ...checkpoint import ArchitectureMismatchError, CorruptCheckpointError
from ...data import DATASETS, DEFAULT_DATA, get_data_spec
from ...engine.checkpoint import REQUIRED_KEYS, check_metadata, load_model_state, read_run_checkpoint
from ...engine.config import Config, ConfigError, merge_opts
from ...engine.device import autocast, place_model, resolve_device
from ...engine.distributed import DistContext, ShardSampler, all_reduce_sum
from ...engine.factory import check_forward, create_model, create_model_from_checkpoint
from ...engine.loop import Engine, LoopSettings, StepOutput, Task, train
from ...engine.optim import build_optimizer, build_scheduler, global_batch_size, lr_scale, unwrap
from ...engine.options import CLASSIFICATION, loop_kwargs, official_values, resumable_keys
from ...engine.parallel import SHARDED
from .config import DIGITS_EVAL_BATCH_SIZE, TrainConfig, check_config, config_from_train_config, resolve_model_name

log = logging.getLogger(__name__)

EVAL_BATCH_SIZE = DIGITS_EVAL_BATCH_SIZE  # `polaformer eval` on digits batches like training did
BEST_CHECKPOINT = "best.pth"
BEST_EMA_CHECKPOINT = "best_ema.pth"
MERGED_CHECKPOINT = "merged.pth"  # a LoRA run's last weights, adapters merged


def unpack_batch(batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(images, targets)`` or ``(images, targets, num_skipped)`` -> all three."""
    if len(batch) == 3:
        images, targets, skipped = batch
        return images, targets, int(skipped)
    images, targets = batch
    return images, targets, 0


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
    """The embedded data set named by ``DATA.DATASET`` (digits), else the shards or the folder ``DATA.DATA_PATH``:
    shards when ``DATA.DATASET`` is ``wds/NAME`` (timm's name) or the folder holds a shard info file or
    ``train/*.tar``."""
    if cfg.DATA.DATASET in DATASETS:
        spec = get_data_spec(cfg.DATA.DATASET)
        train_set, val_set = spec.build(augment=cfg.AUG.DIGITS_SHIFT)
        return TrainData(train_set, val_set, spec.num_classes, {"in_chans": spec.in_chans, "img_size": spec.img_size})
    from ...data.folder import build_folder_datasets, build_mixup
    from ...data.shards import build_shard_datasets, is_shard_folder

    shards = str(cfg.DATA.DATASET).startswith("wds/") or (
        bool(cfg.DATA.DATA_PATH) and is_shard_folder(os.path.expanduser(cfg.DATA.DATA_PATH)))
    build = build_shard_datasets if shards else build_folder_datasets
    train_set, val_set, num_classes = build(cfg, is_distributed=bool(ctx and ctx.is_distributed))
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


# --- the task --------------------------------------------------------------------------------

class ClassificationTask(Task):
    """Images and class labels: top-1/top-5 evaluation, ``best.pth`` by top-1 (``best_ema.pth`` by the EMA's)."""

    name = "classification"
    best_files = {BEST_CHECKPOINT: "test_top1", BEST_EMA_CHECKPOINT: "ema_top1"}
    ties_improve = True
    resume_hint = "use --finetune to start from it"
    # what a resumed run may change: its length, workers, logging and saving cadence and how the model runs (the
    # engine options' declarations), where it starts from and writes to, its evaluation batch, device, and the keys
    # only read when a run starts or that are not used
    execution_keys = resumable_keys(CLASSIFICATION)
    resume_may_change = (
        "TRAIN.AUTO_RESUME", "MODEL.RESUME", "MODEL.PRETRAINED", "DATA.ZIP_MODE", "DATA.CACHE_MODE", "TEST.BATCH_SIZE",
        "OUTPUT", "TAG", "EVAL_MODE", "THROUGHPUT_MODE", "LOCAL_RANK", "DEVICE", "OVERWRITE", "ALLOW_CHANGED",
    )

    def __init__(self, cfg: Config, given_config: Config | TrainConfig, data: TrainData | None = None):
        self.cfg, self.given_config, self.given_data = cfg, given_config, data
        self.previous = None  # the last non-empty batch, stand-in for a batch with no readable image

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        cfg = self.cfg
        self.data = self.given_data or build_data(cfg, engine.ctx)
        self.arch = resolve_model_name(cfg)
        self.model_kwargs = model_kwargs_from_config(cfg, self.arch, self.data.model_kwargs)
        cfg.MODEL.NUM_CLASSES = self.data.num_classes
        cfg.freeze()
        self._check_channels()
        self.train_set, self.train_collate = self.data.train, self.data.train_collate
        val, streamed = self.data.val, isinstance(self.data.val, IterableDataset)
        if streamed:  # it deals its shards out to the processes itself
            val.set_layout(engine.ctx.rank, engine.ctx.world_size)
        self.val_loader = DataLoader(
            val, batch_size=cfg.TEST.BATCH_SIZE or cfg.DATA.BATCH_SIZE,
            sampler=None if streamed else ShardSampler(val, engine.ctx), num_workers=cfg.DATA.NUM_WORKERS,
            pin_memory=engine.device.type == "cuda" and cfg.DATA.PIN_MEMORY, collate_fn=self.data.val_collate,
        )
        self.criterion = build_criterion(cfg, self.data.mixup)

        model = create_model(self.arch, self.data.num_classes, **self.model_kwargs)
        input_size = self._input_size()
        if input_size is not None:  # a size the model cannot take fails here, not at the first batch
            check_forward(model, input_size, self.arch)
        if not resuming and cfg.MODEL.PRETRAINED:
            from ...finetune import load_for_finetune

            result = load_for_finetune(model, cfg.MODEL.PRETRAINED)
            log.info("fine-tuning from %s (%s weights)", cfg.MODEL.PRETRAINED, result.entry or "state dict")
        if cfg.MODEL.LORA:
            from ...lora import add_lora

            head = model.get_classifier()
            model = add_lora(model, cfg.MODEL.LORA, train=tuple(name for name, p in model.named_parameters()
                                                                 if any(p is q for q in head.parameters())))
        return model

    def start_message(self, engine: Engine) -> str:
        cfg, model = self.cfg, engine.model
        return (
            f"training {self.arch} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters) on "
            f"{cfg.DATA.DATASET if cfg.DATA.DATASET in DATASETS else cfg.DATA.DATA_PATH}: "
            f"{_images(self.data.train)} train / {_images(self.data.val)} val images, {self.data.num_classes} classes, "
            f"{engine.settings.epochs} epochs, "
            f"{engine.ctx.world_size} processes x batch {cfg.DATA.BATCH_SIZE} x {engine.accumulation_steps} "
            f"accumulation = global batch {global_batch_size(cfg, engine.ctx.world_size)}, lr "
            f"{cfg.TRAIN.BASE_LR * lr_scale(cfg):.3e}, device {engine.device}"
            + (f", AMP {str(engine.amp_dtype).removeprefix('torch.')}" if engine.amp_dtype else "")
        )

    def _input_size(self) -> tuple[int, int, int] | None:
        """(channels, height, width) of the training images, where the data says."""
        shape = getattr(self.data.train, "image_shape", None)
        if shape:
            return tuple(shape)
        given = self.data.model_kwargs  # an embedded data set's geometry
        if "in_chans" not in given or "img_size" not in given:
            return None
        return given["in_chans"], given["img_size"], given["img_size"]

    def _check_channels(self) -> None:
        """A model for other than the data's channels would fail only at the first batch."""
        shape = getattr(self.data.train, "image_shape", None)
        channels = self.model_kwargs.get("in_chans", _default_input_size(self.arch)[0])
        if shape and channels != shape[0]:
            raise ConfigError(
                f"model {self.arch!r} is built for {channels}-channel images (in_chans={channels}) but the "
                f"images of {self.cfg.DATA.DATA_PATH} are read as {shape[0]}-channel"
            )

    def settings(self) -> dict:
        return self.cfg.to_dict()

    def check_resume(self, checkpoint: dict, path: Path) -> None:
        missing = [key for key in REQUIRED_KEYS
                   if key not in checkpoint and not (key == "model" and SHARDED in checkpoint)]
        if missing:
            raise CorruptCheckpointError(path, f"not a polaformer checkpoint: no {', '.join(map(repr, missing))}")
        check_metadata(checkpoint, path)
        if checkpoint["num_classes"] != self.data.num_classes:
            raise ArchitectureMismatchError(
                f"checkpoint {path} was trained for {checkpoint['num_classes']} classes, the data has "
                f"{self.data.num_classes}: use --finetune to start from it"
            )

    def load_weights(self, model: nn.Module, checkpoint: dict, path: Path) -> None:
        load_model_state(model, checkpoint, arch=self.arch, path=path)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg, model)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return build_scheduler(self.cfg, optimizer, updates_per_epoch)

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        images, targets, skipped = unpack_batch(batch)
        weight = 1.0
        if len(targets) == 0:
            # Every image unreadable. Under DDP all processes must still run backward together,
            # so the previous batch goes through with a zero loss.
            if self.previous is None:
                from ...data.folder import DatasetError

                raise DatasetError(
                    f"the first training batch of this run has no readable image ({skipped} skipped): too many "
                    f"unreadable images in {self.cfg.DATA.DATA_PATH}"
                )
            images, targets, weight = *self.previous, 0.0
        self.previous = (images, targets)
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if self.data.mixup is not None:
            images, targets = self.data.mixup(images, targets)
        loss = self.criterion(model(images), targets)
        if weight == 0.0:
            loss = loss * 0.0
        return StepOutput(loss, len(targets) if weight else 0, {"skipped": skipped})

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        return evaluate(model, self.val_loader, engine.device, amp_dtype=engine.amp_dtype, ctx=engine.ctx)

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        test = results["model"]
        record = {
            "epoch": engine.epoch,
            "train_loss": train["loss"],
            "lr": train["lr"],
            "test_top1": test["top1"],
            "test_top5": test["top5"],
            "test_loss": test["loss"],
        }
        if "ema" in results:
            ema = results["ema"]
            record.update(ema_top1=ema["top1"], ema_top5=ema["top5"], ema_loss=ema["loss"])
        record.update(
            max_test_top1=max(engine.best.get("test_top1", 0.0), test["top1"]),
            images_per_s=train["samples"] / max(train["time"], 1e-9),
            skipped_images=int(train["stats"].get("skipped", 0) + test["skipped"]),
            num_updates=engine.num_updates,
            epoch_time_s=train["time"] + time.perf_counter() - train["eval_start"],
        )
        return record

    def describe(self, record: dict, improved: bool) -> str:
        ema = f", EMA top-1 {record['ema_top1']:.2f}%" if "ema_top1" in record else ""
        skipped = f", {record['skipped_images']} unreadable images skipped" if record["skipped_images"] else ""
        return (f"epoch {record['epoch']}/{self.cfg.TRAIN.EPOCHS + self.cfg.TRAIN.COOLDOWN_EPOCHS}: train loss "
                f"{record['train_loss']:.4f}, test top-1 {record['test_top1']:.2f}%{ema}, test loss "
                f"{record['test_loss']:.4f}, {record['images_per_s']:.0f} images/s ({record['epoch_time_s']:.1f}s)"
                f"{skipped}")

    def summary(self, engine: Engine) -> dict:
        given = self.given_config
        summary = {
            "config": given.to_dict(),
            "checkpoint": str(engine.last_path),
            "output": str(engine.output),
            "world_size": engine.ctx.world_size,
            "global_batch_size": global_batch_size(self.cfg, engine.ctx.world_size),
            "epochs": engine.history,
        }
        if engine.history:
            final = engine.history[-1]
            summary.update(
                final_test_top1=final["test_top1"],
                final_test_top5=final["test_top5"],
                final_test_loss=final["test_loss"],
                best_test_top1=engine.best.get("test_top1", 0.0),
            )
            if engine.model_ema is not None:
                summary.update(final_ema_top1=final["ema_top1"], best_ema_top1=engine.best.get("ema_top1", 0.0))
        summary["wall_time_s"] = time.perf_counter() - engine.started
        return summary

    def finish(self, engine: Engine) -> dict:
        summary = self.summary(engine)
        if self.cfg.MODEL.LORA and engine.ctx.is_main:  # the adapters merged: the plain model's checkpoint
            from ...checkpoint import atomic_write
            from ...lora import merge_lora

            merged = {"model": merge_lora(unwrap(engine.model)).state_dict(), **self.metadata(engine)}
            summary["merged"] = str(atomic_write(engine.output / MERGED_CHECKPOINT,
                                                 lambda f: torch.save(merged, f)))
        return summary

    def metadata(self, engine: Engine) -> dict:
        entries = {
            "max_accuracy": engine.best.get("test_top1", 0.0),
            "arch": self.arch,
            "model_kwargs": self.model_kwargs,
            "num_classes": self.data.num_classes,
        }
        class_names = getattr(self.data.train, "classes", None)
        if class_names is not None:  # a folder's: `eval` checks another folder's names against them
            entries["class_names"] = list(class_names)
        if engine.model_ema is not None:
            entries["max_accuracy_ema"] = engine.best.get("ema_top1", 0.0)
        return entries


def _images(dataset: Dataset) -> int:
    return getattr(dataset, "num_samples", None) or len(dataset)  # a streamed set's len() is per process


def loop_settings(cfg: Config) -> LoopSettings:
    """The engine's settings from the official keys: the engine options (read by the one adapter,
    :func:`~polaformer.engine.options.official_values`), the epochs counting the cool-down, and the run's own keys."""
    options = loop_kwargs(official_values(cfg))
    options["epochs"] += cfg.TRAIN.COOLDOWN_EPOCHS
    return LoopSettings(
        output=Path(cfg.OUTPUT), device=cfg.DEVICE,
        resume="auto" if cfg.TRAIN.AUTO_RESUME or cfg.MODEL.RESUME == "auto" else (cfg.MODEL.RESUME or None),
        allow_changed=tuple(cfg.ALLOW_CHANGED), overwrite=cfg.OVERWRITE, last_name=cfg.LAST_CHECKPOINT, **options,
    )


def _prepare(config: Config | TrainConfig, data: TrainData | None,
             opts: Sequence) -> tuple[ClassificationTask, LoopSettings]:
    cfg = config_from_train_config(config) if isinstance(config, TrainConfig) else config.clone().defrost()
    merge_opts(cfg, opts)
    check_config(cfg)
    cfg.OUTPUT = str(cfg.OUTPUT or Path("runs") / cfg.MODEL.NAME)
    return ClassificationTask(cfg, config, data), loop_settings(cfg)


def build_trainer(config: Config | TrainConfig, *, data: TrainData | None = None, opts: Sequence = ()) -> Engine:
    """The engine for ``config`` (built: folder locked, model made); call ``fit`` then ``close``."""
    return Engine(*_prepare(config, data, opts))


def run_training(config: Config | TrainConfig, *, data: TrainData | None = None, opts: Sequence = ()) -> dict:
    """Train as ``config`` says; returns the contents of ``metrics.json``.

    ``data`` replaces the data sets the configuration names (tests, custom data); ``opts`` are
    ``KEY VALUE`` overrides applied to the configuration (a TrainConfig's after its conversion).
    """
    return train(*_prepare(config, data, opts))


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
    checkpoint = read_run_checkpoint(path)
    model = create_model_from_checkpoint(checkpoint, path, arch=arch, allow_nonfinite=allow_nonfinite)
    data = data or trained_on(checkpoint.get("config"))
    _, test_set = get_data_spec(data).build(augment=False)
    device = resolve_device(device)
    return evaluate(place_model(model, device, inference=True), make_test_loader(test_set), device), checkpoint


def trained_on(config: Any) -> str:
    """The data set a checkpoint's config names (the default data set when it names none)."""
    if not isinstance(config, dict):
        return DEFAULT_DATA
    if isinstance(config.get("DATA"), dict):  # the official key tree
        return config["DATA"].get("DATASET", DEFAULT_DATA)
    return config.get("data", DEFAULT_DATA)  # a TrainConfig of earlier versions

