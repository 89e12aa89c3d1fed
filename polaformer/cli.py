"""The ``polaformer`` command: ``train`` a model, ``eval`` a checkpoint, measure ``throughput``, ``analyze``,
``bench`` (every benchmark of :mod:`polaformer.bench`), ``export`` to ONNX (in :mod:`polaformer.export`), and the
Long Range Arena (``lra train|eval|generate|bench``, in :mod:`polaformer.lra.cli`), dense prediction
(``detect train|eval|predict``, ``segment train|eval``, in :mod:`polaformer.dense.cli`).

Every user error (a bad option, a missing or foreign checkpoint, an unknown model) and every
environmental fault (a full disk, a busy output folder, a diverged training) ends the command with
exit status 2 and a single ``polaformer...: error: ...`` line on stderr of at most MAX_MESSAGE
characters; Ctrl-C ends it with status 130 and one line. docs/errors.md lists the cases.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import yaml

from .data import DATASETS, DEFAULT_DATA, UnknownDatasetError
from .data.folder import DatasetError
from .runtime import tune_cpu_allocator
from .engine import (
    DEFAULT_MODEL,
    CheckpointError,
    ConfigError,
    ModelBuildError,
    TrainingDivergedError,
    TrainingInterrupted,
    evaluate_checkpoint,
    load_config,
    make_config,
    run_training,
)
from .engine.config import load_yaml, merge_opts
from .engine.evaluation import DEFAULT_EVAL_BATCH_SIZE, EvalError, evaluate_folder_checkpoint, model_throughput

USAGE_ERROR = 2  # argparse's exit status for bad usage; checkpoint errors use it too
INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
MAX_MESSAGE = 500  # characters of an error line: a message may quote a value of any size


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message`` on one line of at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the whole usage first)."""

    def __init__(self, *args, **kwargs):
        # No abbreviations: `--epoch 3` silently meaning `--epochs 3` hides typos in scripts.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(USAGE_ERROR, one_line(f"{self.prog}: error: {message} (see '{self.prog} --help')") + "\n")


def positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_model_kwarg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as YAML, so ``depth=2`` gives an int and ``qkv_bias=false`` a bool."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, load_yaml(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"cannot read the value of {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="polaformer", description="Train and evaluate PolaFormer models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Options default to None so that make_config (and the config file) can tell "not given".
    train = commands.add_parser(
        "train",
        help="train a model: the digits demo by default, or any recipe with --config/--data-path",
        description="Without --config and --data-path: the embedded digits demo (writes checkpoint.pth and "
                    "metrics.json). With them: the official configuration keys (see docs/training.md); writes "
                    "last.pth, best.pth, metrics.jsonl and metrics.json. Under torchrun, one process per GPU.",
    )
    train.add_argument("--config", "--cfg", metavar="FILE", help="YAML file with the official config keys")
    train.add_argument("--data-path", metavar="DIR", help="ImageNet-layout folder: DIR/train/<class>/, DIR/val/<class>/")
    train.add_argument(
        "--resume", metavar="auto|FILE",
        help="continue a run: 'auto' from the output folder's last checkpoint (from scratch if there is none), "
             "or from FILE",
    )
    train.add_argument(
        "--overwrite", action="store_true",
        help="start afresh in an output folder that holds a run, replacing its files (OVERWRITE); without it "
             "such a folder is refused unless --resume is given",
    )
    train.add_argument(
        "--finetune", metavar="FILE",
        help="start from these weights (MODEL.PRETRAINED): position tables resized, classifier replaced if the "
             "number of classes differs",
    )
    train.add_argument(
        "--opts", nargs="+", default=[], metavar="KEY VALUE",
        help="config overrides as KEY VALUE pairs, e.g. --opts TRAIN.EPOCHS 30 DATA.NUM_WORKERS 4",
    )
    train.add_argument("--model", metavar="NAME", help=f"timm model name (MODEL.NAME; digits default: {DEFAULT_MODEL})")
    train.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="extra keyword argument for timm.create_model (MODEL.KWARGS); repeatable (e.g. --model-kwarg depth=2)",
    )
    train.add_argument("--data", choices=sorted(DATASETS), help=f"embedded data set (default: {DEFAULT_DATA})")
    train.add_argument("--epochs", type=positive_int, metavar="N", help="number of epochs (TRAIN.EPOCHS)")
    train.add_argument("--batch-size", type=positive_int, metavar="B", help="batch size per process (DATA.BATCH_SIZE)")
    train.add_argument("--lr", type=float, metavar="LR", help="peak learning rate (TRAIN.BASE_LR)")
    train.add_argument("--weight-decay", type=float, help="AdamW weight decay (TRAIN.WEIGHT_DECAY)")
    train.add_argument("--warmup-epochs", type=int, help="linear warm-up length, in epochs (TRAIN.WARMUP_EPOCHS)")
    train.add_argument("--label-smoothing", type=float, help="label smoothing of the training loss")
    train.add_argument("--clip-grad", type=float, help="max gradient norm (0 disables clipping)")
    train.add_argument("--augment", action=argparse.BooleanOptionalAction, help="digits: random ±1 pixel shifts")
    train.add_argument("--amp", action=argparse.BooleanOptionalAction, help="mixed precision (AMP)")
    train.add_argument(
        "--use-checkpoint", action="store_true", default=None,
        help="activation checkpointing, to save memory (TRAIN.USE_CHECKPOINT)",
    )
    train.add_argument("--seed", type=int, metavar="S", help="seed for initialisation, shuffling and augmentation")
    train.add_argument("--device", help="'cpu', 'cuda', ... (default: cuda if available)")
    train.add_argument("--output", metavar="DIR", help="output folder (default: runs/digits, or runs/MODEL.NAME)")
    train.set_defaults(handler=cmd_train)

    evaluate = commands.add_parser(
        "eval", help="evaluate a checkpoint: top-1, top-5 and loss on DIR/val, or on an embedded data set's test split"
    )
    evaluate.add_argument(
        "--checkpoint", required=True, metavar="FILE",
        help="checkpoint written by 'train', or (with --data-path) any file the zoo loads: the authors' "
             "PolaFormer/PolaFormer++ checkpoints, timm's, plain state dicts",
    )
    evaluate.add_argument(
        "--data", choices=sorted(DATASETS), help="embedded data set (default: the one the checkpoint was trained on)"
    )
    evaluate.add_argument(
        "--data-path", metavar="DIR", help="ImageNet-layout folder: evaluates on DIR/val/<class>/<image>"
    )
    evaluate.add_argument(
        "--model", metavar="NAME",
        help="timm model name; refuses a checkpoint of any other architecture (with --data-path, needed only "
             "for files that name no architecture, neither as 'arch' nor in a stored config's MODEL.NAME)",
    )
    evaluate.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="with --data-path: extra keyword argument for timm.create_model; repeatable",
    )
    evaluate.add_argument(
        "--weights", choices=("auto", "ema", "raw"),
        help="with --data-path: the EMA or the raw weights (default: auto, EMA if the file has them)",
    )
    evaluate.add_argument(
        "--batch-size", type=positive_int, metavar="B", help="with --data-path: batch size (default: 128)"
    )
    evaluate.add_argument(
        "--img-size", type=positive_int, metavar="S",
        help="with --data-path: image size (default: the checkpoint config's DATA.IMG_SIZE, else the model's)",
    )
    evaluate.add_argument(
        "--crop-pct", type=float, metavar="P",
        help="with --data-path: resize to the square S/P, then centre-crop S (default: the checkpoint config's "
             "TEST.CROP, else the model's pretrained_cfg: the official 0.875, no crop for pola_swin_b_384)",
    )
    evaluate.add_argument(
        "--workers", type=int, metavar="N", help="with --data-path: data loading processes (default: 4)"
    )
    evaluate.add_argument(
        "--amp", action="store_true", help="with --data-path: mixed precision (fp16 on CUDA, bf16 on CPU)"
    )
    evaluate.add_argument(
        "--allow-nonfinite", action="store_true",
        help="evaluate weights holding NaN or infinite values (refused by default, naming the first such weight)",
    )
    evaluate.add_argument("--device", default="auto", help="'cpu', 'cuda', ... (default: cuda if available)")
    evaluate.set_defaults(handler=cmd_eval)

    throughput = commands.add_parser(
        "throughput", help="measure inference images/s on a fixed random batch (the official --throughput)"
    )
    throughput.add_argument("--model", required=True, metavar="NAME", help="timm model name")
    throughput.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="extra keyword argument for timm.create_model; repeatable",
    )
    throughput.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="B", help="batch size (default: %(default)s)"
    )
    throughput.add_argument(
        "--img-size", type=positive_int, metavar="S", help="image size (default: the model's; 224 for ImageNet models)"
    )
    throughput.add_argument(
        "--warmup", type=int, default=10, metavar="N", help="untimed iterations first (default: %(default)s)"
    )
    throughput.add_argument(
        "--iters", type=positive_int, default=30, metavar="N", help="timed iterations (default: %(default)s)"
    )
    throughput.add_argument("--amp", action="store_true", help="mixed precision (fp16 on CUDA, bf16 on CPU)")
    throughput.add_argument("--device", default="auto", help="'cpu', 'cuda', ... (default: cuda if available)")
    throughput.set_defaults(handler=cmd_throughput)

    analyze = commands.add_parser(
        "analyze",
        help="attention maps, positive-sequence entropy, gate correlation and Theorem 1 fractions (PNG + JSON)",
        description="Applies a model's PolaLinearAttention layers to an image's patch tokens and writes "
                    "attention_maps.png, entropy.png, gates.png and analysis.json (see docs/analysis.md).",
    )
    analyze.add_argument("--image", metavar="PATH", help="image file (default: scikit-image's astronaut photo)")
    analyze.add_argument("--model", default="pola_pvt_tiny", metavar="NAME",
                         help="timm model name (default: %(default)s; a training checkpoint names its own)")
    analyze.add_argument("--checkpoint", metavar="FILE", help="weights (default: untrained, said in the titles)")
    analyze.add_argument("--query", nargs=2, type=int, metavar=("ROW", "COL"),
                         help="query patch in the layer's token grid (default: the centre)")
    analyze.add_argument("--layer", type=int, default=0, metavar="I",
                         help="which PolaLinearAttention layer to draw, in module order (default: %(default)s)")
    analyze.add_argument("--img-size", type=positive_int, metavar="S", help="square input size (default: the model's)")
    analyze.add_argument("--max-rows", type=positive_int, default=256, metavar="R",
                         help="query rows sampled per layer and head for the entropies (default: %(default)s)")
    analyze.add_argument("--dpi", type=positive_int, default=60, help="figure resolution (default: %(default)s)")
    analyze.add_argument("--out", default="analysis", metavar="DIR", help="output folder (default: %(default)s)")
    analyze.set_defaults(handler=cmd_analyze)

    add_bench_parser(commands)

    export = commands.add_parser(
        "export", help="export a model to ONNX (dynamo exporter), verified against eager PyTorch in onnxruntime",
        description="Exports with torch.onnx's dynamo exporter, then runs the written file in onnxruntime on random "
                    "inputs (two batch sizes when the batch is dynamic) and keeps it only if it matches the eager "
                    "model within --atol; otherwise the file is deleted and the exit status is 1. Needs the 'export' "
                    "extra (onnx, onnxruntime, onnxscript). See docs/export.md.",
    )
    export.add_argument("--model", required=True, metavar="NAME", help="timm model name")
    export.add_argument(
        "--checkpoint", metavar="FILE",
        help="weights (default: random): the authors' checkpoints, ours, timm's, plain or .safetensors state dicts",
    )
    export.add_argument(
        "--weights", choices=("auto", "ema", "raw"), default="auto",
        help="with --checkpoint: the EMA or the raw weights (default: auto, EMA if the file has them)",
    )
    export.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="extra keyword argument for timm.create_model; repeatable",
    )
    export.add_argument("--img-size", type=positive_int, metavar="S", help="square input size (default: the model's)")
    export.add_argument(
        "--batch-size", type=positive_int, default=1, metavar="B",
        help="batch of the first verification, and of the input when the batch is static (default: %(default)s)",
    )
    export.add_argument("--format", choices=("onnx",), default="onnx", help="output format (default: %(default)s)")
    export.add_argument("--out", required=True, metavar="FILE", help="file to write (replaced atomically)")
    export.add_argument("--opset", type=positive_int, metavar="N", help="ONNX opset (default: the exporter's)")
    export.add_argument(
        "--dynamic-batch", action=argparse.BooleanOptionalAction, default=True,
        help="symbolic batch axis, verified at two batch sizes (default: on)",
    )
    export.add_argument(
        "--dynamic-size", action=argparse.BooleanOptionalAction, default=False,
        help="symbolic height/width, verified at a second size; refused for models whose graph depends on the "
             "size (all but PolaFormer++); default: off, the file takes --img-size only",
    )
    export.add_argument(
        "--atol", type=float, metavar="TOL",
        help="largest allowed max |onnxruntime - eager| (default: 1e-4)",
    )
    export.set_defaults(handler=cmd_export)

    from .lra.cli import add_lra_parser

    add_lra_parser(commands)
    from .dense.cli import add_dense_parsers

    add_dense_parsers(commands)
    return parser


