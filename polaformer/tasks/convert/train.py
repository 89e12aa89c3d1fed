"""The two training stages after a conversion, as one step-based task of the one engine (resumable like every
other):

- ``stage: transfer``: only the new parameters (and with ``transfer.train_qk`` the q/k rows) learn, on the
  attention-transfer loss (:class:`~.transfer.AttentionTransfer`), no weight decay;
- ``stage: finetune``: the whole student learns from the labels and the frozen teacher's soft targets,
  ``(1 − d)·CE(labels) + d·T²·KL(teacher_T ‖ student_T)`` with ``d`` = ``finetune.distill`` and ``T`` =
  ``finetune.temperature``, starting from ``init`` (the transfer run's checkpoint; empty: the plain copy).

Data: ``digits`` (the image classifiers, test top-1 in %), ``folder`` (the image classifiers on the ImageNet-layout
folder ``data.path``, val top-1 in %, with the teacher's own transforms from
:func:`~polaformer.data.folder.model_transforms`)
or ``stdlib`` (the language model, validation bits per byte; its windows are the model's context). Every evaluation
scores the student on the task's metric, so the transfer stage's effect on accuracy is measured, not only its loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ...checkpoint import load_checkpoint
from ...data import get_data_spec
from ...data.folder import model_transforms, open_folder
from ...data.text import ByteWindows, stdlib_corpus
from ...engine.config import COUNT, POSITIVE, SEED, Config, ConfigError, check_settings, configure, fraction, unit
from ...engine.loop import Engine, StepOutput, train
from ...engine.optim import warmup_cosine
from ...engine.steps import StepTask, check_train_options, step_settings, train_defaults
from .build import build_source, convert_model, target_of
from .transfer import AttentionTransfer, freeze_for_transfer
from .weights import FAMILIES, family_of

__all__ = ["ConvertTask", "convert_config", "check_convert_config", "train_convert"]

BEST = "best.pth"
STAGES = ("transfer", "finetune")
DATASETS = ("digits", "folder", "stdlib")
RULES = {
    "data.max_bytes": COUNT.but(note="0: all"), "data.valid_fraction": fraction(), "data.seed": SEED,
    "finetune.distill": unit(high_open=False), "finetune.temperature": POSITIVE,
    "train.eval_batches": COUNT.but(note="0: all"),
}


def convert_config(path=None, opts=(), overrides=None, *, check: bool = True) -> Config:
    """The defaults, then a YAML file, ``KEY VALUE`` overrides and ``overrides`` (command-line flags); checked
    (:func:`check_convert_config`) unless ``check`` is false."""
    cfg = Config({
        "model": {"source": "", "source_kwargs": Config(new_allowed=True, path="model.source_kwargs"),
                  "teacher": "", "target": "", "target_kwargs": Config(new_allowed=True, path="model.target_kwargs")},
        "data": {"name": "digits", "path": "", "augment": True, "max_bytes": 0, "valid_fraction": 0.05, "seed": 0},
        "stage": "transfer",
        "init": "",
        "transfer": {"train_qk": False},
        "finetune": {"distill": 0.5, "temperature": 2.0},
        "train": train_defaults("convert", steps=200, batch_size=32, eval_every=100, lr=1e-3, warmup_steps=10,
                                           weight_decay=0.0, clip_grad_norm=1.0, eval_batches=0),
    })
    return configure(cfg, path, opts, overrides, check=check_convert_config if check else None)


def check_convert_config(cfg: Config) -> None:
    """Ranges (:data:`RULES`), a known stage and data set, a source and its teacher weights named."""
    check_settings(cfg, RULES)
    check_train_options(cfg, "convert", unsharded="conversion (a teacher beside the student)")
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage must be one of {', '.join(STAGES)}, got {cfg.stage!r}")
    if cfg.data.name not in DATASETS:
        raise ConfigError(f"data.name must be one of {', '.join(DATASETS)}, got {cfg.data.name!r}")
    if cfg.data.name == "folder" and not cfg.data.path:
        raise ConfigError("data.name folder reads the ImageNet-layout folder data.path (--data-path DIR)")
    if cfg.data.path and cfg.data.name != "folder":
        raise ConfigError(f"data.path is read with data.name folder, not {cfg.data.name}")
    if not cfg.model.source or not cfg.model.teacher:
        raise ConfigError("name the softmax model (model.source) and its trained weights (model.teacher)")
    if cfg.stage == "transfer" and cfg.train.weight_decay:
        raise ConfigError("the transfer stage trains with train.weight_decay 0 (decay would move the copied rows)")


class ConvertTask(StepTask):
    name = "convert"
    best_files = {BEST: "score"}
    resume_may_change = ("train.steps", "train.eval_every", "train.eval_batches", "train.num_workers")
    valid_collate = None  # the folder's: unreadable images dropped from the batch

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        m = cfg.model
        self.teacher = build_source(m.source, m.source_kwargs.to_dict(), m.teacher)
        self.family = family_of(self.teacher)
        self.target, self.target_kwargs = target_of(self.teacher, m.source, m.source_kwargs.to_dict(), m.target,
                                                    m.target_kwargs.to_dict())
        if self.family is FAMILIES["dit"]:
            raise ConfigError("the transfer and fine-tuning stages are not wired for DiT yet (convert weights is)")
        if cfg.data.name == "stdlib":
            if self.family is not FAMILIES["lm"]:
                raise ConfigError(f"data.name stdlib is text, for the language model; {m.source} is an image model")
            d = cfg.data
            self.train_bytes, valid = stdlib_corpus(d.max_bytes, d.valid_fraction, d.seed)
            self.train_set = ByteWindows(self.train_bytes, self.teacher.context)
            self.valid_set = ByteWindows(valid, self.teacher.context)
        else:
            if self.family is FAMILIES["lm"]:
                raise ConfigError(f"data.name {cfg.data.name} is images; {m.source} is a language model (use stdlib)")
            if cfg.data.name == "digits":
                self.train_set, self.valid_set = get_data_spec("digits").build(augment=cfg.data.augment)
            else:
                self._open_folder(cfg.data)

    def _open_folder(self, data: Config) -> None:
        train_tf, eval_tf, shape = model_transforms(self.teacher, augment=data.augment)
        channels = getattr(self.teacher, "in_chans", 3)  # timm's attribute; pretrained_cfg keeps 3 regardless
        if channels != 3:  # folder images are read as RGB
            raise ConfigError(f"data.name folder gives RGB images; {self.cfg.model.source} takes {channels} channels")
        self.train_set, self.valid_set, classes = open_folder(data.path, train_tf, eval_tf, shape)
        self.train_collate, self.valid_collate = self.train_set.collate_fn, self.valid_set.collate_fn
        heads = self.teacher.num_classes
        if classes != heads:
            raise ConfigError(f"{data.path} has {classes} classes, {self.cfg.model.source}'s head {heads}: convert "
                              "a teacher trained on these classes")

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        cfg = self.cfg
        student, self.report = convert_model(self.teacher, self.target, self.target_kwargs)
        if cfg.stage == "finetune" and cfg.init and not resuming:
            load_checkpoint(student, cfg.init, strict=True)
        self.teacher.to(engine.device)
        self.transfer = None
        if cfg.stage == "transfer":
            self.trained = freeze_for_transfer(student, self.report, cfg.transfer.train_qk)
            self.transfer = AttentionTransfer(self.teacher, student, self.family)
        self.valid_loader = DataLoader(self.valid_set, batch_size=256, shuffle=False, collate_fn=self.valid_collate)
        return student

    def start_message(self, engine: Engine) -> str:
        trained = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
        return self.opening(engine, f"{self.target} from {self.cfg.model.source} ({self.cfg.stage}, {trained} "
                                    "trained)", self.cfg.data.name)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return warmup_cosine(optimizer, self.cfg.train.warmup_steps, self.cfg.train.steps)

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        inputs, labels = (x.to(device, non_blocking=True) for x in batch[:2])  # a folder's batch: + skipped count
        if self.transfer is not None:
            return StepOutput(self.transfer.loss(inputs, student=model), len(inputs))
        logits = model(inputs).float()
        with torch.no_grad():
            teacher = self.teacher(inputs).float()
        f = self.cfg.finetune
        logits, teacher, labels = logits.flatten(0, -2), teacher.flatten(0, -2), labels.flatten()
        hard = F.cross_entropy(logits, labels)
        soft = F.kl_div(F.log_softmax(logits / f.temperature, -1), F.log_softmax(teacher / f.temperature, -1),
                        reduction="batchmean", log_target=True) * f.temperature ** 2
        return StepOutput((1 - f.distill) * hard + f.distill * soft, len(inputs))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        return evaluate_student(model, self.valid_loader, engine.device, self.cfg.data.name,
                                self.cfg.train.eval_batches)

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        r = results["model"]
        return {"step": engine.num_updates, "lr": train["lr"], "train_loss": train["loss"], **r,
                "elapsed_s": engine.elapsed}

    def describe(self, record: dict, improved: bool) -> str:
        what = (f"top-1 {record['top1']:.2f}%" if "top1" in record else f"valid {record['bits_per_byte']:.3f} "
                "bits/byte")
        return self.evaluation_line(record, improved, f"{self.cfg.stage} loss {record['train_loss']:.4g}, {what}")

    def summary(self, engine: Engine) -> dict:
        best = engine.best.get("score", -math.inf)
        scores = {"best_top1": best} if self.cfg.data.name != "stdlib" else {"best_valid_bpb": -best}
        return self.run_summary(engine, {"source": self.cfg.model.source, "target": self.target,
                                         "stage": self.cfg.stage, "conversion": self.report.to_dict()}, scores)


@torch.no_grad()
def evaluate_student(model: nn.Module, loader: DataLoader, device, data: str, max_batches: int = 0) -> dict:
    """Digits and folder: ``top1`` (%) on the test / val split; stdlib: ``bits_per_byte`` on validation; ``score``:
    higher is better."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        inputs, targets = batch[:2]  # a folder's batch: + skipped count
        logits = model(inputs.to(device)).float()
        targets = targets.to(device)
        if data != "stdlib":
            total += (logits.argmax(-1) == targets).sum().item()
        else:
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    if data != "stdlib":
        top1 = 100.0 * total / max(count, 1)
        return {"top1": top1, "score": top1}
    bpb = total / max(count, 1) / math.log(2)
    return {"bits_per_byte": bpb, "score": -bpb}


def train_convert(cfg: Config, output, **options) -> dict:
    """Run the stage ``cfg`` names into ``output``; returns ``metrics.json``'s contents. ``options``: resume,
    overwrite, device, show_progress, allow_changed (:func:`~polaformer.engine.steps.step_settings`)."""
    check_convert_config(cfg)
    return train(ConvertTask(cfg), step_settings(cfg, output, **options))
