"""The ``polaformer`` command: ``train`` a model and ``eval`` a checkpoint.

Every user error (a bad option, a missing or foreign checkpoint, an unknown model) ends the
command with exit status 2 and a single ``polaformer...: error: ...`` line on stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import yaml

from .data import DATASETS, DEFAULT_DATA, UnknownDatasetError
from .engine import (
    DEFAULT_MODEL,
    CheckpointError,
    ModelBuildError,
    evaluate_checkpoint,
    make_config,
    run_training,
)

USAGE_ERROR = 2  # argparse's exit status for bad usage; checkpoint errors use it too


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the whole usage first)."""

    def __init__(self, *args, **kwargs):
        # No abbreviations: `--epoch 3` silently meaning `--epochs 3` hides typos in scripts.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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
        return key, yaml.safe_load(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"cannot read the value of {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="polaformer", description="Train and evaluate PolaFormer models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Options default to None so that make_config can tell "not given" from a preset's value.
    train = commands.add_parser("train", help="train a model; writes checkpoint.pth and metrics.json")
    train.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME", help="timm model name (default: %(default)s)")
    train.add_argument(
        "--model-kwarg", dest="model_kwargs", action="append", type=parse_model_kwarg, metavar="KEY=VALUE",
        help="extra keyword argument for timm.create_model; repeatable (e.g. --model-kwarg depth=2)",
    )
    train.add_argument("--data", choices=sorted(DATASETS), default=DEFAULT_DATA, help="data set (default: %(default)s)")
    train.add_argument("--epochs", type=positive_int, metavar="N", help="number of epochs")
    train.add_argument("--batch-size", type=positive_int, metavar="B", help="training batch size")
    train.add_argument("--lr", type=float, metavar="LR", help="peak learning rate (AdamW)")
    train.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    train.add_argument("--warmup-epochs", type=int, help="linear warm-up length, in epochs")
    train.add_argument("--label-smoothing", type=float, help="label smoothing of the training loss")
    train.add_argument("--clip-grad", type=float, help="max gradient norm (0 disables clipping)")
    train.add_argument("--augment", action=argparse.BooleanOptionalAction, help="random ±1 pixel shifts")
    train.add_argument("--seed", type=int, metavar="S", help="seed for initialisation, shuffling and augmentation")
    train.add_argument("--device", help="'cpu', 'cuda', ... (default: cuda if available)")
    train.add_argument("--output", metavar="DIR", help="output folder (default: runs/digits)")
    train.set_defaults(handler=cmd_train)

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on the test split")
    evaluate.add_argument("--checkpoint", required=True, metavar="FILE", help="checkpoint written by 'train'")
    evaluate.add_argument(
        "--data", choices=sorted(DATASETS), help="data set (default: the one the checkpoint was trained on)"
    )
    evaluate.add_argument("--model", metavar="NAME", help="refuse a checkpoint of any other architecture")
    evaluate.add_argument("--device", default="auto", help="'cpu', 'cuda', ... (default: cuda if available)")
    evaluate.set_defaults(handler=cmd_eval)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    overrides = {
        key: value
        for key, value in vars(args).items()
        if key not in ("command", "handler", "model", "data", "model_kwargs")
    }
    config = make_config(args.model, args.data, model_kwargs=dict(args.model_kwargs or []), **overrides)
    metrics = run_training(config)
    print(
        f"final test top-1: {metrics['final_test_top1']:.2f}% "
        f"(epochs={config.epochs}, time={metrics['wall_time_s']:.1f}s) -> {metrics['checkpoint']}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    metrics, checkpoint = evaluate_checkpoint(args.checkpoint, data=args.data, arch=args.model, device=args.device)
    print(
        f"test top-1: {metrics['top1']:.2f}% (top-5: {metrics['top5']:.2f}%, loss: {metrics['loss']:.4f}; "
        f"{checkpoint['arch']}, epoch {checkpoint.get('epoch', '?')}) <- {args.checkpoint}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _log_to_stderr():
        try:
            return args.handler(args)
        except (CheckpointError, ModelBuildError, UnknownDatasetError) as e:
            print(f"polaformer: error: {e}", file=sys.stderr)
            return USAGE_ERROR


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