# `train` options and the config keys they set (with --config or --data-path).
TRAIN_FLAG_KEYS = {
    "model": "MODEL.NAME", "data": "DATA.DATASET", "data_path": "DATA.DATA_PATH", "epochs": "TRAIN.EPOCHS",
    "batch_size": "DATA.BATCH_SIZE", "lr": "TRAIN.BASE_LR", "weight_decay": "TRAIN.WEIGHT_DECAY",
    "warmup_epochs": "TRAIN.WARMUP_EPOCHS", "label_smoothing": "MODEL.LABEL_SMOOTHING", "clip_grad": "TRAIN.CLIP_GRAD",
    "augment": "AUG.DIGITS_SHIFT", "seed": "SEED", "device": "DEVICE", "output": "OUTPUT",
}


def cmd_train(args: argparse.Namespace) -> int:
    if args.data is not None and args.data_path is not None:
        return _usage_error("train", f"give --data {args.data} or --data-path DIR, not both")
    # Settings shared by both modes, as config overrides applied after --opts.
    extra = []
    if args.resume == "auto":
        extra += ["TRAIN.AUTO_RESUME", True]
    elif args.resume:
        extra += ["MODEL.RESUME", args.resume]
    if args.finetune:
        extra += ["MODEL.PRETRAINED", args.finetune]
    if args.overwrite:
        extra += ["OVERWRITE", True]
    if args.amp is not None:
        extra += ["AMP", args.amp]
    if args.use_checkpoint:
        extra += ["TRAIN.USE_CHECKPOINT", True]
    opts = [*args.opts, *extra]

    if args.config is None and args.data_path is None:  # the digits demo
        overrides = {key: getattr(args, key) for key in TRAIN_FLAG_KEYS if key not in ("model", "data", "data_path")}
        config = make_config(args.model or DEFAULT_MODEL, args.data or DEFAULT_DATA,
                             model_kwargs=dict(args.model_kwargs or []), **overrides)
        metrics = run_training(config, opts=opts)
        if _is_main_process():
            print(
                f"final test top-1: {metrics['final_test_top1']:.2f}% "
                f"(epochs={config.epochs}, time={metrics['wall_time_s']:.1f}s) -> {metrics['checkpoint']}"
            )
        return 0

    cfg = load_config(args.config, args.opts)
    for name, key in TRAIN_FLAG_KEYS.items():
        if getattr(args, name) is not None:
            cfg.set_path(key, getattr(args, name), source=f"--{name.replace('_', '-')}")
    cfg.MODEL.KWARGS.merge(dict(args.model_kwargs or []), source="--model-kwarg")
    merge_opts(cfg, extra)
    metrics = run_training(cfg)
    if _is_main_process():
        ema = f"EMA {metrics['best_ema_top1']:.2f}%, " if "best_ema_top1" in metrics else ""
        print(
            f"best top-1: {metrics.get('best_test_top1', float('nan')):.2f}% ({ema}final "
            f"{metrics.get('final_test_top1', float('nan')):.2f}%, epochs={len(metrics['epochs'])}, "
            f"time={metrics['wall_time_s']:.1f}s) -> {metrics['output']}"
        )
    return 0


