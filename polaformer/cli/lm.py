"""``polaformer lm``: train / eval / sample the byte-level ``pola_lm_*`` models on the standard library's text
(docs/causal.md). Errors (bad options, unusable checkpoints) reach the one handler of :func:`polaformer.cli.main`."""
from __future__ import annotations

import argparse
import os
import sys

from .common import add_command_group, add_train_options, flag_values, positive_int, print_summary, train_into

__all__ = ["add_lm_parser"]


def add_lm_parser(commands) -> None:
    sub = add_command_group(commands, "lm", "byte-level causal language models (pola | pacs | elu | softmax attention)",
                            "Causal language models on the Python standard library's own files. See docs/causal.md.")

    train = sub.add_parser("train", help="train one model (step-based, resumable); reports bits per byte")
    train.add_argument("--config", metavar="FILE", help="YAML file over the defaults (model, data, train keys)")
    train.add_argument("--model", help="timm name, e.g. pola_lm_tiny (model.name)")
    train.add_argument("--attention", choices=("pola", "pacs", "elu", "softmax"), help="model.attention")
    add_train_options(train, "lm train", (
        ("context", positive_int, "bytes per training window"),
        ("max_bytes", int, "bytes of the corpus read, 0 = all")),
        output="runs/lm/MODEL-ATTENTION", opts_example="train.warmup_steps 100")
    train.set_defaults(handler=cmd_lm_train)

    evaluate = sub.add_parser("eval", help="validation bits per byte of a checkpoint")
    evaluate.add_argument("--checkpoint", required=True, metavar="FILE")
    evaluate.add_argument("--batches", type=int, default=0, help="validation batches (0: all)")
    evaluate.set_defaults(handler=cmd_lm_eval)

    sample = sub.add_parser("sample", help="generate text from a checkpoint (recurrent form, one step per byte)",
                            description="Generate with the recurrent form. The model sees at most model.context "
                                        "bytes: past that the window restarts from its newest half.")
    sample.add_argument("--checkpoint", required=True, metavar="FILE")
    sample.add_argument("--prompt", type=_prompt, default="def ", help="text to continue")
    sample.add_argument("--length", type=int, default=200, help="bytes to generate (1 to 1048576)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    sample.add_argument("--top-k", type=int, default=0)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(handler=cmd_lm_sample)


def _prompt(text: str) -> bytes:
    # the bytes as given: a byte-level model takes any, and os.fsencode undoes Python's decoding of argv
    if not text:
        raise argparse.ArgumentTypeError("the prompt needs at least one byte")
    return os.fsencode(text)


def _check_options(args: argparse.Namespace, names) -> None:
    from ..tasks.lm import SAMPLING

    for name in names:
        SAMPLING[name].check(f"--{name.replace('_', '-')}", getattr(args, name))


def cmd_lm_train(args: argparse.Namespace) -> int:
    from ..tasks.lm import lm_config, train_lm

    cfg = lm_config(args.config, args.opts, flag_values("lm train", args), check=False)  # train_lm checks it
    if cfg.train.warmup_steps >= cfg.train.steps:
        cfg.train.warmup_steps = max(1, cfg.train.steps // 10)
    output, summary = train_into(train_lm, cfg, args, f"runs/lm/{cfg.model.name}-{cfg.model.attention}")
    print_summary(f"valid bits/byte: {summary['best_valid_bpb']:.3f} (unigram {summary['unigram_valid_bpb']:.3f}; "
                  f"{cfg.model.name}, {cfg.model.attention}, {summary['parameters']} parameters, {summary['steps']} "
                  f"steps, {summary['wall_time_s']:.0f}s) -> {output}")
    return 0


def _loader(cfg):
    from torch.utils.data import DataLoader

    from ..tasks.lm import stdlib_corpus
    from ..tasks.lm.train import byte_windows

    train_bytes, valid_bytes = stdlib_corpus(cfg.data.max_bytes, cfg.data.valid_fraction, cfg.data.seed)
    return DataLoader(byte_windows(valid_bytes, cfg, "validation"), batch_size=cfg.train.batch_size), train_bytes, \
        valid_bytes


def cmd_lm_eval(args: argparse.Namespace) -> int:
    from ..tasks.lm import evaluate_bits_per_byte, load_lm_model, unigram_bits_per_byte

    _check_options(args, ["batches"])
    model, cfg = load_lm_model(args.checkpoint)
    loader, train_bytes, valid_bytes = _loader(cfg)
    result = evaluate_bits_per_byte(model, loader, "cpu", args.batches, progress=True)
    print(f"valid bits/byte: {result['bits_per_byte']:.4f} over {result['bytes']} bytes "
          f"(unigram {unigram_bits_per_byte(train_bytes, valid_bytes):.4f})")
    return 0


def cmd_lm_sample(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from ..tasks.lm import load_lm_model

    _check_options(args, ["length", "temperature", "top_k", "seed"])
    model, cfg = load_lm_model(args.checkpoint)
    prompt = torch.tensor([list(args.prompt)], dtype=torch.long)
    with tqdm(total=args.length, desc="sampling", unit="byte", leave=False, disable=None) as bar:
        out = model.generate(prompt, args.length, args.temperature, args.top_k,
                             generator=torch.Generator().manual_seed(args.seed), on_token=lambda: bar.update())
    sys.stdout.write(bytes(out[0].tolist()).decode("utf-8", errors="replace") + "\n")
    return 0
