"""``polaformer detect train|eval|predict`` and ``polaformer segment train|eval`` (see docs/dense.md)."""
from __future__ import annotations

import json
from pathlib import Path

from .common import (
    add_command_group,
    add_overwrite,
    add_train_options,
    flag_values,
    parse_model_kwarg,
    positive_int,
    print_summary,
    run_options,
    usage_error,
)

__all__ = ["add_dense_parsers"]


def _task_group(commands, task: str, model: str, help: str, description: str):
    """``polaformer TASK`` and its ``train`` subcommand with the options detect and segment share; returns the
    group (for ``eval`` and ``predict``) and the ``train`` parser (for the task's own options)."""
    sub = add_command_group(commands, task, help, description)
    parser = sub.add_parser("train", help=f"train a {model}; writes last.pth/best.pth (atomically) and metrics.json")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML recipe (configs/dense/); default: the embedded digits recipe")
    parser.add_argument("--backbone", metavar="NAME", help="timm model name of the backbone (model.backbone)")
    parser.add_argument("--backbone-weights", metavar="FILE",
                        help="ImageNet checkpoint for the backbone (ours or the authors'); position tables resampled")
    parser.add_argument("--backbone-kwarg", dest="backbone_kwargs", action="append", type=parse_model_kwarg,
                        metavar="KEY=VALUE",
                        help="timm.create_model option of the backbone, e.g. img_size=512; repeatable")
    add_train_options(parser, "dense train", (
        ("train_size", positive_int, "digits: number of training canvases"),
        ("val_size", positive_int, "digits: number of validation canvases"),
    ), output=f"runs/{task}/BACKBONE", opts_example="train.lr 1e-4 train.batch_size 4")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return sub, parser


def _coco_options(parser, train: bool) -> None:
    prefixes = ("train", "val") if train else ("val",)
    for prefix in prefixes:
        parser.add_argument(f"--{prefix}-images", metavar="DIR", help=f"COCO format: folder of the {prefix} images")
        parser.add_argument(f"--{prefix}-annotations", metavar="FILE", help=f"COCO format: {prefix} instances JSON")


def _eval_parser(sub, help: str, handler, add_data_options) -> None:
    """A task's ``eval`` subcommand: a checkpoint, the data options ``add_data_options`` adds, the digits'
    validation size and the device."""
    evaluate = sub.add_parser("eval", help=help)
    evaluate.add_argument("--checkpoint", required=True, metavar="FILE")
    add_data_options(evaluate)
    evaluate.add_argument("--val-size", type=positive_int, help="digits: number of validation canvases")
    evaluate.add_argument("--device", default="auto")
    evaluate.set_defaults(handler=handler)


def add_dense_parsers(commands) -> None:
    sub, train = _task_group(
        commands, "detect", "detector",
        "detection / instance segmentation with torchvision detectors on Pola backbones",
        "RetinaNet, FCOS, Faster, Mask and Cascade Mask R-CNN on a Pola backbone + FPN (docs/dense.md). Without data "
        "options: the embedded digit scenes.",
    )
    train.add_argument("--detector", choices=("retinanet", "fcos", "fasterrcnn", "maskrcnn", "cascade_mask_rcnn"),
                       help="model.detector")
    _coco_options(train, train=True)
    train.set_defaults(handler=cmd_detect_train)

    _eval_parser(sub, "COCO box (and mask) mAP of a checkpoint on its or other validation data", cmd_detect_eval,
                 lambda evaluate: _coco_options(evaluate, train=False))

    predict = sub.add_parser("predict", help="draw a checkpoint's boxes and masks on images (PNG)")
    predict.add_argument("--checkpoint", required=True, metavar="FILE")
    predict.add_argument("images", nargs="+", metavar="IMAGE")
    predict.add_argument("--out", default="predictions", metavar="DIR", help="output folder (default: %(default)s)")
    predict.add_argument("--score-threshold", type=float, default=0.5, help="draw detections at least this sure")
    predict.add_argument("--device", default="auto")
    add_overwrite(predict, "drawings in --out")
    predict.set_defaults(handler=cmd_detect_predict)

    sub, train = _task_group(
        commands, "segment", "segmenter",
        "semantic segmentation with smp decoders (FPN, UPerNet) on Pola encoders",
        "Semantic FPN and UPerNet from segmentation_models_pytorch, or LightHamHead, on a Pola encoder "
        "(docs/dense.md). Without --root: the embedded digit scenes.",
    )
    train.add_argument("--decoder", choices=("fpn", "upernet", "lightham"), help="model.decoder")
    train.add_argument("--root", metavar="DIR",
                       help="ADE20K-layout folder (images/ and annotations/, training and validation)")
    train.add_argument("--num-classes", type=positive_int, help="ADE layout: number of classes (data.num_classes, 150)")
    train.add_argument("--crop-size", type=positive_int, help="ADE layout: training crop (data.crop_size, 512)")
    train.set_defaults(handler=cmd_segment_train)

    _eval_parser(sub, "mIoU of a checkpoint on its or another validation folder", cmd_segment_eval,
                 lambda evaluate: evaluate.add_argument("--root", metavar="DIR",
                                                        help="ADE20K-layout folder to score instead of the recipe's"))