def _is_main_process() -> bool:
    """Rank 0 under torchrun (which sets RANK), or a plain process."""
    return os.environ.get("RANK", "0") == "0"


# `eval` options that only make sense with --data-path (an image folder).
FOLDER_EVAL_OPTIONS = {
    "model_kwargs": "--model-kwarg", "weights": "--weights", "batch_size": "--batch-size", "img_size": "--img-size",
    "crop_pct": "--crop-pct", "workers": "--workers", "amp": "--amp",
}


def cmd_eval(args: argparse.Namespace) -> int:
    if args.data_path is not None:
        return _eval_folder(args)
    given = [option for name, option in FOLDER_EVAL_OPTIONS.items() if getattr(args, name) not in (None, False)]
    if given:
        return _usage_error("eval", f"{given[0]} needs --data-path DIR (it applies to image folders)")
    metrics, checkpoint = evaluate_checkpoint(args.checkpoint, data=args.data, arch=args.model, device=args.device,
                                              allow_nonfinite=args.allow_nonfinite)
    print(
        f"test top-1: {metrics['top1']:.2f}% (top-5: {metrics['top5']:.2f}%, loss: {metrics['loss']:.4f}; "
        f"{checkpoint['arch']}, epoch {checkpoint.get('epoch', '?')}) <- {args.checkpoint}"
    )
    return 0


