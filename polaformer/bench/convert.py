"""``polaformer convert demo``: a softmax model trained on the embedded data, converted to Pola, against Pola trained
from scratch, for the digits ViT (test top-1) and the standard-library language model (validation bits per byte).

Each final model is read back from its checkpoint into its plain class (strictly) and scored by one evaluator
(:func:`~polaformer.tasks.convert.evaluate_student`), so every row of a table is measured alike. Writes
``OUT/results.json`` and ``OUT/table.md``; the training runs live under ``OUT/digits`` and ``OUT/lm``.
"""
from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import timm
import torch
from torch.utils.data import DataLoader

from ..checkpoint import atomic_write, load_checkpoint
from ..data import get_data_spec
from ..data.text import ByteWindows, stdlib_corpus
from ..tasks.classification import make_config, run_training
from ..tasks.convert import build_source, convert_config, convert_model, evaluate_student, target_of, train_convert
from ..tasks.lm import lm_config, train_lm

__all__ = ["DemoSizes", "run_convert_demo"]

# timm's ViT at pola_deit_digits' sizes, with its class token: the softmax model the digits demo converts
DIGITS_TEACHER = dict(patch_size=2, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0, global_pool="token",
                      class_token=True, qk_norm=False, init_values=None)
DIGITS_STEPS_PER_EPOCH = 44  # 1,437 training images in batches of 32 (the partial last batch dropped)


@dataclass(frozen=True)
class DemoSizes:
    """How long each run trains: the teachers' full budget, and the two stages after a conversion."""

    digits_epochs: int = 40
    digits_transfer_steps: int = 22
    digits_finetune_steps: int = 66
    lm_steps: int = 600
    lm_transfer_steps: int = 40
    lm_finetune_steps: int = 80
    lm_max_bytes: int = 2_000_000
    lm_eval_batches: int = 4  # of 256 windows
    seed: int = 0


QUICK = DemoSizes(digits_epochs=2, digits_transfer_steps=8, digits_finetune_steps=10, lm_steps=60,
                  lm_transfer_steps=6, lm_finetune_steps=6, lm_max_bytes=200_000, lm_eval_batches=1)


def _digits(out: Path, s: DemoSizes, show_progress: bool) -> dict:
    spec = get_data_spec("digits")
    teacher_dir = out / "teacher_softmax"
    teacher_run = run_training(make_config("vit_tiny_patch16_224", model_kwargs=DIGITS_TEACHER, epochs=s.digits_epochs,
                                           output=str(teacher_dir), seed=s.seed), opts=["OVERWRITE", "True"])
    source_kwargs = {**DIGITS_TEACHER, "img_size": spec.img_size, "in_chans": spec.in_chans,
                     "num_classes": spec.num_classes}
    teacher_file = teacher_run["checkpoint"]
    teacher = build_source("vit_tiny_patch16_224", source_kwargs, teacher_file)
    target, target_kwargs = target_of(teacher, "vit_tiny_patch16_224", source_kwargs, "pola_deit_digits")
    copied, _ = convert_model(teacher, target, target_kwargs)
    _, test_set = spec.build(augment=False)
    loader = DataLoader(test_set, batch_size=256, shuffle=False)

    def score(model):
        return evaluate_student(model, loader, "cpu", "digits")["top1"]

    def stage(name, steps, init=""):
        cfg = convert_config(check=False)
        cfg.merge({"model": {"source": "vit_tiny_patch16_224", "teacher": str(teacher_file), "target": target},
                   "stage": name, "init": init,
                   "train": {"steps": steps, "eval_every": steps, "seed": s.seed,
                             "lr": 2e-3 if name == "transfer" else 1e-3,
                             "weight_decay": 0.0 if name == "transfer" else 0.05}})
        cfg.model.source_kwargs.merge(source_kwargs)
        train_convert(cfg, out / name, overwrite=True, show_progress=show_progress)
        model = timm.create_model(target, **target_kwargs)
        load_checkpoint(model, out / name / "last.pth", strict=True)  # the plain Pola class takes it as is
        return score(model)

    transfer = stage("transfer", s.digits_transfer_steps)
    finetune = stage("finetune", s.digits_finetune_steps, str(out / "transfer" / "last.pth"))
    converted_steps = s.digits_transfer_steps + s.digits_finetune_steps
    same_epochs = max(1, round(converted_steps / DIGITS_STEPS_PER_EPOCH))
    scratch_same = run_training(make_config("pola_deit_digits", epochs=same_epochs, output=str(out / "scratch_same"),
                                            seed=s.seed), opts=["OVERWRITE", "True"])
    scratch_full = run_training(make_config("pola_deit_digits", epochs=s.digits_epochs,
                                            output=str(out / "scratch_full"), seed=s.seed), opts=["OVERWRITE", "True"])
    goal = teacher_run["final_test_top1"] - 0.5
    reached = next((e["num_updates"] for e in scratch_full["epochs"] if e["test_top1"] >= goal), None)
    return {
        "metric": "test top-1 (%)", "goal": goal,
        "rows": [
            {"run": "softmax ViT (teacher)", "steps": teacher_run["epochs"][-1]["num_updates"],
             "score": teacher_run["final_test_top1"]},
            {"run": "Pola-DeiT: copy alone", "steps": 0, "score": score(copied)},
            {"run": "Pola-DeiT: + transfer", "steps": s.digits_transfer_steps, "score": transfer},
            {"run": "Pola-DeiT: + fine-tune", "steps": converted_steps, "score": finetune},
            {"run": "Pola-DeiT from scratch, same steps", "steps": scratch_same["epochs"][-1]["num_updates"],
             "score": scratch_same["final_test_top1"]},
            {"run": "Pola-DeiT from scratch, full budget", "steps": scratch_full["epochs"][-1]["num_updates"],
             "score": scratch_full["final_test_top1"]},
        ],
        "scratch_steps_to_goal": reached,
    }


