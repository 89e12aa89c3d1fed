"""``polaformer convert demo``: softmax models trained on the embedded data, converted to Pola and trained on, against
the same budget spent without the transfer stage and from scratch: the digits ViT (top-1), the standard-library
language model (bits per byte) and the digits DiT (FID).

Honest numbers: every choice of learning rate is made on data the reported scores never see (digits: a
validation split held out of the training images; text: the first windows of the validation bytes, the scores on
windows after them), at seed 0, from the grid in :class:`DemoSizes`; then every row runs with ``seeds`` seeds (a
new teacher each) and reports mean ± sd of the untouched test scores. Every student is read back from its
checkpoint into its plain class (strictly; a LoRA run's merged file) and scored by one evaluator. Writes
``OUT/results.json`` and ``OUT/table.md``; the runs live under ``OUT/digits``, ``OUT/lm`` and ``OUT/dit``.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import timm
import torch
from torch.utils.data import DataLoader

from ..checkpoint import atomic_write, load_checkpoint
from ..data.text import ByteWindows, stdlib_corpus
from ..tasks.classification import make_config, run_training
from ..tasks.classification.train import TrainData
from ..tasks.convert import build_source, convert_config, convert_model, evaluate_student, target_of, train_convert
from ..tasks.convert.train import MERGED, digits_holdout
from ..tasks.lm import lm_config, train_lm

__all__ = ["QUICK", "DemoSizes", "run_convert_demo"]

# timm's ViT at pola_deit_digits' sizes, with its class token: the softmax model the digits demo converts
DIGITS_TEACHER = dict(patch_size=2, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0, global_pool="token",
                      class_token=True, qk_norm=False, init_values=None)
# the softmax DiT of the diffusion demo's shape, on the 8x8 digits: 16 tokens of patch 2
DIT_SIZES = dict(input_size=8, in_channels=1, hidden_size=64, depth=4, num_heads=4, num_classes=10)


@dataclass(frozen=True)
class DemoSizes:
    """Budgets, the learning-rate grids tried on validation, and the seeds."""

    seeds: int = 3
    valid_fraction: float = 0.2  # of the digits training images, held out for every choice
    digits_epochs: int = 40  # the teacher's (polaformer train's digits recipe)
    digits_transfer_steps: int = 22
    digits_finetune_steps: int = 66
    digits_lrs: tuple[float, ...] = (5e-4, 1e-3, 2e-3)
    digits_weight_decay: float = 0.05
    lm_steps: int = 600  # the teacher's
    lm_transfer_steps: int = 40
    lm_finetune_steps: int = 80
    lm_lrs: tuple[float, ...] = (5e-4, 1e-3, 2e-3)
    lm_weight_decay: float = 0.01
    lm_max_bytes: int = 2_000_000
    lm_eval_batches: int = 4  # of 256 windows, for the choice; as many after them for the scores
    lora_rank: int = 8
    lora_lrs: tuple[float, ...] = (2e-3, 5e-3, 1e-2)  # adapters start at zero: larger rates
    attention_weight: float = 1.0
    transfer_lrs: tuple[float, float] = (2e-3, 3e-3)  # digits, text: the transfer stage's (not tuned)
    dit_steps: int = 2000  # the teacher's
    dit_transfer_steps: int = 100
    dit_finetune_steps: int = 400
    dit_lr: float = 1e-3
    dit_per_class: int = 50  # samples per digit for the FID
    dit_sample_steps: int = 50  # DDIM steps (the diffusion commands' default)
    dit_seeds: int = 1
    parts: tuple[str, ...] = ("digits", "lm", "dit")


QUICK = DemoSizes(seeds=2, digits_epochs=1, digits_transfer_steps=3, digits_finetune_steps=3, digits_lrs=(1e-3, 2e-3),
                  lm_steps=10, lm_transfer_steps=2, lm_finetune_steps=2, lm_lrs=(1e-3,), lm_max_bytes=300_000,
                  lm_eval_batches=1, lora_lrs=(5e-3,), dit_steps=10, dit_transfer_steps=2, dit_finetune_steps=2,
                  dit_per_class=2, dit_sample_steps=5)


@dataclass
class _Row:
    """A row of the table: how the student starts (``copy``, ``transfer``, ``transfer_weights``, ``random``), its
    fine-tuning (LoRA or not, labels and teacher or labels only), and whose learning rate it takes."""

    name: str
    start: str
    lora: bool = False
    distill: float = 0.5
    lr_of: str = ""  # another row's chosen rate; empty: its own, chosen on validation
    scores: list[float] = field(default_factory=list)


def _rows() -> list[_Row]:
    return [_Row("transfer + fine-tune", "transfer"),
            _Row("transfer (+ attention weights) + fine-tune", "transfer_weights", lr_of="transfer + fine-tune"),
            _Row("fine-tune only, same steps", "copy"),
            _Row("transfer + LoRA fine-tune", "transfer", lora=True),
            _Row("from scratch, same steps", "random", distill=0.0)]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


class _Pipeline:
    """One source family's runs: teacher, transfers, the rows' fine-tuning, scored on the untouched data."""

    def __init__(self, out: Path, sizes: DemoSizes, show_progress: bool, *, source: str, data: dict,
                 transfer_steps: int, finetune_steps: int, lrs: tuple[float, ...], weight_decay: float,
                 transfer_lr: float, batch_size: int, eval_batches: int = 0, attention_weight: float = 0.0):
        self.out, self.s, self.show_progress, self.source, self.data = out, sizes, show_progress, source, data
        self.transfer_steps, self.finetune_steps, self.lrs = transfer_steps, finetune_steps, lrs
        self.weight_decay, self.transfer_lr = weight_decay, transfer_lr
        self.batch_size, self.eval_batches, self.attention_weight = batch_size, eval_batches, attention_weight

    def run(self, folder: Path, stage: str, steps: int, lr: float, seed: int, teacher: Path, source_kwargs: dict,
            **changes) -> dict:
        cfg = convert_config(check=False)
        cfg.merge({"model": {"source": self.source, "teacher": str(teacher), "target": changes.pop("target", "")},
                   "data": self.data, "stage": stage,
                   "train": {"steps": steps, "eval_every": steps, "seed": seed, "lr": lr,
                             "batch_size": self.batch_size, "eval_batches": self.eval_batches,
                             "weight_decay": 0.0 if stage == "transfer" else self.weight_decay}})
        for key, value in changes.items():
            cfg.set_path(key, value)
        cfg.model.source_kwargs.merge(source_kwargs)
        return train_convert(cfg, folder, overwrite=True, show_progress=self.show_progress)

    def rows(self, teachers: Callable[[int], tuple[Path, dict, float, int]],
             score: Callable[[torch.nn.Module], float], target: str = "") -> dict:
        """Every row over the seeds; ``teachers(seed)`` trains one: ``(weights, source kwargs, its test score, its
        steps)``; ``score(model)``: a student's test score."""
        rows, chosen, teacher_scores, copy_scores, layer_losses, tried = _rows(), {}, [], [], [], {}
        trained_share = {}
        total = self.transfer_steps + self.finetune_steps
        for seed in range(self.s.seeds):
            at = self.out / f"seed{seed}"
            teacher, source_kwargs, teacher_score, teacher_steps = teachers(seed)
            teacher_scores.append(teacher_score)
            model = build_source(self.source, source_kwargs, teacher)
            name, kwargs = target_of(model, self.source, source_kwargs, target)

            def plain(path):  # the plain Pola class takes a student's file as it is
                student = timm.create_model(name, **kwargs)
                load_checkpoint(student, path, strict=True)
                return student

            copy_scores.append(score(convert_model(model, name, kwargs)[0]))
            common = dict(teacher=teacher, source_kwargs=source_kwargs, target=target)
            transfer = self.run(at / "transfer", "transfer", self.transfer_steps, self.transfer_lr, seed, **common)
            layer_losses.append(transfer["layer_losses"])
            starts = {"transfer": at / "transfer" / "last.pth", "copy": ""}
            if self.attention_weight:
                self.run(at / "transfer_weights", "transfer", self.transfer_steps, self.transfer_lr, seed,
                         **{**common, "transfer.attention_weight": self.attention_weight})
                starts["transfer_weights"] = at / "transfer_weights" / "last.pth"
            torch.manual_seed(seed)
            random_init = at / "random_init.pth"
            torch.save({"model": timm.create_model(name, **kwargs).state_dict()}, random_init)
            starts["random"] = random_init
            for row in rows:
                if row.start not in starts:
                    continue
                steps = self.finetune_steps if row.start.startswith("transfer") else total
                lrs = ((self.s.lora_lrs if row.lora else self.lrs) if seed == 0 and not row.lr_of else
                       [chosen[row.lr_of or row.name]])
                results = []
                for lr in lrs:
                    folder = at / f"{row.start}{'_lora' if row.lora else ''}_lr{lr:g}"
                    summary = self.run(folder, "finetune", steps, lr, seed, init=str(starts[row.start]),
                                       **common, **{"finetune.distill": row.distill,
                                                    "finetune.lora": self.s.lora_rank if row.lora else 0})
                    valid = summary["history"][-1]["score"]  # higher is better for every metric
                    results.append((valid, lr, folder / (MERGED if row.lora else "last.pth")))
                    trained_share[row.name] = summary["trained_parameters"] / sum(
                        p.numel() for p in plain(results[-1][2]).parameters())
                    if seed == 0:
                        tried.setdefault(row.name, []).append({"lr": lr, "valid": abs(valid)})
                valid, lr, best = max(results, key=lambda r: r[0])
                if seed == 0 and not row.lr_of:
                    chosen[row.name] = lr
                row.scores.append(score(plain(best)))
        table = [{"run": "softmax teacher", "steps": teacher_steps, "scores": teacher_scores},
                 {"run": "Pola: copy alone", "steps": 0, "scores": copy_scores}]
        for row in rows:
            if not row.scores:
                continue
            steps = (f"{self.transfer_steps} + {self.finetune_steps}" if row.start.startswith("transfer") else
                     str(total))
            table.append({"run": f"Pola: {row.name}", "steps": steps, "lr": chosen[row.lr_of or row.name],
                          "trained": trained_share[row.name], "scores": row.scores})
        for entry in table:
            entry["mean"], entry["sd"] = _mean_sd(entry["scores"])
        layers = [statistics.fmean(seed[i] for seed in layer_losses) for i in range(len(layer_losses[0]))]
        return {"rows": table, "layer_losses": layers, "tried": tried, "seeds": self.s.seeds}


