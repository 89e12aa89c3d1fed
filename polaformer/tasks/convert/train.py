"""The two training stages after a conversion, as one step-based task of the one engine (resumable like every
other):

- ``stage: transfer``: only the new parameters (and with ``transfer.train_qk`` the q/k rows) learn, on the
  attention-transfer loss (:class:`~.transfer.AttentionTransfer`: outputs, and with ``transfer.attention_weight``
  > 0 the attention weights too), no weight decay; each layer's loss is logged (``layer_losses``);
- ``stage: finetune``: the student learns from the labels and the frozen teacher's soft targets,
  ``(1 − d)·CE(labels) + d·T²·KL(teacher_T ‖ student_T)`` with ``d`` = ``finetune.distill`` and ``T`` =
  ``finetune.temperature`` (DiT: ``(1 − d)·diffusion loss + d·MSE(teacher's output)``, the noise and variance
  prediction distilled), starting from ``init`` (the transfer run's checkpoint; empty: the plain copy). All of it
  learns, or with ``finetune.lora`` RANK only LoRA adapters and the Pola layer's own tensors
  (:mod:`polaformer.lora`), merged into ``merged.pth`` at the end.

Data: ``digits`` (the image classifiers: top-1 in % on ``data.valid_fraction`` of the training images held out,
or with 0 on the test images; DiT: the diffusion commands' digits images at the model's size, validation ε-MSE on
the held-out digits), ``folder`` (the image classifiers on the ImageNet-layout folder ``data.path``, val top-1 in
%, with the teacher's own transforms from :func:`~polaformer.data.folder.model_transforms`) or ``stdlib`` (the
language model, validation bits per byte; its windows are the model's context). Every evaluation scores the
student on the task's metric, so the transfer stage's effect is measured, not only its loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ...checkpoint import load_checkpoint
from ...data.digits import DigitsDataset, digits_split
from ...data.folder import model_transforms, open_folder
from ...data.noised import NoisedImages, digits_images, make_scheduler
from ...data.text import ByteWindows, stdlib_corpus
from ...engine.config import COUNT, NON_NEGATIVE, POSITIVE, SEED, Config, ConfigError, check_settings, configure, unit
from ...engine.loop import Engine, StepOutput, train
from ...engine.optim import unwrap, warmup_cosine
from ...engine.steps import StepTask, check_train_options, step_settings, train_defaults
from ...lora import add_lora, merge_lora
from .build import build_source, convert_model, save_converted, target_of
from .transfer import MAX_WEIGHT_TOKENS, WEIGHT_FAMILIES, AttentionTransfer, freeze_for_transfer
from .weights import FAMILIES, family_of

__all__ = ["MERGED", "ConvertTask", "convert_config", "check_convert_config", "digits_holdout", "train_convert"]

BEST = "best.pth"
MERGED = "merged.pth"  # a LoRA run's last weights with the adapters merged: the plain model's file
STAGES = ("transfer", "finetune")
DATASETS = ("digits", "folder", "stdlib")
RULES = {
    "data.max_bytes": COUNT.but(note="0: all"),
    "data.valid_fraction": unit(high_open=True).but(note="digits: 0 evaluates on the test images"), "data.seed": SEED,
    "transfer.attention_weight": NON_NEGATIVE.but(note="0: outputs only"),
    "finetune.distill": unit(high_open=False), "finetune.temperature": POSITIVE,
    "finetune.lora": COUNT.but(note="0: every weight learns"),
    "finetune.lora_alpha": NON_NEGATIVE.but(note="0: twice the rank"),
    "train.eval_batches": COUNT.but(note="0: all"),
}


def convert_config(path=None, opts=(), overrides=None, *, check: bool = True) -> Config:
    """The defaults, then a YAML file, ``KEY VALUE`` overrides and ``overrides`` (command-line flags); checked
    (:func:`check_convert_config`) unless ``check`` is false."""
    cfg = Config({
        "model": {"source": "", "source_kwargs": Config(new_allowed=True, path="model.source_kwargs"),
                  "teacher": "", "pretrained": False, "target": "",
                  "target_kwargs": Config(new_allowed=True, path="model.target_kwargs")},
        "data": {"name": "digits", "path": "", "augment": True, "max_bytes": 0, "valid_fraction": 0.05, "seed": 0},
        "stage": "finetune",  # the transfer stage did not beat fine-tuning the copy in the demo (docs/convert.md)
        "init": "",
        "transfer": {"train_qk": False, "attention_weight": 0.0},
        "finetune": {"distill": 0.5, "temperature": 2.0, "lora": 0, "lora_alpha": 0.0},
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
    if cfg.data.name == "stdlib" and not cfg.data.valid_fraction:
        raise ConfigError("data.valid_fraction must be above 0 for the text: its validation bytes")
    if cfg.data.path and cfg.data.name != "folder":
        raise ConfigError(f"data.path is read with data.name folder, not {cfg.data.name}")
    if not cfg.model.source or not (cfg.model.teacher or cfg.model.pretrained):
        raise ConfigError("name the softmax model (model.source) and its trained weights (model.teacher, or "
                          "model.pretrained true for timm's own)")
    if cfg.model.teacher and cfg.model.pretrained:
        raise ConfigError(f"model.teacher {cfg.model.teacher} and model.pretrained true both name the teacher's "
                          "weights: give one")
    if cfg.stage == "transfer" and cfg.train.weight_decay:
        raise ConfigError("the transfer stage trains with train.weight_decay 0 (decay would move the copied rows)")
    if cfg.stage == "finetune" and cfg.transfer.attention_weight:
        raise ConfigError("transfer.attention_weight (--attention-weight) is for the transfer stage (--stage "
                          "transfer)")
    if cfg.stage == "transfer" and cfg.finetune.lora:
        raise ConfigError("finetune.lora (--lora) is for the finetune stage: the transfer stage trains only the new "
                          "tensors already")


def digits_holdout(valid_fraction: float, seed: int = 0, augment: bool = True):
    """``(train, valid, test)`` digits datasets: ``valid_fraction`` of the training images held out (stratified,
    ``seed``) for every choice a run makes, the test images untouched (normalised as the training split). With
    ``valid_fraction`` 0, ``valid`` is the test set (as before there was a validation split)."""
    x_train, y_train, x_test, y_test = digits_split()
    mean, std = float(x_train.mean()), float(x_train.std())
    test = DigitsDataset(x_test, y_test, mean, std)
    shift = 0.5 if augment else 0.0  # the digits recipe's (data.digits.digits_datasets)
    if not valid_fraction:
        return DigitsDataset(x_train, y_train, mean, std, shift_prob=shift), test, test
    from sklearn.model_selection import train_test_split

    held, classes = math.ceil(valid_fraction * len(y_train)), len(set(y_train.tolist()))
    if min(held, len(y_train) - held) < classes:
        raise ConfigError(f"data.valid_fraction {valid_fraction:g} holds out {held} of the {len(y_train)} training "
                          f"images: each split needs one per class ({classes})")
    x_fit, x_valid, y_fit, y_valid = train_test_split(x_train, y_train, test_size=valid_fraction, random_state=seed,
                                                      stratify=y_train)
    return (DigitsDataset(x_fit, y_fit, mean, std, shift_prob=shift), DigitsDataset(x_valid, y_valid, mean, std),
            test)


class ConvertTask(StepTask):
    name = "convert"
    best_files = {BEST: "score"}
    resume_may_change = ("train.steps", "train.eval_every", "train.eval_batches", "train.num_workers")
    valid_collate = None  # the folder's: unreadable images dropped from the batch

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        m = cfg.model
        self.teacher = build_source(m.source, m.source_kwargs.to_dict(), m.teacher, pretrained=m.pretrained)
        self.family = family_of(self.teacher)
        self.target, self.target_kwargs = target_of(self.teacher, m.source, m.source_kwargs.to_dict(), m.target,
                                                    m.target_kwargs.to_dict())
        self._check_attention_weight()
        if self.family is FAMILIES["dit"]:
            self._open_dit_digits(cfg.data)
        elif cfg.data.name == "stdlib":
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
                self.train_set, self.valid_set, _ = digits_holdout(cfg.data.valid_fraction, cfg.data.seed,
                                                                   cfg.data.augment)
            else:
                self._open_folder(cfg.data)

    def _check_attention_weight(self) -> None:
        if not self.cfg.transfer.attention_weight or self.cfg.stage != "transfer":
            return
        if self.family.name not in WEIGHT_FAMILIES:
            raise ConfigError(f"transfer.attention_weight needs attention layers matched one to one "
                              f"({', '.join(WEIGHT_FAMILIES)} sources), not {self.family.name}: set it to 0")
        tokens = (self.teacher.context if self.family.name == "lm" else
                  self.teacher.patch_embed.num_patches + self.teacher.num_prefix_tokens)
        if tokens > MAX_WEIGHT_TOKENS:
            raise ConfigError(f"transfer.attention_weight forms N x N weights: {self.cfg.model.source} has {tokens} "
                              f"tokens, more than {MAX_WEIGHT_TOKENS}; set it to 0")

    def _open_dit_digits(self, data: Config) -> None:
        if data.name != "digits":
            raise ConfigError(f"a DiT converts on the digits images (data.name digits), not {data.name}")
        teacher = self.teacher
        if teacher.in_channels != 1 or teacher.num_classes != 10:
            raise ConfigError(f"the digits are grey images of 10 classes; {self.cfg.model.source} takes "
                              f"{teacher.in_channels} channels and {teacher.num_classes} classes")
        train_x, train_y, valid_x, valid_y = digits_images(teacher.input_size)
        self.scheduler = make_scheduler()  # the diffusion commands' schedule (their defaults)
        steps = self.scheduler.config.num_train_timesteps
        self.train_set = NoisedImages(train_x, train_y, steps, tuple(train_x.shape[1:]), self.cfg.train.seed)
        generator = torch.Generator().manual_seed(1234)  # as the diffusion task: the same draws every evaluation
        self.valid_set = (valid_x, valid_y, torch.randint(0, steps, (len(valid_x),), generator=generator),
                          torch.randn(valid_x.shape, generator=generator))

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

    @property
    def dit(self) -> bool:
        return self.family is FAMILIES["dit"]

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        cfg = self.cfg
        student, self.report = convert_model(self.teacher, self.target, self.target_kwargs)
        if cfg.stage == "finetune" and cfg.init and not resuming:
            load_checkpoint(student, cfg.init, strict=True)
        self.teacher.to(engine.device)
        if self.dit:  # the task draws the null class itself (:meth:`_dit_inputs`), the same for teacher and student
            student.y_embedder.register_forward_pre_hook(lambda module, args, kwargs: (args, {**kwargs, "drop": False}),
                                                         with_kwargs=True)
        self.transfer = None
        if cfg.stage == "transfer":
            self.trained = freeze_for_transfer(student, self.report, cfg.transfer.train_qk)
            self.transfer = AttentionTransfer(self.teacher, student, self.family, cfg.transfer.attention_weight)
        elif cfg.finetune.lora:
            student = add_lora(student, cfg.finetune.lora, cfg.finetune.lora_alpha)
        if not self.dit:
            self.valid_loader = DataLoader(self.valid_set, batch_size=256, shuffle=False,
                                           collate_fn=self.valid_collate)
        return student

    def trained_parameters(self, model: nn.Module) -> int:
        """The parameters that learn: in the transfer stage only the rows :func:`freeze_for_transfer` leaves free."""
        if self.transfer is None:
            return sum(p.numel() for p in model.parameters() if p.requires_grad)
        params = dict(unwrap(model).named_parameters())
        spans = {key: list(rows) for key, rows in self.report.new_rows.items()}
        if self.cfg.transfer.train_qk:
            for key, rows in self.report.qk_rows.items():
                spans.setdefault(key, []).extend(rows)
        return sum((end - start) * (params[key][0].numel() if params[key].dim() else 1)
                   for key, rows in spans.items() for start, end in rows)

    def start_message(self, engine: Engine) -> str:
        model = engine.model
        trained = self.trained_parameters(model)
        base = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
        rank = self.cfg.finetune.lora if self.cfg.stage == "finetune" else 0
        lora = f", LoRA rank {rank}" if rank else ""
        return self.opening(engine, f"{self.target} from {self.cfg.model.source} ({self.cfg.stage}{lora}, {trained} "
                                    f"trained = {100 * trained / base:.1f}% of the model's)", self.cfg.data.name)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return warmup_cosine(optimizer, self.cfg.train.warmup_steps, self.cfg.train.steps)

    def _dit_inputs(self, batch, device: torch.device):
        """The DiT's forward arguments ``(x_t, t, y)`` of a batch, classes dropped to the null class as the model
        trains (the same labels for teacher and student), and the noise."""
        images, labels, t, noise = (x.to(device, non_blocking=True) for x in batch)
        embedder = self.teacher.y_embedder  # the student's has the same classes and dropout
        if embedder.dropout_prob > 0:
            dropped = torch.rand(labels.shape, device=device) < embedder.dropout_prob
            labels = torch.where(dropped, embedder.num_classes, labels)
        return (self.scheduler.add_noise(images, noise, t), t, labels), noise

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        if self.dit:
            inputs, noise = self._dit_inputs(batch, device)
        else:
            inputs = (batch[0].to(device, non_blocking=True),)  # a folder's batch: + labels, skipped count
            labels = batch[1].to(device, non_blocking=True)
        if self.transfer is not None:
            losses = self.transfer.layer_losses(*inputs, student=model)
            samples = len(inputs[0])
            return StepOutput(losses.mean(), samples, {f"layer{i}": loss.detach() * samples
                                                      for i, loss in enumerate(losses)})
        out = model(*inputs).float()
        with torch.no_grad():
            teacher = self.teacher(*inputs).float()
        f = self.cfg.finetune
        if self.dit:
            channels = noise.shape[1]
            hard = (out[:, :channels] - noise).pow(2).mean()
            return StepOutput((1 - f.distill) * hard + f.distill * F.mse_loss(out, teacher), len(noise))
        logits, teacher, labels = out.flatten(0, -2), teacher.flatten(0, -2), labels.flatten()
        hard = F.cross_entropy(logits, labels)
        soft = F.kl_div(F.log_softmax(logits / f.temperature, -1), F.log_softmax(teacher / f.temperature, -1),
                        reduction="batchmean", log_target=True) * f.temperature ** 2
        return StepOutput((1 - f.distill) * hard + f.distill * soft, len(logits))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        if self.dit:
            return evaluate_denoiser(model, self.valid_set, self.scheduler, engine.device)
        return evaluate_student(model, self.valid_loader, engine.device, self.cfg.data.name,
                                self.cfg.train.eval_batches)

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        r = results["model"]
        record = {"step": engine.num_updates, "lr": train["lr"], "train_loss": train["loss"], **r}
        layers = sorted((int(key[5:]), value) for key, value in train["stats"].items() if key.startswith("layer"))
        if layers:
            record["layer_losses"] = [float(value) / max(train["samples"], 1) for _, value in layers]
        return {**record, "elapsed_s": engine.elapsed}

    def describe(self, record: dict, improved: bool) -> str:
        what = (f"top-1 {record['top1']:.2f}%" if "top1" in record else
                f"valid {record['bits_per_byte']:.3f} bits/byte" if "bits_per_byte" in record else
                f"valid ε-MSE {record['mse']:.4f}")
        worst = ""
        if "layer_losses" in record:
            layers = record["layer_losses"]
            i = max(range(len(layers)), key=layers.__getitem__)
            worst = f" (highest in layer {i}: {layers[i]:.4g})"
        return self.evaluation_line(record, improved, f"{self.cfg.stage} loss {record['train_loss']:.4g}{worst}, "
                                                      f"{what}")

    def summary(self, engine: Engine) -> dict:
        best = engine.best.get("score", -math.inf)
        name = self.cfg.data.name
        scores = ({"best_valid_mse": -best} if self.dit else {"best_valid_bpb": -best} if name == "stdlib" else
                  {"best_top1": best, "evaluated_on": "val" if name == "folder" else
                   "valid" if self.cfg.data.valid_fraction else "test"})
        if engine.history and "layer_losses" in engine.history[-1]:
            scores["layer_losses"] = engine.history[-1]["layer_losses"]
        trained = self.trained_parameters(engine.model)
        return self.run_summary(engine, {"source": self.cfg.model.source, "target": self.target,
                                         "target_kwargs": self.target_kwargs, "stage": self.cfg.stage,
                                         "trained_parameters": trained, "conversion": self.report.to_dict()}, scores)

    def finish(self, engine: Engine) -> dict:
        summary = self.summary(engine)
        if self.cfg.stage == "finetune" and self.cfg.finetune.lora and engine.ctx.is_main:
            path = engine.output / MERGED
            save_converted(merge_lora(unwrap(engine.model)), self.report, self.target, self.target_kwargs, path)
            summary["merged"] = str(path)
        return summary


@torch.no_grad()
def evaluate_denoiser(model: nn.Module, valid, scheduler, device) -> dict:
    """A DiT's mean ε-MSE on the held-out images ``valid`` = (images, labels, steps, noise): ``mse``, and
    ``score`` (its negative: higher is better)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for images, labels, t, noise in zip(*(x.split(256) for x in valid)):
        images, labels, t, noise = (x.to(device) for x in (images, labels, t, noise))
        out = model(scheduler.add_noise(images, noise, t), t, labels)
        total += (out[:, :noise.shape[1]].float() - noise).pow(2).flatten(1).mean(1).sum().item()
    model.train(was_training)
    mse = total / max(len(valid[0]), 1)
    return {"mse": mse, "score": -mse}


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