def _lm(out: Path, s: DemoSizes, show_progress: bool) -> dict:
    def lm_run(name, attention, steps):
        cfg = lm_config(overrides={"model.attention": attention, "train.steps": steps, "train.eval_every": steps,
                                   "train.warmup_steps": max(1, min(50, steps // 10)),
                                   "data.max_bytes": s.lm_max_bytes, "train.seed": s.seed}, check=False)
        return train_lm(cfg, out / name, overwrite=True, show_progress=show_progress), cfg

    teacher_run, lm_cfg = lm_run("teacher_softmax", "softmax", s.lm_steps)
    context = lm_cfg.model.context
    source_kwargs = {"attention": "softmax", "context": context}
    teacher = build_source(lm_cfg.model.name, source_kwargs, out / "teacher_softmax" / "last.pth")
    target, target_kwargs = target_of(teacher, lm_cfg.model.name, source_kwargs)
    copied, _ = convert_model(teacher, target, target_kwargs)
    _, valid = stdlib_corpus(s.lm_max_bytes, lm_cfg.data.valid_fraction, lm_cfg.data.seed)
    loader = DataLoader(ByteWindows(valid, context), batch_size=256, shuffle=False)

    def score(model):
        return evaluate_student(model, loader, "cpu", "stdlib", s.lm_eval_batches)["bits_per_byte"]

    def pola(path):
        model = timm.create_model(target, **target_kwargs)
        load_checkpoint(model, path, strict=True)
        return score(model)

    def stage(name, steps, init=""):
        cfg = convert_config(check=False)
        cfg.merge({"model": {"source": lm_cfg.model.name, "teacher": str(out / "teacher_softmax" / "last.pth")},
                   "data": {"name": "stdlib", "max_bytes": s.lm_max_bytes}, "stage": name, "init": init,
                   "train": {"steps": steps, "eval_every": steps, "batch_size": lm_cfg.train.batch_size,
                             "lr": 3e-3 if name == "transfer" else 1e-3, "eval_batches": s.lm_eval_batches,
                             "weight_decay": 0.0 if name == "transfer" else 0.01, "seed": s.seed}})
        cfg.model.source_kwargs.merge(source_kwargs)
        train_convert(cfg, out / name, overwrite=True, show_progress=show_progress)
        return pola(out / name / "last.pth")

    transfer = stage("transfer", s.lm_transfer_steps)
    finetune = stage("finetune", s.lm_finetune_steps, str(out / "transfer" / "last.pth"))
    converted_steps = s.lm_transfer_steps + s.lm_finetune_steps
    lm_run("scratch_same", "pola", converted_steps)
    lm_run("scratch_full", "pola", s.lm_steps)
    teacher_score = score(teacher)
    return {
        "metric": "validation bits/byte (lower is better)", "goal": teacher_score + 0.1,
        "rows": [
            {"run": "softmax LM (teacher)", "steps": s.lm_steps, "score": teacher_score},
            {"run": "pola_lm: copy alone", "steps": 0, "score": score(copied)},
            {"run": "pola_lm: + transfer", "steps": s.lm_transfer_steps, "score": transfer},
            {"run": "pola_lm: + fine-tune", "steps": converted_steps, "score": finetune},
            {"run": "pola_lm from scratch, same steps", "steps": converted_steps,
             "score": pola(out / "scratch_same" / "last.pth")},
            {"run": "pola_lm from scratch, full budget", "steps": s.lm_steps,
             "score": pola(out / "scratch_full" / "last.pth")},
        ],
    }


def _table(name: str, result: dict) -> list[str]:
    lines = [f"{name}: {result['metric']}", "", "| run | steps | score |", "| --- | ---: | ---: |"]
    lines += [f"| {r['run']} | {r['steps']} | {r['score']:.{2 if 'top-1' in result['metric'] else 3}f} |"
              for r in result["rows"]]
    if "scratch_steps_to_goal" in result:
        reached = result["scratch_steps_to_goal"]
        lines += ["", f"From scratch, first evaluation within 0.5 points of the teacher ({result['goal']:.2f}%): "
                      f"{'step ' + str(reached) if reached is not None else 'not reached in the full budget'}."]
    return lines + [""]


def run_convert_demo(out: str | Path, sizes: DemoSizes = DemoSizes(), *, show_progress: bool = False) -> dict:
    """Run both demos into ``out``; returns what ``results.json`` holds (and writes ``table.md``)."""
    out = Path(out)
    torch.manual_seed(sizes.seed)
    results = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
               "sizes": asdict(sizes),
               "digits": _digits(out / "digits", sizes, show_progress),
               "lm": _lm(out / "lm", sizes, show_progress)}
    text = "\n".join(["Measured by `polaformer convert demo` on " + results["machine"] + ".", "",
                      *_table("digits (softmax ViT -> Pola-DeiT)", results["digits"]),
                      *_table("standard-library text (softmax LM -> pola_lm)", results["lm"])])
    atomic_write(out / "results.json", lambda f: f.write((json.dumps(results, indent=2) + "\n").encode()))
    atomic_write(out / "table.md", lambda f: f.write(text.encode()))
    results["table"] = text
    return results

