"""``polaformer train|eval|throughput|analyze|export``: image classification and what works on its models."""
from __future__ import annotations

import argparse
import sys

from .common import (
    FLAG_KEYS,
    add_allow_changed,
    add_engine_options,
    add_overwrite,
    one_line,
    option_values,
    parse_model_kwarg,
    positive_int,
    print_summary,
    set_flags,
    usage_error,
)

__all__ = ["add_classification_parsers"]

# What the parser shows and accepts, known without importing torch (polaformer.data.DATASETS and DEFAULT_DATA,
# polaformer.tasks.classification.DEFAULT_MODEL and DEFAULT_EVAL_BATCH_SIZE; tests/cli/test_startup.py checks them).
DATASET_NAMES = ("digits",)
DEFAULT_DATA = "digits"
DEFAULT_MODEL = "pola_deit_digits"
DEFAULT_EVAL_BATCH_SIZE = 128


def add_classification_parsers(commands) -> None:
    # Options default to None so that make_config (and the config file) can tell "not given".
    train = commands.add_parser(
        "train",
        help="train a model: the digits demo by default, or any recipe with --config/--data-path",
        description="Without --config and --data-path: the embedded digits demo (writes checkpoint.pth and "
                    "metrics.json). With them: the official configuration keys (see docs/training.md); writes "
                    "last.pth, best.pth, metrics.jsonl and metrics.json. Under torchrun, one process per GPU.",
    )
    train.add_argument("--config", "--cfg", metavar="FILE", help="YAML file with the official config keys")
    train.add_argument("--data-path", metavar="DIR",
                       help="ImageNet-layout folder: DIR/train/<class>/, DIR/val/<class>/; or tar shards listed in "
                            "DIR/_info.json (polaformer data shard)")
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
    add_allow_changed(train)
    train.add_argument(
        "--finetune", metavar="FILE",
        help="start from these weights (MODEL.PRETRAINED): position tables resized, classifier replaced if the "
             "number of classes differs",
    )
    train.add_argument("--lora", type=int, metavar="RANK",
                       help="with --finetune: train LoRA adapters of this rank on the attention projections, the Pola "
                            "layers' own tensors and the classifier only; OUTPUT/merged.pth at the end (MODEL.LORA)")
    train.add_argument(
        "--opts", nargs="+", default=[], metavar="KEY VALUE",
        help="config overrides as KEY VALUE pairs, e.g. --opts TRAIN.EPOCHS 30 DATA.NUM_WORKERS 4",
    )
    train.add_argument("--model", metavar="NAME", help=f"timm model name (MODEL.NAME; digits default: {DEFAULT_MODEL})")
    train.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="extra keyword argument for timm.create_model (MODEL.KWARGS); repeatable (e.g. --model-kwarg depth=2)",
    )
    train.add_argument("--data", choices=DATASET_NAMES, help=f"embedded data set (default: {DEFAULT_DATA})")
    train.add_argument("--label-smoothing", type=float, help="label smoothing of the training loss")
    train.add_argument("--augment", action=argparse.BooleanOptionalAction, help="digits: random ±1 pixel shifts")
    add_engine_options(train, "train")
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
        "--data", choices=DATASET_NAMES, help="embedded data set (default: the one the checkpoint was trained on)"
    )
    evaluate.add_argument(
        "--data-path", metavar="DIR",
        help="ImageNet-layout folder: evaluates on DIR/val/<class>/<image>; or the validation shards of DIR/_info.json"
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
        "--batch-size", type=positive_int, metavar="B",
        help=f"with --data-path: batch size (default: {DEFAULT_EVAL_BATCH_SIZE})"
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
    analyze.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="model constructor argument, e.g. the Table 3 switches local=dcn, polarity=false (repeatable)",
    )
    analyze.add_argument("--out", default="analysis", metavar="DIR", help="output folder (default: %(default)s)")
    add_overwrite(analyze, "figures and analysis.json in --out")
    analyze.set_defaults(handler=cmd_analyze)

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
    export.add_argument("--out", required=True, metavar="FILE", help="file to write (atomically)")
    add_overwrite(export, "a file at --out")
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
    export.add_argument(
        "--int8", action="store_true",
        help="write the verified graph with its linear layers quantized to int8 (onnxruntime's dynamic quantizer); "
             "its difference from the float32 model is reported",
    )
    export.add_argument(
        "--speed", action=argparse.BooleanOptionalAction, default=True,
        help="time the written file in onnxruntime beside eager PyTorch on the first verification batch "
             "(default: on; --no-speed skips it)",
    )
    export.set_defaults(handler=cmd_export)



