"""``polaformer lra``: train / eval / generate / curves / bench for the Long Range Arena."""
from __future__ import annotations

import argparse

from .bench import add_lra_bench_arguments
from .common import (
    add_command_group,
    add_overwrite,
    add_train_options,
    flag_values,
    parse_model_kwarg,
    positive_int,
    print_summary,
    train_into,
    usage_error,
)

__all__ = ["add_lra_parser"]

TASK_NAMES = ("listops", "text", "retrieval", "image", "pathfinder")


def add_lra_parser(commands) -> None:
    sub = add_command_group(
        commands, "lra",
        "Long Range Arena: train/eval any attention, generate ListOps, benchmark (paper Tables 4 and 6)",
        "The LRA benchmark as the PolaFormer paper ran it (Skyformer protocol). See docs/lra.md.",
        error_command="lra",  # the one handler (polaformer.cli.main) names the command
    )

    train = sub.add_parser(
        "train", help="train one attention on one task (step-based, resumable), then score the test split",
        description="Writes last.pth/best.pth (atomically), metrics.jsonl (one line per evaluation) and metrics.json "
                    "to --output. Files understood in --data: see docs/lra.md.",
    )
    train.add_argument("--task", choices=TASK_NAMES, help="the LRA task (or the config file's)")
    train.add_argument("--config", metavar="FILE",
                       help="YAML recipe (default: the task's recipe, configs/lra/TASK.yaml)")
    train.add_argument("--data", required=True, metavar="DIR", help="folder with the task's files")
    train.add_argument("--attention", metavar="NAME", help="token mixer (default: the config's; see docs/lra.md)")
    train.add_argument("--attention-option", dest="attention_options", action="append", type=parse_model_kwarg,
                       metavar="KEY=VALUE",
                       help="option of that attention, e.g. alpha=3 or gate_init=zeros; repeatable")
    add_train_options(train, "lra train", (
        ("limit_train", positive_int, "use the first N training examples"),
        ("limit_dev", positive_int, "use the first N dev examples"),
        ("limit_test", positive_int, "use the first N test examples"),
    ), output="runs/lra/TASK-ATTENTION", opts_example="train.lr 2e-4 model.num_layers 4")
    train.set_defaults(handler=cmd_lra_train)

    evaluate = sub.add_parser("eval", help="score a checkpoint of 'lra train' on a split")
    evaluate.add_argument("--checkpoint", required=True, metavar="FILE", help="best.pth or last.pth of 'lra train'")
    evaluate.add_argument("--data", required=True, metavar="DIR", help="folder with the task's files")
    evaluate.add_argument("--split", choices=("test", "dev", "train"), default="test")
    evaluate.add_argument("--batch-size", type=positive_int, default=32)
    evaluate.add_argument("--limit", type=positive_int, metavar="N", help="score the first N examples only")
    evaluate.add_argument("--device", default="auto")
    evaluate.set_defaults(handler=cmd_lra_eval)

    generate = sub.add_parser("generate", help="write a data set in its LRA release format")
    generate.add_argument("dataset", choices=("listops",), help="what to generate")
    generate.add_argument("--out", required=True, metavar="DIR", help="output folder (basic_{train,val,test}.tsv)")
    generate.add_argument("--train", type=positive_int, default=96_000, help="training examples (default: %(default)s)")
    generate.add_argument("--val", type=positive_int, default=2_000, help="validation examples (default: %(default)s)")
    generate.add_argument("--test", type=positive_int, default=2_000, help="test examples (default: %(default)s)")
    generate.add_argument("--min-length", type=positive_int, default=500, help="minimum tokens (default: %(default)s)")
    generate.add_argument("--max-length", type=positive_int, default=2000,
                          help="maximum tokens (default: %(default)s)")
    generate.add_argument("--max-depth", type=positive_int, default=10,
                          help="maximum tree depth (default: %(default)s)")
    generate.add_argument("--max-args", type=positive_int, default=10,
                          help="arguments per operator (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--overwrite", action="store_true", help="replace the data set files already in --out")
    generate.set_defaults(handler=cmd_lra_generate)

    curves = sub.add_parser("curves", help="plot the learning curves of 'lra train' output folders side by side")
    curves.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output folders of 'lra train'")
    curves.add_argument("--out", required=True, metavar="PNG", help="figure to write")
    curves.add_argument("--title", help="figure title")
    add_overwrite(curves, "a figure at --out")
    curves.set_defaults(handler=cmd_lra_curves)

    bench = sub.add_parser(
        "bench", help="Table 6 on this machine: training throughput and peak memory of every attention, vs softmax",
    )
    add_lra_bench_arguments(bench)