def _train(task: str, args, extra_model: dict, extra_data: dict, ade_options: dict | None = None) -> int:
    from ..tasks.dense.config import load_recipe
    from ..tasks.dense.runner import train_task

    overrides = {
        **flag_values("dense train", args),
        "model.backbone_kwargs": dict(args.backbone_kwargs) if args.backbone_kwargs else None,
        **{f"model.{k}": v for k, v in extra_model.items()}, **{f"data.{k}": v for k, v in extra_data.items()},
    }
    recipe = load_recipe(task, args.config, overrides, opts=args.opts)
    ignored = [flag for flag, value in (ade_options or {}).items() if value is not None]
    if ignored and recipe["data"]["format"] != "ade":  # the digit scenes have their own classes and crops
        return usage_error(f"{task} train", f"{ignored[0]} needs --root DIR (it applies to ADE20K-layout folders)")
    output = Path(args.output or f"runs/{task}/{recipe['model']['backbone']}")
    summary = train_task(task, recipe, output, progress=not args.no_progress, **run_options(args))
    print_summary(json.dumps({**summary, "output": str(output)}))
    return 0


def cmd_detect_train(args) -> int:
    coco = {k: getattr(args, k) for k in ("train_images", "train_annotations", "val_images", "val_annotations")}
    data = dict(coco, format="coco") if any(coco.values()) else {}
    return _train("detect", args, {"detector": args.detector}, data)


def cmd_segment_train(args) -> int:
    data = {"root": args.root, "format": "ade" if args.root else None, "num_classes": args.num_classes,
            "crop_size": args.crop_size}
    return _train("segment", args, {"decoder": args.decoder}, data,
                  {"--num-classes": args.num_classes, "--crop-size": args.crop_size})


def cmd_detect_eval(args) -> int:
    from ..tasks.dense.runner import evaluate_checkpoint

    coco = {"val_images": args.val_images, "val_annotations": args.val_annotations}
    data = {**coco, "val_size": args.val_size}
    if any(coco.values()):
        data["format"] = "coco"
    print(json.dumps(evaluate_checkpoint("detect", args.checkpoint, data, args.device)))
    return 0


def cmd_segment_eval(args) -> int:
    from ..tasks.dense.runner import evaluate_checkpoint

    data = {"root": args.root, "format": "ade" if args.root else None, "val_size": args.val_size}
    print(json.dumps(evaluate_checkpoint("segment", args.checkpoint, data, args.device)))
    return 0


def cmd_detect_predict(args) -> int:
    from ..tasks.dense.runner import predict_images

    for path in predict_images(args.checkpoint, args.images, Path(args.out), score_threshold=args.score_threshold,
                               device=args.device, overwrite=args.overwrite):
        print(path)
    return 0