def _digits(out: Path, s: DemoSizes, show_progress: bool) -> dict:
    train_set, valid_set, test_set = digits_holdout(s.valid_fraction)
    source_kwargs = {**DIGITS_TEACHER, "img_size": 8, "in_chans": 1, "num_classes": 10}
    test = DataLoader(test_set, batch_size=256, shuffle=False)

    def score(model):
        return evaluate_student(model, test, "cpu", "digits")["top1"]

    def teacher(seed):
        run = run_training(make_config("vit_tiny_patch16_224", model_kwargs=DIGITS_TEACHER, epochs=s.digits_epochs,
                                       output=str(out / f"seed{seed}" / "teacher"), seed=seed),
                           data=TrainData(train_set, valid_set, 10, {"in_chans": 1, "img_size": 8}),
                           opts=["OVERWRITE", "True"])
        model = build_source("vit_tiny_patch16_224", source_kwargs, run["checkpoint"])
        return Path(run["checkpoint"]), source_kwargs, score(model), run["epochs"][-1]["num_updates"]

    pipeline = _Pipeline(out, s, show_progress, source="vit_tiny_patch16_224",
                         data={"name": "digits", "valid_fraction": s.valid_fraction},
                         transfer_steps=s.digits_transfer_steps, finetune_steps=s.digits_finetune_steps,
                         lrs=s.digits_lrs, weight_decay=s.digits_weight_decay, transfer_lr=s.transfer_lrs[0],
                         batch_size=32, attention_weight=s.attention_weight)
    result = pipeline.rows(teacher, score, target="pola_deit_digits")
    return {"metric": "test top-1 (%), higher is better", "decimals": 2, **result,
            "chosen_on": f"{len(valid_set)} validation images held out of the {len(train_set) + len(valid_set)} "
                         f"training images; scores on the {len(test_set)} test images"}