def _eval_folder(args: argparse.Namespace) -> int:
    if args.data is not None:
        return _usage_error("eval", "give --data (an embedded data set) or --data-path DIR, not both")
    if args.crop_pct is not None and not 0 < args.crop_pct <= 1:
        return _usage_error("eval", f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    if args.workers is not None and args.workers < 0:
        return _usage_error("eval", f"--workers must be >= 0, got {args.workers}")
    try:
        result = evaluate_folder_checkpoint(
            args.checkpoint, args.data_path, model=args.model, model_kwargs=dict(args.model_kwargs or []),
            weights=args.weights or "auto", batch_size=args.batch_size or DEFAULT_EVAL_BATCH_SIZE,
            img_size=args.img_size, crop_pct=args.crop_pct, workers=4 if args.workers is None else args.workers,
            device=args.device, amp=args.amp, allow_nonfinite=args.allow_nonfinite,
        )
    except (EvalError, DatasetError) as e:
        return _usage_error(None, str(e))
    m, load = result.metrics, result.load
    weights = f"{load.entry!r} weights" if load.entry else "state dict"
    epoch = f", epoch {load.epoch}" if load.epoch is not None else ""
    skipped = f", {m['skipped']} unreadable skipped" if m["skipped"] else ""
    print(
        f"val top-1: {m['top1']:.3f}% (top-5: {m['top5']:.3f}%, loss: {m['loss']:.4f}; {m['images']} images{skipped}; "
        f"{result.arch}, {weights}{epoch}, {result.img_size}px) <- {args.checkpoint}"
    )
    return 0


def cmd_throughput(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        return _usage_error("throughput", f"--warmup must be >= 0, got {args.warmup}")
    try:
        result = model_throughput(
            args.model, model_kwargs=dict(args.model_kwargs or []), img_size=args.img_size,
            batch_size=args.batch_size, warmup=args.warmup, iters=args.iters, device=args.device, amp=args.amp,
        )
    except EvalError as e:
        return _usage_error(None, str(e))
    c, h, w = result.input_size
    print(
        f"throughput: {result.images_per_s:.1f} images/s ({args.model}, batch {result.batch_size}, {c}x{h}x{w}, "
        f"{result.ms_per_batch:.1f} ms/batch over {result.iters} iterations after {result.warmup} warm-up, "
        f"{result.device}{', amp' if result.amp else ''})"
    )
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from .analysis import AnalyzeError, analyze

    try:
        result = analyze(
            args.out, image=args.image, model_name=args.model, checkpoint=args.checkpoint,
            query=tuple(args.query) if args.query else None, layer=args.layer, img_size=args.img_size,
            max_rows=args.max_rows, dpi=args.dpi,
        )
    except AnalyzeError as e:
        return _usage_error("analyze", str(e))
    fractions = result["theorem1"]["all_layers"]
    drop = fractions["pola same-sign vs relu"]["fraction_drop"]
    print(
        f"analysis of {result['model']} ({result['weights']}), layer {result['layer']}: gate r = "
        f"{result['gate_pearson_r']:.3f}, PSE drops under the power map vs ReLU in {drop:.1%} of rows "
        f"-> {args.out}/{{{','.join(result['files'])},analysis.json}}"
    )
    return 0


def add_bench_parser(commands) -> None:
    """``polaformer bench``: the scaling suite itself, or one benchmark family named after it."""
    bench = commands.add_parser(
        "bench", help="speed and memory benchmarks: op/model scaling with a matmul roofline by default, or a FAMILY",
        description="Without FAMILY: (a) op level: fused Pola vs SDPA softmax vs ELU+1 and focused linear attention "
                    "(and, with --methods, the official two-stream formulation), forward and forward+backward, over N "
                    "tokens; (b) model level: images/s and peak memory of Pola-PVT-T and Pola-Swin-T against softmax "
                    "attention over input sizes; (c) large-matmul GFLOP/s and each op's roofline fraction. Writes "
                    "DIR/results.json, DIR/bench_ops.png, DIR/bench_models.png. 'polaformer bench FAMILY --help' "
                    "describes the others.",
    )
    # --out is checked in cmd_bench: a required option here would be demanded of every FAMILY too.
    bench.add_argument("--out", metavar="DIR", help="output folder (required without FAMILY)")
    bench.add_argument("--tokens", type=positive_int, nargs="+", metavar="N",
                       help="op sequence lengths (default: 196 1024 4096 16384 65536; --quick: 196 1024 4096)")
    bench.add_argument("--heads", type=positive_int, default=8, help="op heads (default: %(default)s)")
    bench.add_argument("--head-dim", type=positive_int, default=64, help="op head size, even (default: %(default)s)")
    bench.add_argument("--batch", type=positive_int, default=1, help="op batch (default: %(default)s)")
    bench.add_argument("--methods", nargs="+", metavar="NAME",
                       help="op methods: fused_pola sdpa_softmax elu_linear focused_linear two_stream_pola "
                            "(default: all but two_stream_pola)")
    bench.add_argument("--sizes", type=positive_int, nargs="+", metavar="S",
                       help="model input sizes (default: 224 448 640 1024; --quick: 224)")
    bench.add_argument("--models", nargs="+", metavar="NAME", choices=["pola_pvt_tiny", "pola_swin_t"],
                       help="models to compare with their softmax variants (default: pola_pvt_tiny pola_swin_t)")
    bench.add_argument("--no-models", action="store_true", help="skip the model-level part")
    bench.add_argument("--min-run-time", type=float, metavar="S",
                       help="seconds per measurement (default: 1.0; --quick: 0.05)")
    bench.add_argument("--max-softmax-tokens", type=positive_int, default=16384, metavar="N",
                       help="skip SDPA above this N (O(N²); default: %(default)s)")
    bench.add_argument("--matmul-size", type=positive_int, metavar="S",
                       help="square matmul for the machine's GFLOP/s (default: 4096; --quick: 1024)")
    bench.add_argument("--no-op-memory", action="store_true",
                       help="skip the per-N peak-memory subprocesses of the fused op")
    bench.add_argument("--quick", action="store_true", help="fewer, smaller measurements (explicit options win)")
    bench.set_defaults(handler=cmd_bench)
    families = bench.add_subparsers(dest="bench_family", metavar="FAMILY")

    def rows_files(parser, markdown=False):
        parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
        parser.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (scalar fields)")
        if markdown:
            parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")

    official = families.add_parser(
        "official", help="whole models against the authors' code: inference and training step, same weights",
        description="Builds the official models from local checkouts (POLAFORMER_OFFICIAL_DIR, "
                    "POLAFORMERPP_OFFICIAL_DIR; a family without one is skipped), loads their weights into ours, "
                    "checks equal outputs, then times both interleaved. Pola-DeiT and Pola-PVTv2 are compared with "
                    "our model running the official formulation. Also: python benchmarks/bench_models_vs_official.py.",
    )
    official.add_argument("--models", nargs="+", metavar="NAME", default=["pola_pvt_tiny", "pola_swin_t", "POLA_b0",
                          "pola_deit_tiny_patch16_224", "pola_pvt_v2_b0"], help="default: all five")
    official.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    official.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"])
    official.add_argument("--threads", type=positive_int, default=2)
    official.add_argument("--rounds", type=positive_int, default=15, help="interleaved rounds (default: %(default)s)")
    official.add_argument("--min-time", type=float, default=0.05, metavar="S",
                          help="seconds per timing sample, at least one step (default: %(default)s)")
    official.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    official.add_argument("--floor", action="store_true",
                          help="also time ours with the attention cores removed (bounds the reachable ratio)")
    official.add_argument("--matmul-floor", action="store_true",
                          help="also time ours with the linear-attention cores reduced to their matrix products")
    rows_files(official, markdown=True)
    official.set_defaults(handler=cmd_bench_family, run_family=_bench_official, seconds_flags=("--min-time",))

    native = families.add_parser(
        "native", help="the native CPU kernels against the torch ops of the same stages, interleaved",
        description="The Pola and PaCS ops at the models' stage shapes (and whole models with --models), inference "
                    "and training, with the native kernels and with the torch ops; ratio torch ops / native.",
    )
    native.add_argument("--models", nargs="*", default=[], metavar="NAME", help="timm names of whole models to time")
    native.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    native.add_argument("--threads", type=positive_int, default=2)
    native.add_argument("--rounds", type=positive_int, default=3)
    native.add_argument("--min-time", type=float, default=0.3, metavar="S", help="seconds per op sample")
    native.add_argument("--model-steps", type=positive_int, default=6, help="steps per whole-model sample")
    rows_files(native)
    native.set_defaults(handler=cmd_bench_family, run_family=_bench_native, seconds_flags=("--min-time",))

    pacs = families.add_parser(
        "pacs", help="PolaFormer++'s fused PaCS op against its functional graph, forward and forward+backward",
        description="Shapes of POLA_b0's linear stages at 224 px (head_dim 32, RoPE on), timed interleaved.",
    )
    pacs.add_argument("--batch", type=positive_int, default=8)
    pacs.add_argument("--threads", type=positive_int, default=2)
    pacs.add_argument("--rounds", type=positive_int, default=5)
    pacs.add_argument("--min-time", type=float, default=0.2, metavar="S")
    rows_files(pacs)
    pacs.set_defaults(handler=cmd_bench_family, run_family=_bench_pacs, seconds_flags=("--min-time",))

    dense = families.add_parser(
        "dense", help="backbone forward time and peak memory at detection resolutions, Pola vs softmax",
        description="Pola-PVT-T and Pola-Swin-T against their softmax versions, features_only forward, batch 1, "
                    "one subprocess per (model, size) so that every peak memory is its own. See docs/dense.md.",
    )
    dense.add_argument("--sizes", nargs="+", default=["512", "800x1344", "1024", "1536"], metavar="HxW",
                       help="HxW or S (square); multiples of 32 (800x1333 is padded to 800x1344 by the detectors)")
    dense.add_argument("--device", default="cpu")
    dense.add_argument("--min-run-time", type=float, default=1.0, metavar="S",
                       help="seconds of timing per measurement")
    rows_files(dense)
    dense.set_defaults(handler=cmd_bench_family, run_family=_bench_dense, seconds_flags=("--min-run-time",))

    deploy = families.add_parser(
        "deploy", help="inference speed under the CPU deployment options: eager, channels-last, bf16, compile, ONNX",
        description="Every variant of a (model, batch) timed in interleaved rounds, with its one-off cost and its "
                    "max |diff| against eager fp32. Writes DIR/results.json and DIR/table.md. See docs/deployment.md.",
    )
    deploy.add_argument("--out", required=True, metavar="DIR", help="folder for results.json and table.md")
    deploy.add_argument("--models", nargs="+", metavar="NAME", default=["pola_deit_tiny_patch16_224", "pola_pvt_tiny",
                        "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0"])
    deploy.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8], metavar="B")
    deploy.add_argument("--img-size", type=positive_int, default=224)
    deploy.add_argument("--variants", nargs="+", metavar="NAME",
                        help="eager_fp32 eager_channels_last eager_bf16 compile_fp32 onnxruntime_fp32 (default: all)")
    deploy.add_argument("--threads", type=int, default=0, help="torch and onnxruntime intra-op threads (0: torch's default)")
    deploy.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds per row")
    deploy.add_argument("--min-run-time", type=float, default=1.0, metavar="S", help="seconds per variant and round")
    deploy.add_argument("--row-budget", type=float, default=240.0, metavar="S",
                        help="skip a row whose timing rounds are estimated (from the eager batch-1 time) to take longer")
    deploy.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's usual cache folder (compile times then depend on earlier runs)")
    deploy.set_defaults(handler=cmd_bench_family, run_family=_bench_deploy, seconds_flags=("--min-run-time", "--row-budget"))

    lra = families.add_parser(
        "lra", help="the paper's Table 6: LRA training throughput and peak memory of every attention, vs softmax",
        description="Also 'polaformer lra bench'. See docs/lra.md.",
    )
    add_lra_bench_arguments(lra)