def cmd_train(args: argparse.Namespace) -> int:
    from ..engine.config import merge_opts
    from ..tasks.classification import load_config, run_training
    from ..tasks.classification.config import digits_config

    if args.data is not None and args.data_path is not None:
        return usage_error("train", f"give --data {args.data} or --data-path DIR, not both")
    # Settings shared by both modes, as config overrides applied after --opts.
    extra = []
    if args.resume == "auto":
        extra += ["TRAIN.AUTO_RESUME", True]
    elif args.resume:
        extra += ["MODEL.RESUME", args.resume]
    if args.finetune:
        extra += ["MODEL.PRETRAINED", args.finetune]
    if args.lora is not None:
        extra += ["MODEL.LORA", args.lora]
    if args.allow_changed:
        extra += ["ALLOW_CHANGED", list(args.allow_changed)]
    if args.overwrite:
        extra += ["OVERWRITE", True]

    if args.config is None and args.data_path is None:  # the digits demo
        overrides = {flag: getattr(args, flag) for flag in FLAG_KEYS["train"]
                     if flag not in ("model", "data", "data_path")}
        config, option_opts = digits_config(args.model or DEFAULT_MODEL, args.data or DEFAULT_DATA,
                                            option_values("train", args), model_kwargs=dict(args.model_kwargs or []),
                                            **overrides)
        metrics = run_training(config, opts=[*args.opts, *option_opts, *extra])
        print_summary(f"final test top-1: {metrics['final_test_top1']:.2f}% "
                      f"(epochs={config.epochs}, time={metrics['wall_time_s']:.1f}s) -> {metrics['checkpoint']}")
        return 0

    cfg = load_config(args.config, args.opts)
    set_flags(cfg, "train", args)
    cfg.MODEL.KWARGS.merge(dict(args.model_kwargs or []), source="--model-kwarg")
    merge_opts(cfg, extra)
    metrics = run_training(cfg)
    ema = f"EMA {metrics['best_ema_top1']:.2f}%, " if "best_ema_top1" in metrics else ""
    print_summary(f"best top-1: {metrics.get('best_test_top1', float('nan')):.2f}% ({ema}final "
                  f"{metrics.get('final_test_top1', float('nan')):.2f}%, epochs={len(metrics['epochs'])}, "
                  f"time={metrics['wall_time_s']:.1f}s) -> {metrics['output']}")
    return 0


# `eval` options that only make sense with --data-path (an image folder).
FOLDER_EVAL_OPTIONS = {
    "model_kwargs": "--model-kwarg", "weights": "--weights", "batch_size": "--batch-size", "img_size": "--img-size",
    "crop_pct": "--crop-pct", "workers": "--workers", "amp": "--amp",
}


def cmd_eval(args: argparse.Namespace) -> int:
    from ..tasks.classification import evaluate_checkpoint

    if args.data_path is not None:
        return _eval_folder(args)
    given = [option for name, option in FOLDER_EVAL_OPTIONS.items() if getattr(args, name) not in (None, False)]
    if given:
        return usage_error("eval", f"{given[0]} needs --data-path DIR (it applies to image folders)")
    metrics, checkpoint = evaluate_checkpoint(args.checkpoint, data=args.data, arch=args.model, device=args.device,
                                              allow_nonfinite=args.allow_nonfinite)
    print(
        f"test top-1: {metrics['top1']:.2f}% (top-5: {metrics['top5']:.2f}%, loss: {metrics['loss']:.4f}; "
        f"{checkpoint['arch']}, epoch {checkpoint.get('epoch', '?')}) <- {args.checkpoint}"
    )
    return 0