def cmd_lra_train(args: argparse.Namespace) -> int:
    from ..tasks.lra.config import LRAConfigError, load_lra_config
    from ..tasks.lra.train import train_lra

    if args.config is None and args.task is None:
        raise LRAConfigError("give --task or --config")
    cfg = load_lra_config(args.config, task=args.task, opts=args.opts or (), overrides=flag_values("lra train", args),
                          check=False)  # train_lra checks the final configuration
    if args.attention and args.attention != cfg.attention:
        cfg.attention_options.clear()  # the file's options belong to the file's attention
        cfg.attention = args.attention
    cfg.attention_options.merge(dict(args.attention_options or []), source="--attention-option")
    if args.steps is not None and args.warmup_steps is None and cfg.train.warmup_steps >= cfg.train.steps:
        # a short run keeps the recipe's warm-up fraction instead of failing
        cfg.train.warmup_steps = max(0, cfg.train.steps // 10)
    output, summary = train_into(train_lra, cfg, args, f"runs/lra/{cfg.task}-{cfg.attention}", args.data)
    print_summary(f"test accuracy: {summary['test_accuracy']:.2f}% (best dev {summary['best_dev_accuracy']:.2f}% at "
                  f"step {summary['best_step']}; majority class {summary['majority_class_test_accuracy']:.2f}%; "
                  f"{cfg.task}, {cfg.attention}, {summary['steps']} steps, {summary['wall_time_s']:.0f}s) -> {output}")
    return 0


def cmd_lra_eval(args: argparse.Namespace) -> int:
    from torch.utils.data import DataLoader

    from ..engine.device import place_model, resolve_device
    from ..tasks.lra.data import collate_lra, load_lra_split
    from ..tasks.lra.train import evaluate_lra, load_lra_model

    model, checkpoint = load_lra_model(args.checkpoint)
    task = checkpoint["config"]["task"]
    dataset = load_lra_split(task, args.data, args.split, limit=args.limit)
    device = resolve_device(args.device)
    loader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=collate_lra)
    result = evaluate_lra(place_model(model, device, inference=True), loader, device)
    print(f"{args.split} accuracy: {result['accuracy']:.2f}% (loss {result['loss']:.4f}, "
          f"{result['examples']} examples; {task}, {checkpoint['config']['attention']}, "
          f"step {checkpoint.get('num_updates', '?')}) <- {args.checkpoint}")
    return 0


def cmd_lra_generate(args: argparse.Namespace) -> int:
    from ..tasks.lra.listops import generate_listops

    if args.min_length > args.max_length:
        return usage_error("lra", f"--min-length {args.min_length} exceeds --max-length {args.max_length}")
    if args.max_args < 2:
        return usage_error("lra", f"--max-args must be >= 2, got {args.max_args}")
    try:
        report = generate_listops(
            args.out, train=args.train, val=args.val, test=args.test, min_length=args.min_length,
            max_length=args.max_length, max_depth=args.max_depth, max_args=args.max_args, seed=args.seed,
            overwrite=args.overwrite,
        )
    except (ValueError, OSError) as e:
        return usage_error("lra", str(e))
    print(_listops_report_text(report, args.out))
    return 0


def _listops_report_text(report: dict, out: str) -> str:
    lines = [f"wrote ListOps to {out}:"]
    for split, info in report["splits"].items():
        labels = ", ".join(f"{k}: {v}" for k, v in sorted(info["labels"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"  {split}: {info['examples']} examples, lengths {info['min_length']}-{info['max_length']} "
                     f"(mean {info['mean_length']:.0f}); labels {labels}")
    hist = report["length_histogram"]
    lines.append("  length histogram: " + ", ".join(f"[{lo}, {hi}): {n}" for lo, hi, n in hist))
    return "\n".join(lines)


def cmd_lra_curves(args: argparse.Namespace) -> int:
    from ..engine.output import claim_outputs
    from ..tasks.lra.curves import plot_curves

    claim_outputs([args.out], args.overwrite, "--out")
    result = plot_curves(args.runs, args.out, title=args.title)
    for run in result["runs"]:
        print(f"{run['run']}: best dev {run['best_dev_accuracy']:.2f}%, test {run['test_accuracy']:.2f}% "
              f"({run['steps']} steps, {run['wall_time_s']:.0f} s)")
    print(f"majority class {result['majority_class_test_accuracy']:.2f}% -> {result['figure']}")
    return 0