def add_lra_bench_arguments(parser) -> None:
    """The options of ``polaformer bench lra``, also ``polaformer lra bench``."""
    parser.add_argument("--out", required=True, metavar="DIR", help="writes results.json, table.md, bench_lra.png")
    parser.add_argument("--attentions", nargs="+", metavar="NAME", help="default: all")
    parser.add_argument("--lengths", nargs="+", type=positive_int, metavar="N", help="default: 1024 2048 4096")
    parser.add_argument("--batch-size", type=positive_int, help="fixed batch for every measurement (default: 4)")
    parser.add_argument("--steps", type=positive_int, help="timed training steps per measurement (default: 3)")
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(handler=cmd_bench_family, run_family=_bench_lra, seconds_flags=())


def _print_line(msg: str) -> None:
    print(msg, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.scaling import (
        DEFAULT_METHODS, DEFAULT_MODELS, DEFAULT_SIZES, DEFAULT_TOKENS, OP_METHODS, QUICK_SIZES, QUICK_TOKENS,
        BenchConfig, run_bench,
    )

    if args.out is None:
        return _usage_error("bench", "the following arguments are required: --out")
    if args.head_dim % 2:
        return _usage_error("bench", f"--head-dim must be even (Pola splits values in two), got {args.head_dim}")
    min_run_time = args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0)
    if not min_run_time > 0:
        return _usage_error("bench", f"--min-run-time must be > 0, got {args.min_run_time}")
    unknown = [m for m in args.methods or () if m not in OP_METHODS]
    if unknown:
        return _usage_error("bench", f"unknown --methods {' '.join(unknown)}; known: {' '.join(OP_METHODS)}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return _usage_error("bench", f"--out {args.out!r} exists and is not a folder")
    config = BenchConfig(
        out=args.out,
        tokens=tuple(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)),
        heads=args.heads, head_dim=args.head_dim, batch=args.batch,
        methods=tuple(dict.fromkeys(args.methods or DEFAULT_METHODS)),
        sizes=tuple(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)),
        models=() if args.no_models else tuple(args.models or DEFAULT_MODELS),
        min_run_time=min_run_time, max_softmax_tokens=args.max_softmax_tokens,
        matmul_size=args.matmul_size or (1024 if args.quick else 4096),
        op_memory=not args.no_op_memory, quick=args.quick,
    )
    results = run_bench(config, log=_print_line)
    exponent = results["op_summary"].get("fused_pola_fwd_bwd_exponent")
    exponent_text = "n/a (needs 2 sizes in 4096..65536)" if exponent is None else f"{exponent:.3f} (N 4096..65536)"
    print(f"fused Pola fwd+bwd time exponent {exponent_text}; wrote results.json, {', '.join(results['plots'])} "
          f"-> {args.out} ({results['wall_time_s']:.0f} s)")
    return 0