def _eval_folder(args: argparse.Namespace) -> int:
    from ..data.folder import DatasetError
    from ..tasks.classification.evaluation import EvalError, evaluate_folder_checkpoint

    if args.data is not None:
        return usage_error("eval", "give --data (an embedded data set) or --data-path DIR, not both")
    if args.crop_pct is not None and not 0 < args.crop_pct <= 1:
        return usage_error("eval", f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    if args.workers is not None and args.workers < 0:
        return usage_error("eval", f"--workers must be >= 0, got {args.workers}")
    try:
        result = evaluate_folder_checkpoint(
            args.checkpoint, args.data_path, model=args.model, model_kwargs=dict(args.model_kwargs or []),
            weights=args.weights or "auto", batch_size=args.batch_size or DEFAULT_EVAL_BATCH_SIZE,
            img_size=args.img_size, crop_pct=args.crop_pct, workers=4 if args.workers is None else args.workers,
            device=args.device, amp=args.amp, allow_nonfinite=args.allow_nonfinite,
        )
    except (EvalError, DatasetError) as e:
        return usage_error(None, str(e))
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
    from ..tasks.classification.evaluation import EvalError, model_throughput

    if args.warmup < 0:
        return usage_error("throughput", f"--warmup must be >= 0, got {args.warmup}")
    try:
        result = model_throughput(
            args.model, model_kwargs=dict(args.model_kwargs or []), img_size=args.img_size,
            batch_size=args.batch_size, warmup=args.warmup, iters=args.iters, device=args.device, amp=args.amp,
        )
    except EvalError as e:
        return usage_error(None, str(e))
    c, h, w = result.input_size
    print(
        f"throughput: {result.images_per_s:.1f} images/s ({args.model}, batch {result.batch_size}, {c}x{h}x{w}, "
        f"{result.ms_per_batch:.1f} ms/batch over {result.iters} iterations after {result.warmup} warm-up, "
        f"{result.device}{', amp' if result.amp else ''})"
    )
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from ..analysis import AnalyzeError, analyze

    try:
        result = analyze(
            args.out, image=args.image, model_name=args.model, checkpoint=args.checkpoint,
            query=tuple(args.query) if args.query else None, layer=args.layer, img_size=args.img_size,
            max_rows=args.max_rows, dpi=args.dpi, model_kwargs=dict(args.model_kwargs or []), overwrite=args.overwrite,
        )
    except AnalyzeError as e:
        return usage_error("analyze", str(e))
    fractions = result["theorem1"]["all_layers"]
    drop = fractions["pola same-sign vs relu"]["fraction_drop"]
    gate = "no gate" if result["gate_pearson_r"] is None else f"gate r = {result['gate_pearson_r']:.3f}"
    print(
        f"analysis of {result['model']} ({result['weights']}), layer {result['layer']}: {gate}, "
        f"PSE drops under the power map vs ReLU in {drop:.1%} of rows "
        f"-> {args.out}/{{{','.join(result['files'])},analysis.json}}"
    )
    return 0


VERIFICATION_FAILED = 1  # `export`: the file did not reproduce the model and was deleted


def cmd_export(args: argparse.Namespace) -> int:
    from ..export import DEFAULT_ATOL, ExportError, ExportVerificationError, export_model

    if args.atol is not None and not args.atol >= 0:
        return usage_error("export", f"--atol must be >= 0, got {args.atol}")
    if args.checkpoint is None and args.weights != "auto":
        return usage_error("export", "--weights needs --checkpoint FILE")
    from ..engine.output import claim_outputs

    claim_outputs([args.out], args.overwrite, "--out")
    try:
        result = export_model(
            args.model, args.out, checkpoint=args.checkpoint, weights=args.weights,
            model_kwargs=dict(args.model_kwargs or []), img_size=args.img_size, batch_size=args.batch_size,
            dynamic_batch=args.dynamic_batch, dynamic_size=args.dynamic_size, opset=args.opset,
            atol=DEFAULT_ATOL if args.atol is None else args.atol, int8=args.int8, speed=args.speed,
        )
    except ExportVerificationError as e:
        print(one_line(f"polaformer export: error: {e}"), file=sys.stderr)
        return VERIFICATION_FAILED
    except ExportError as e:
        return usage_error("export", str(e))
    print(result.summary(args.model))
    return 0
