"""``polaformer convert``: a trained softmax model into its Pola counterpart (``weights``), then the two training
stages (``train --stage transfer|finetune``), and the demo on the embedded data (``demo``). See docs/convert.md.
Errors reach the one handler of :func:`polaformer.cli.main`."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from .common import (
    add_command_group,
    add_overwrite,
    add_train_options,
    flag_values,
    parse_model_kwarg,
    print_summary,
    train_into,
)

__all__ = ["add_convert_parser"]


def add_convert_parser(commands) -> None:
    sub = add_command_group(commands, "convert", "convert a trained softmax model to Pola (copy, transfer, fine-tune)",
                            "Softmax DeiT/ViT, Swin, PVTv2 (timm), DiT and the softmax LM into their Pola "
                            "counterparts. See docs/convert.md.")

    weights = sub.add_parser("weights", help="copy every weight that has a counterpart; report what is new")
    weights.add_argument("--source", required=True, help="the softmax model: a timm name (deit_small_patch16_224, "
                                                         "swin_tiny_patch4_window7_224, pvt_v2_b2) or ours")
    weights.add_argument("--weights", metavar="FILE", help="its trained weights")
    _pretrained_option(weights)
    weights.add_argument("--target", default="", help="the Pola model (default: the source's counterpart)")
    _kwarg_options(weights)
    weights.add_argument("--output", required=True, metavar="FILE", help="the converted weights (.pth)")
    add_overwrite(weights, "a file at --output")
    weights.set_defaults(handler=cmd_convert_weights)

    train = sub.add_parser("train", help="attention transfer or distillation fine-tuning (step-based, resumable)")
    train.add_argument("--config", metavar="FILE", help="YAML file over the defaults (model, data, stage, init, "
                                                        "transfer, finetune, train keys)")
    train.add_argument("--stage", choices=("transfer", "finetune"),
                       help="stage (default finetune; transfer first is optional: docs/convert.md)")
    train.add_argument("--source", help="model.source")
    train.add_argument("--teacher", metavar="FILE", help="the softmax model's trained weights (model.teacher)")
    _pretrained_option(train)
    train.add_argument("--target", help="model.target (default: the source's counterpart)")
    train.add_argument("--init", metavar="FILE", help="finetune: start from these weights (the transfer run's)")
    train.add_argument("--data", choices=("digits", "folder", "stdlib"), help="data.name (default: folder with "
                                                                             "--data-path, else digits)")
    train.add_argument("--data-path", metavar="DIR", help="an ImageNet-layout folder, DIR/train/<class>/<image> "
                                                          "and DIR/val/<class>/<image> (data.path)")
    train.add_argument("--lora", type=int, metavar="RANK", help="finetune: LoRA adapters of this rank on the "
                                                                "attention projections, merged into OUTPUT/merged.pth "
                                                                "at the end (finetune.lora)")
    train.add_argument("--attention-weight", type=float, metavar="W",
                       help="transfer: add W x the attention weights' cross-entropy to the output loss "
                            "(transfer.attention_weight)")
    _kwarg_options(train)
    add_train_options(train, "convert train",
                      output="runs/convert/STAGE", opts_example="transfer.train_qk true finetune.distill 0.7")
    train.set_defaults(handler=cmd_convert_train)

    demo = sub.add_parser("demo", help="the digits ViT and the stdlib LM: softmax -> Pola against Pola from scratch",
                          description="Trains the softmax teachers, converts them, runs both stages and Pola from "
                                      "scratch; writes OUT/table.md and OUT/results.json.")
    demo.add_argument("--out", required=True, metavar="DIR")
    demo.add_argument("--quick", action="store_true", help="short runs (a smoke check, not the documented table)")
    demo.add_argument("--seeds", type=int, metavar="N", help="seeds of every row (default 3; --quick 2)")
    add_overwrite(demo, "results and runs in --out")
    demo.set_defaults(handler=cmd_convert_demo)


def _pretrained_option(parser) -> None:
    parser.add_argument("--pretrained", action="store_const", const=True,
                        help="timm's own weights of the source's name (huggingface_hub: its cache, HF_HUB_OFFLINE)")


def _kwarg_options(parser) -> None:
    parser.add_argument("--source-kwarg", type=parse_model_kwarg, action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument of the source model (repeatable)")
    parser.add_argument("--target-kwarg", type=parse_model_kwarg, action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument of the target model over those it shares with the source")


def cmd_convert_weights(args: argparse.Namespace) -> int:
    from ..engine.output import claim_outputs
    from ..tasks.convert import ConversionError, build_source, convert_model, save_converted, target_of

    if bool(args.weights) == bool(args.pretrained):
        raise ConversionError("give the source's trained weights: --weights FILE or --pretrained (timm's own), one "
                              "of them")
    claim_outputs([Path(args.output)], args.overwrite)
    source = build_source(args.source, dict(args.source_kwarg), args.weights, pretrained=bool(args.pretrained))
    target, target_kwargs = target_of(source, args.source, dict(args.source_kwarg), args.target,
                                      dict(args.target_kwarg))
    model, report = convert_model(source, target, target_kwargs)
    save_converted(model, report, target, target_kwargs, args.output)
    print("\n".join(report.lines()))
    print(f"{args.source} -> {target} {json.dumps(target_kwargs)}: {len(report.copied)} tensors copied, "
          f"{len(report.new)} new, {len(report.dropped)} dropped -> {args.output}")
    return 0


def cmd_convert_train(args: argparse.Namespace) -> int:
    from ..tasks.convert import convert_config, train_convert

    if args.data_path and args.data is None:
        args.data = "folder"
    cfg = convert_config(args.config, args.opts, flag_values("convert train", args), check=False)  # checked there
    cfg.model.source_kwargs.merge(dict(args.source_kwarg))
    cfg.model.target_kwargs.merge(dict(args.target_kwarg))
    output, summary = train_into(train_convert, cfg, args, f"runs/convert/{cfg.stage}")
    score = (f"{summary['evaluated_on']} top-1 {summary['best_top1']:.2f}%" if "best_top1" in summary else
             f"valid bits/byte {summary['best_valid_bpb']:.3f}" if "best_valid_bpb" in summary else
             f"valid ε-MSE {summary['best_valid_mse']:.4f}")
    if "layer_losses" in summary:
        print_summary("transfer loss per layer: " + ", ".join(f"{i}: {loss:.4g}"
                                                        for i, loss in enumerate(summary["layer_losses"])))
    merged = f", merged -> {summary['merged']}" if "merged" in summary else ""
    print_summary(f"{cfg.stage}: {score} ({summary['target']} from {summary['source']}, {summary['steps']} steps, "
                  f"{summary['trained_parameters']} parameters trained, {summary['wall_time_s']:.0f}s) -> "
                  f"{output}{merged}")
    return 0


def cmd_convert_demo(args: argparse.Namespace) -> int:
    from ..bench.convert import QUICK, DemoSizes, run_convert_demo
    from ..engine import ConfigError
    from ..engine.output import claim_outputs

    if args.seeds is not None and args.seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {args.seeds}")
    out = Path(args.out)
    claim_outputs([out / "results.json", out / "table.md"], args.overwrite, "--out")  # before any training
    runs = [run for run in (out / "digits", out / "lm", out / "dit") if run.exists()]
    if runs and not args.overwrite:
        raise ConfigError(f"{runs[0]} already exists: --overwrite replaces the demo's runs, or choose another --out")
    sizes = QUICK if args.quick else DemoSizes()
    if args.seeds is not None:
        sizes = replace(sizes, seeds=args.seeds, dit_seeds=min(sizes.dit_seeds, args.seeds))
    results = run_convert_demo(args.out, sizes, show_progress=True)
    print(results["table"])
    return 0
