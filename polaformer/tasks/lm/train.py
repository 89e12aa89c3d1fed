"""Training, evaluation (bits per byte) and sampling of the ``pola_lm_*`` models as a step-based task of the one
engine (:mod:`polaformer.engine.loop`): AdamW, linear warm-up then cosine decay, global-norm clipping; every
``eval_every`` steps the validation bits per byte, ``best.pth`` (lowest) and ``last.pth``; ``metrics.json`` also
holds the unigram baseline of the same split, the bits per byte of a model that ignores context."""
from __future__ import annotations

import math

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from ... import models  # noqa: F401  (registers pola_lm_*)
from ...data.text import ByteWindows, stdlib_corpus
from ...engine.config import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE_INT,
    SEED,
    Config,
    ConfigError,
    Range,
    check_settings,
    configure,
    fraction,
    unit,
)
from ...engine.distributed import all_reduce_sum, shard
from ...engine.loop import Engine, StepOutput, train
from ...engine.optim import warmup_cosine
from ...engine.steps import StepTask, check_train_options, load_task_model, saved_config, step_settings, train_defaults
from ...limits import check_allocation

__all__ = ["RULES", "SAMPLING", "LMTask", "check_lm_config", "evaluate_bits_per_byte", "lm_config", "load_lm_model",
           "train_lm", "unigram_bits_per_byte"]

BEST = "best.pth"

# the range of every numeric setting besides the engine options (engine/config.py checks them, naming the key)
RULES = {
    "model.context": POSITIVE_INT, "model.drop_rate": unit(),
    "data.max_bytes": COUNT.but(note="0: all"), "data.valid_fraction": fraction(), "data.seed": SEED,
    "train.eval_batches": COUNT.but(note="0: all"),
}
# `lm sample` and `lm eval`: the options that are no configuration keys
SAMPLING = {
    "length": Range(integer=True, low=1, high=2**20),  # one step per byte: a million is minutes, a billion days
    "temperature": NON_NEGATIVE.but(note="0: greedy"), "top_k": COUNT.but(note="0: all"), "seed": SEED,
    "batches": COUNT.but(note="0: all"),
}


def lm_config(path=None, opts=(), overrides=None, *, check: bool = True) -> Config:
    """The defaults, then a YAML file, then ``KEY VALUE`` overrides, then ``overrides`` (``{'train.lr': 1e-3}``, from
    command-line flags) (:func:`~polaformer.engine.config.configure`); checked (:func:`check_lm_config`)
    unless ``check`` is false (a caller that hands it to :func:`train_lm`, which checks it)."""
    cfg = Config({
        "model": {"name": "pola_lm_tiny", "attention": "pola", "context": 128, "drop_rate": 0.0},
        "data": {"max_bytes": 0, "valid_fraction": 0.05, "seed": 0},
        # a few minutes on a laptop CPU, well under the unigram baseline (docs/causal.md)
        "train": train_defaults("lm", steps=600, batch_size=16, eval_every=200, lr=3e-3, warmup_steps=50,
                                      weight_decay=0.01, clip_grad_norm=1.0, eval_batches=25),
    })
    return configure(cfg, path, opts, overrides, check=check_lm_config if check else None)


def check_lm_config(cfg: Config) -> None:
    """Every setting in its range (:data:`RULES`, the engine options'), a known attention, a position table that fits
    in memory."""
    check_settings(cfg, RULES)
    check_train_options(cfg, "lm")
    if cfg.model.attention not in models.pola_lm.ATTENTIONS:
        raise ConfigError(f"model.attention must be one of {', '.join(models.pola_lm.ATTENTIONS)}, "
                          f"got {cfg.model.attention!r}")
    width = models.pola_lm.SIZES.get(cfg.model.name.removeprefix("pola_lm_"), {}).get("dim", 1)
    check_allocation(f"model.context {cfg.model.context} (a position table of {cfg.model.context} x {width})",
                     4 * cfg.model.context * width, "cpu", ConfigError, "use a shorter context")


def build_lm(cfg: Config) -> nn.Module:
    m = cfg.model
    try:
        return timm.create_model(m.name, attention=m.attention, context=m.context, drop_rate=m.drop_rate)
    except (RuntimeError, ValueError) as e:  # timm's unknown model, a size the model refuses
        raise ConfigError(f"cannot build model {m.name!r}: {str(e).splitlines()[0]}") from None