def cmd_bench_family(args: argparse.Namespace) -> int:
    """Checks the options every family shares, then runs it; its ValueError/RuntimeError is a one-line error."""
    command = "lra bench" if args.command == "lra" else f"bench {args.bench_family}"
    for flag in args.seconds_flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not value > 0:
            return _usage_error(command, f"{flag} must be > 0, got {value}")
    try:
        return args.run_family(args)
    except (ValueError, RuntimeError) as e:
        return _usage_error(command, str(e))


def _write_bench_rows(args: argparse.Namespace, rows: list, document=None, table: str | None = None) -> None:
    """The files a family's --json/--csv/--markdown ask for: JSON is ``document`` (default: the rows)."""
    from .bench.harness import write_csv, write_json, write_text

    if getattr(args, "json", None):
        write_json(args.json, rows if document is None else document)
    if getattr(args, "csv", None):
        write_csv(args.csv, rows)
    if getattr(args, "markdown", None) and table is not None:
        write_text(args.markdown, table)


def _bench_official(args: argparse.Namespace) -> int:
    from .bench.official import markdown_table, run_official

    result = run_official(models=args.models, batches=args.batches, modes=args.modes, threads=args.threads,
                          rounds=args.rounds, min_time=args.min_time, compile=args.compile, floor=args.floor,
                          matmul_floor=args.matmul_floor, log=_print_line)
    if not result["rows"]:
        print("nothing to run", file=sys.stderr)
        return 0
    _write_bench_rows(args, result["rows"], result, markdown_table(result["rows"], result["meta"]))
    return 0