def _lm(out: Path, s: DemoSizes, show_progress: bool) -> dict:
    base = lm_config(check=False)
    context = base.model.context
    source_kwargs = {"attention": "softmax", "context": context}
    _, valid = stdlib_corpus(s.lm_max_bytes, base.data.valid_fraction, base.data.seed)
    held = 256 * (context + 1) * s.lm_eval_batches  # the bytes the choice reads, at least
    if len(valid) < 2 * held:
        raise ValueError(f"{len(valid)} validation bytes cannot hold the choice's and the scores' windows apart")
    test = DataLoader(ByteWindows(valid[len(valid) // 2:], context), batch_size=256, shuffle=False)

    def score(model):
        return evaluate_student(model, test, "cpu", "stdlib", s.lm_eval_batches)["bits_per_byte"]

    def teacher(seed):
        folder = out / f"seed{seed}" / "teacher"
        cfg = lm_config(overrides={"model.attention": "softmax", "train.steps": s.lm_steps,
                                   "train.eval_every": s.lm_steps,
                                   "train.warmup_steps": max(1, min(50, s.lm_steps // 10)),
                                   "data.max_bytes": s.lm_max_bytes, "train.seed": seed}, check=False)
        train_lm(cfg, folder, overwrite=True, show_progress=show_progress)
        model = build_source(base.model.name, source_kwargs, folder / "last.pth")
        return folder / "last.pth", source_kwargs, score(model), s.lm_steps

    pipeline = _Pipeline(out, s, show_progress, source=base.model.name,
                         data={"name": "stdlib", "max_bytes": s.lm_max_bytes},
                         transfer_steps=s.lm_transfer_steps, finetune_steps=s.lm_finetune_steps, lrs=s.lm_lrs,
                         weight_decay=s.lm_weight_decay, transfer_lr=s.transfer_lrs[1],
                         batch_size=base.train.batch_size, eval_batches=s.lm_eval_batches,
                         attention_weight=s.attention_weight)
    result = pipeline.rows(teacher, score)
    return {"metric": "bits per byte, lower is better", "decimals": 3, **result,
            "chosen_on": f"the first {s.lm_eval_batches} x 256 validation windows of {context} bytes; scores on "
                         f"{s.lm_eval_batches} x 256 windows from the second half of the validation bytes"}


def _dit(out: Path, s: DemoSizes, show_progress: bool) -> dict:
    from ..data.noised import digits_images
    from ..tasks.diffusion import (
        class_accuracy,
        diffusion_config,
        feature_network,
        frechet_distance,
        generate,
        load_diffusion_model,
        train_diffusion,
        train_digits_classifier,
    )

    size = DIT_SIZES["input_size"]
    _, _, real, _ = digits_images(size)
    network, _ = feature_network("digits", size, 1)
    labels = torch.arange(10).repeat_interleave(s.dit_per_class)
    source_kwargs = {**DIT_SIZES, "attention": "softmax"}
    rows = {"softmax DiT (teacher)": [], "PolaDiT: copy alone": [], "PolaDiT: transfer + fine-tune": [],
            "PolaDiT from scratch, same steps": []}
    accuracy = {key: [] for key in rows}

    def scored(name, model, cfg):
        images = generate(model.eval(), cfg, labels, steps=s.dit_sample_steps, seed=0)
        rows[name].append(frechet_distance(real, images, network))
        accuracy[name].append(class_accuracy(train_digits_classifier(size), images, labels))

    for seed in range(s.dit_seeds):
        at = out / f"seed{seed}"
        cfg = diffusion_config(check=False)
        cfg.merge({"model": {k: DIT_SIZES[k] for k in ("hidden_size", "depth", "num_heads")} | {"attention": "softmax",
                                                                                              "patch_size": 2},
                   "data": {"image_size": size},
                   "train": {"steps": s.dit_steps, "eval_every": s.dit_steps, "seed": seed, "lr": s.dit_lr}})
        train_diffusion(cfg, at / "teacher", overwrite=True, show_progress=show_progress)
        teacher, teacher_cfg, _ = load_diffusion_model(at / "teacher" / "last.pth")
        scored("softmax DiT (teacher)", teacher, teacher_cfg)
        source = build_source("pola_dit_s_2", source_kwargs, at / "teacher" / "last.pth")
        target, kwargs = target_of(source, "pola_dit_s_2", source_kwargs)
        scored("PolaDiT: copy alone", convert_model(source, target, kwargs)[0], teacher_cfg)
        pipeline = _Pipeline(at, s, show_progress, source="pola_dit_s_2", data={"name": "digits"},
                             transfer_steps=s.dit_transfer_steps, finetune_steps=s.dit_finetune_steps, lrs=(s.dit_lr,),
                             weight_decay=0.0, transfer_lr=s.dit_lr, batch_size=64)
        common = dict(teacher=at / "teacher" / "last.pth", source_kwargs=source_kwargs)
        pipeline.run(at / "transfer", "transfer", s.dit_transfer_steps, s.dit_lr, seed, **common)
        pipeline.run(at / "finetune", "finetune", s.dit_finetune_steps, s.dit_lr, seed,
                     init=str(at / "transfer" / "last.pth"), **common)
        torch.manual_seed(seed)
        torch.save({"model": timm.create_model(target, **kwargs).state_dict()}, at / "random_init.pth")
        pipeline.run(at / "scratch", "finetune", s.dit_transfer_steps + s.dit_finetune_steps, s.dit_lr, seed,
                     init=str(at / "random_init.pth"), **common, **{"finetune.distill": 0.0})
        for name, folder in (("PolaDiT: transfer + fine-tune", "finetune"),
                             ("PolaDiT from scratch, same steps", "scratch")):
            model = timm.create_model(target, **kwargs)
            load_checkpoint(model, at / folder / "last.pth", strict=True)
            scored(name, model, teacher_cfg)
    steps = {"softmax DiT (teacher)": s.dit_steps, "PolaDiT: copy alone": 0,
             "PolaDiT: transfer + fine-tune": f"{s.dit_transfer_steps} + {s.dit_finetune_steps}",
             "PolaDiT from scratch, same steps": s.dit_transfer_steps + s.dit_finetune_steps}
    table = []
    for name, scores in rows.items():
        mean, sd = _mean_sd(scores)
        table.append({"run": name, "steps": steps[name], "scores": scores, "mean": mean, "sd": sd,
                      "accuracy": statistics.fmean(accuracy[name])})
    return {"metric": f"FID on the digits classifier's features (lower is better; {10 * s.dit_per_class} samples, "
                      f"DDIM {s.dit_sample_steps} steps, guidance "
                      f"{diffusion_config(check=False).sample.cfg_scale:g}, against the {len(real)} held-out digits)",
            "decimals": 2, "rows": table, "seeds": s.dit_seeds}


def _cell(entry: dict, digits: int) -> str:
    if len(entry["scores"]) == 1:
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {entry['sd']:.{digits}f}"


def _table(name: str, result: dict) -> list[str]:
    digits = result["decimals"]
    lines = [f"{name}: {result['metric']}; mean ± sd over {result['seeds']} seeds", ""]
    if "chosen_on" in result:
        lines += [f"Rates chosen on {result['chosen_on']}.", ""]
    extra = "accuracy" if any("accuracy" in r for r in result["rows"]) else ""
    lines += ["| run | steps | lr | trained | score |" + (" class accuracy |" if extra else ""),
              "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if extra else "")]
    for r in result["rows"]:
        steps = r["steps"]
        lr = f"{r['lr']:g}" if "lr" in r else ""
        trained = f"{100 * r['trained']:.1f}%" if "trained" in r else ""
        lines.append(f"| {r['run']} | {steps} | {lr} | {trained} | {_cell(r, digits)} |"
                     + (f" {r['accuracy']:.3f} |" if extra else ""))
    if "layer_losses" in result:
        lines += ["", "Transfer loss per layer after the transfer stage (output MSE, mean over seeds): "
                  + ", ".join(f"{i}: {v:.3g}" for i, v in enumerate(result["layer_losses"])) + "."]
    return lines + [""]


def _cpu() -> str:
    """The processor's model name where /proc/cpuinfo tells it, else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def run_convert_demo(out: str | Path, sizes: DemoSizes = DemoSizes(), *, show_progress: bool = False) -> dict:
    """Run the demos of ``sizes.parts`` into ``out``; returns what ``results.json`` holds (and writes
    ``table.md``)."""
    out = Path(out)
    started = time.perf_counter()
    results = {"machine": f"{_cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
               "sizes": asdict(sizes)}
    parts = {"digits": ("digits (softmax ViT -> Pola-DeiT)", _digits),
             "lm": ("standard-library text (softmax LM -> pola_lm)", _lm),
             "dit": ("digits diffusion (softmax DiT -> PolaDiT)", _dit)}
    lines = []
    for key in sizes.parts:
        title, run = parts[key]
        part_start = time.perf_counter()
        results[key] = run(out / key, sizes, show_progress)
        results[key]["wall_time_s"] = time.perf_counter() - part_start
        lines += _table(title, results[key])
    results["wall_time_s"] = time.perf_counter() - started
    text = "\n".join([f"Measured by `polaformer convert demo` on {results['machine']}, "
                      f"{results['wall_time_s'] / 60:.0f} minutes.", "", *lines])
    atomic_write(out / "results.json", lambda f: f.write((json.dumps(results, indent=2) + "\n").encode()))
    atomic_write(out / "table.md", lambda f: f.write(text.encode()))
    results["table"] = text
    return results