@torch.no_grad()
def evaluate_bits_per_byte(model: nn.Module, loader: DataLoader, device, max_batches: int = 0,
                           progress: bool = False) -> dict:
    """Mean next-byte cross-entropy in bits over ``loader`` (its first ``max_batches`` if > 0); ``progress``: a
    progress bar on a terminal."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    batches = min(len(loader), max_batches) if max_batches else len(loader)
    for i, (inputs, targets) in enumerate(tqdm(loader, total=batches, desc="evaluating", leave=False,
                                               disable=None if progress else True)):
        if max_batches and i >= max_batches:
            break
        logits = model(inputs.to(device)).float()
        total += F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    return {"bits_per_byte": total / max(count, 1) / math.log(2), "bytes": count}


def unigram_bits_per_byte(train_bytes: torch.Tensor, valid_bytes: torch.Tensor) -> float:
    """Bits per byte on ``valid_bytes`` of the training split's byte frequencies (add-one smoothed)."""
    counts = torch.bincount(train_bytes.long(), minlength=256).double() + 1
    log_p = (counts / counts.sum()).log2()
    return -log_p[valid_bytes.long()].mean().item()


def byte_windows(data: torch.Tensor, cfg: Config, split: str) -> ByteWindows:
    """Windows of ``model.context`` bytes of one split; a split shorter than one window is a one-line error."""
    if len(data) < cfg.model.context + 1:
        raise ConfigError(f"the {split} split has {len(data)} bytes (data.max_bytes {cfg.data.max_bytes}), fewer than "
                          f"one window of model.context {cfg.model.context} + 1")
    return ByteWindows(data, cfg.model.context)


class LMTask(StepTask):
    name = "lm"
    best_files = {BEST: "neg_valid_bpb"}
    resume_may_change = ("train.steps", "train.eval_every", "train.eval_batches", "train.num_workers")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        d = cfg.data
        self.train_bytes, self.valid_bytes = stdlib_corpus(d.max_bytes, d.valid_fraction, d.seed)
        self.train_set = byte_windows(self.train_bytes, cfg, "training")
        self.valid_set = byte_windows(self.valid_bytes, cfg, "validation")

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        # train.eval_batches counts batches of the global batch (train.batch_size x processes): every process
        # count scores the same windows, each process every K-th of them
        t = self.cfg.train
        windows = shard(self.valid_set, engine.ctx, t.eval_batches * t.batch_size * engine.ctx.world_size)
        self.valid_loader = DataLoader(windows, batch_size=t.batch_size, shuffle=False, generator=torch.Generator())
        return build_lm(self.cfg)

    def start_message(self, engine: Engine) -> str:
        return self.opening(engine, f"{self.cfg.model.name} ({self.cfg.model.attention})",
                            f"{len(self.train_bytes)} train / {len(self.valid_bytes)} valid bytes")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return warmup_cosine(optimizer, self.cfg.train.warmup_steps, self.cfg.train.steps)

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        inputs, targets = (x.to(device, non_blocking=True) for x in batch)
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return StepOutput(loss, len(inputs))

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        mine = evaluate_bits_per_byte(model, self.valid_loader, engine.device)
        bits, count = all_reduce_sum([mine["bits_per_byte"] * mine["bytes"], mine["bytes"]], engine.ctx, engine.device)
        return {"bits_per_byte": bits / max(count, 1), "bytes": int(count)}

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        bpb = results["model"]["bits_per_byte"]
        return {"step": engine.num_updates, "lr": train["lr"], "train_bpb": train["loss"] / math.log(2),
                "valid_bpb": bpb, "neg_valid_bpb": -bpb, "elapsed_s": engine.elapsed}

    def describe(self, record: dict, improved: bool) -> str:
        return self.evaluation_line(record, improved, f"train {record['train_bpb']:.3f} bits/byte, "
                                                      f"valid {record['valid_bpb']:.3f}")

    def summary(self, engine: Engine) -> dict:
        return self.run_summary(
            engine, {"model": self.cfg.model.name, "attention": self.cfg.model.attention},
            {"best_valid_bpb": -engine.best.get("neg_valid_bpb", -float("inf")),
             "unigram_valid_bpb": unigram_bits_per_byte(self.train_bytes, self.valid_bytes)})


def train_lm(cfg: Config, output, **options) -> dict:
    """Train as ``cfg`` says into ``output``; returns ``metrics.json``'s contents. ``options``: resume, overwrite,
    device, show_progress, allow_changed (:func:`~polaformer.engine.steps.step_settings`)."""
    check_lm_config(cfg)
    return train(LMTask(cfg), step_settings(cfg, output, **options))


def load_lm_model(path) -> tuple[nn.Module, Config]:
    """The model a checkpoint of :func:`train_lm` holds, and its configuration."""
    def rebuild(checkpoint):
        cfg = saved_config(checkpoint, lm_config(check=False), check_lm_config)
        return build_lm(cfg), cfg

    return load_task_model(path, LMTask.name, "language model", rebuild)