def _bench_native(args: argparse.Namespace) -> int:
    from .bench.native import run_native

    rows = run_native(models=args.models, batches=args.batches, threads=args.threads, rounds=args.rounds,
                      min_time=args.min_time, model_steps=args.model_steps, log=_print_line)
    _write_bench_rows(args, rows, {"threads": args.threads, "rows": rows})
    return 0


def _bench_pacs(args: argparse.Namespace) -> int:
    from .bench.pacs import run_pacs, table

    rows = run_pacs(batch=args.batch, threads=args.threads, rounds=args.rounds, min_time=args.min_time)
    print(table(rows), end="")
    _write_bench_rows(args, rows)
    return 0


def _bench_dense(args: argparse.Namespace) -> int:
    from .bench.dense import run_dense, table

    rows = run_dense(sizes=args.sizes, device=args.device, min_run_time=args.min_run_time, log=_print_line)
    print(table(rows, args.device), end="")
    _write_bench_rows(args, rows)
    return 0


def _bench_deploy(args: argparse.Namespace) -> int:
    from .bench.deploy import VARIANTS, run_deploy

    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    result = run_deploy(args.out, models=args.models, batches=args.batches, img_size=args.img_size,
                        variants=args.variants or VARIANTS, threads=args.threads, rounds=args.rounds,
                        min_run_time=args.min_run_time, row_budget=args.row_budget, warm_cache=args.warm_cache,
                        log=_print_line)
    print(result["table"], end="")
    return 0


def _bench_lra(args: argparse.Namespace) -> int:
    from .bench.lra import run_lra_bench

    result = run_lra_bench(args.out, attentions=args.attentions, lengths=args.lengths, batch_size=args.batch_size,
                           steps=args.steps, device=args.device, log=_print_line)
    print(f"wrote {', '.join(result['files'])} -> {args.out} ({result['wall_time_s']:.0f} s)")
    return 0


VERIFICATION_FAILED = 1  # `export`: the file did not reproduce the model and was deleted


def cmd_export(args: argparse.Namespace) -> int:
    from .export import DEFAULT_ATOL, ExportError, ExportVerificationError, export_model

    if args.atol is not None and not args.atol >= 0:
        return _usage_error("export", f"--atol must be >= 0, got {args.atol}")
    if args.checkpoint is None and args.weights != "auto":
        return _usage_error("export", "--weights needs --checkpoint FILE")
    try:
        result = export_model(
            args.model, args.out, checkpoint=args.checkpoint, weights=args.weights,
            model_kwargs=dict(args.model_kwargs or []), img_size=args.img_size, batch_size=args.batch_size,
            dynamic_batch=args.dynamic_batch, dynamic_size=args.dynamic_size, opset=args.opset,
            atol=DEFAULT_ATOL if args.atol is None else args.atol,
        )
    except ExportVerificationError as e:
        print(f"polaformer export: error: {e}", file=sys.stderr)
        return VERIFICATION_FAILED
    except ExportError as e:
        return _usage_error("export", str(e))
    print(result.summary(args.model))
    return 0


def _usage_error(command: str | None, message: str) -> int:
    prog = f"polaformer {command}" if command else "polaformer"
    print(one_line(f"{prog}: error: {message}"), file=sys.stderr)
    return USAGE_ERROR


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_cpu_allocator()  # reuse freed large CPU buffers instead of page-faulting them in again
    with _log_to_stderr():
        try:
            return args.handler(args)
        except (CheckpointError, ModelBuildError, UnknownDatasetError, ConfigError, DatasetError, EvalError,
                TrainingDivergedError) as e:
            return _usage_error(None, str(e))
        except OSError as e:  # the environment: a full disk, a file that cannot be written or read
            where = f": {e.filename}" if e.filename else ""
            return _usage_error(None, f"{(e.strerror or str(e)).lower()}{where}")
        except KeyboardInterrupt as e:
            note = ""
            if isinstance(e, TrainingInterrupted):
                saved = e.checkpoint
                note = f"; last saved checkpoint: {saved}" if saved else "; no checkpoint saved by this run"
            print(one_line(f"polaformer: interrupted{note}"), file=sys.stderr)
            return INTERRUPTED


@contextmanager
def _log_to_stderr():
    # The engine logs one line per epoch. Attach a handler to our own logger (not the root) for
    # this call only, bound to the current sys.stderr, which tests may have swapped.
    logger = logging.getLogger("polaformer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _version() -> str:
    try:
        return version("polaformer")
    except PackageNotFoundError:
        return "unknown (not installed)"
