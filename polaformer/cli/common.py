"""What every ``polaformer`` subcommand shares: one-line errors, exit statuses, option types, and the table of the
options that set configuration keys."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from .._startup import INTERRUPTED  # noqa: F401  (the status of Ctrl-C, before and after main starts)
from ..engine.config import load_yaml

USAGE_ERROR = 2  # argparse's exit status for bad usage; checkpoint errors use it too
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

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        self._refuse_empty_values(namespace)
        return namespace, extras

    def _refuse_empty_values(self, namespace) -> None:
        """An empty value given to an option (or argument) that names something (a model, a folder, a file) names
        nothing: ``--model ''`` and ``--output ''`` fell back to the defaults without a word. Options whose own
        default is the empty string take it; lists (``--opts``) are their commands' to read."""
        for action in self._actions:
            if action.type is not None or action.nargs not in (None, "?") or action.default == "":
                continue
            value = getattr(namespace, action.dest, None)
            if value == "" or (isinstance(value, list) and "" in value):
                name = "/".join(action.option_strings) or action.dest
                what = action.metavar or "a value"
                leave_out = ", or leave the option out" if action.option_strings else ""
                self.error(f"argument {name}: got an empty value (give {what}{leave_out})")


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



# The options of each training command and the configuration keys they set (option dest -> dotted key):
# classification's keys are yacs-style (configs/), the step-based tasks' lower case.
FLAG_KEYS = {
    "train": {
        "model": "MODEL.NAME", "data": "DATA.DATASET", "data_path": "DATA.DATA_PATH", "epochs": "TRAIN.EPOCHS",
        "batch_size": "DATA.BATCH_SIZE", "lr": "TRAIN.BASE_LR", "weight_decay": "TRAIN.WEIGHT_DECAY",
        "warmup_epochs": "TRAIN.WARMUP_EPOCHS", "label_smoothing": "MODEL.LABEL_SMOOTHING",
        "clip_grad": "TRAIN.CLIP_GRAD", "augment": "AUG.DIGITS_SHIFT", "seed": "SEED", "device": "DEVICE",
        "output": "OUTPUT",
    },
    "lra train": {
        "steps": "train.steps", "batch_size": "train.batch_size", "lr": "train.lr",
        "warmup_steps": "train.warmup_steps", "eval_every": "train.eval_every", "eval_batches": "train.eval_batches",
        "save_every": "train.save_every", "seed": "train.seed", "workers": "train.num_workers",
        "limit_train": "train.limit_train", "limit_dev": "train.limit_dev", "limit_test": "train.limit_test",
        "amp": "train.amp",
    },
    "lm train": {
        "model": "model.name", "attention": "model.attention", "context": "model.context", "steps": "train.steps",
        "batch_size": "train.batch_size", "lr": "train.lr", "eval_every": "train.eval_every",
        "max_bytes": "data.max_bytes", "seed": "train.seed",
    },
    "sr train": {
        "scale": "model.scale", "train_hr": "data.train_hr", "train_lr": "data.train_lr", "valid_hr": "data.valid_hr",
        "valid_lr": "data.valid_lr", "patch_size": "data.patch_size", "steps": "train.steps",
        "batch_size": "train.batch_size", "lr": "train.lr", "eval_every": "train.eval_every", "seed": "train.seed",
    },
    "dense train": {  # detect train and segment train
        "backbone": "model.backbone", "backbone_weights": "model.backbone_weights", "steps": "train.steps",
        "epochs": "train.epochs", "batch_size": "data.batch_size", "lr": "train.lr",
        "weight_decay": "train.weight_decay", "warmup_steps": "train.warmup_steps", "eval_every": "train.eval_every",
        "save_every": "train.save_every", "seed": "train.seed", "workers": "data.workers",
        "train_size": "data.train_size", "val_size": "data.val_size",
    },
    "convert train": {
        "stage": "stage", "source": "model.source", "teacher": "model.teacher", "target": "model.target",
        "init": "init", "data": "data.name", "data_path": "data.path", "pretrained": "model.pretrained",
        "lora": "finetune.lora", "attention_weight": "transfer.attention_weight", "steps": "train.steps",
        "batch_size": "train.batch_size", "lr": "train.lr", "eval_every": "train.eval_every", "seed": "train.seed",
    },
    "diffusion train": {
        "model": "model.name", "attention": "model.attention", "data": "data.name", "image_size": "data.image_size",
        "channels": "data.channels", "steps": "train.steps", "batch_size": "train.batch_size", "lr": "train.lr",
        "eval_every": "train.eval_every", "seed": "train.seed",
    },
}


def flag_values(command: str, args: argparse.Namespace) -> dict[str, object]:
    """``{config key: value}`` of the options of ``command`` (:data:`FLAG_KEYS`) given on the command line."""
    return {key: getattr(args, flag) for flag, key in FLAG_KEYS[command].items() if getattr(args, flag) is not None}


def set_flags(cfg, command: str, args: argparse.Namespace) -> None:
    """Set the config key of every option of ``command`` given, naming the option in any error."""
    for flag, key in FLAG_KEYS[command].items():
        if getattr(args, flag) is not None:
            cfg.set_path(key, getattr(args, flag), source=f"--{flag.replace('_', '-')}")


def add_command_group(commands, name: str, help: str, description: str, **defaults):
    """The command ``polaformer NAME COMMAND ...`` (its subcommands added to what this returns); ``defaults``:
    values its every subcommand's arguments hold (``error_command``: the command its errors name)."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.set_defaults(**defaults)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


# What the options several step-based train commands share mean: dest -> (type, meaning); FLAG_KEYS names the key
# each sets, which its help text ends with.
TRAIN_FLAG_MEANINGS = {
    "steps": (positive_int, "optimizer steps"),
    "epochs": (float, "epochs"),
    "batch_size": (positive_int, "examples per optimizer step"),
    "lr": (float, "peak learning rate"),
    "weight_decay": (float, "AdamW weight decay"),
    "warmup_steps": (int, "warm-up steps"),
    "eval_every": (positive_int, "evaluate every N steps"),
    "eval_batches": (int, "validation batches per evaluation, 0 = all"),
    "save_every": (positive_int, "also write last.pth every N steps"),
    "seed": (int, "seed of initialisation and data order"),
    "workers": (int, "data loading processes"),
}


def add_train_options(parser: argparse.ArgumentParser, command: str, own=(), *, output: str,
                      opts_example: str) -> None:
    """The options of the step-based ``train`` subcommand ``command`` after those it adds itself, in the order of
    ``FLAG_KEYS[command]``: each its ``own`` ``(dest, type, meaning)`` row or else its row of
    :data:`TRAIN_FLAG_MEANINGS`, the help text ending with its key; then ``--opts``, ``--output`` (default:
    ``output``), ``--resume``, ``--allow-changed``, ``--overwrite`` and ``--device``, which :func:`run_options`
    hands on."""
    keys = FLAG_KEYS[command]
    rows = {**TRAIN_FLAG_MEANINGS, **{dest: (kind, meaning) for dest, kind, meaning in own}}
    for dest, key in keys.items():
        if dest in rows:
            kind, meaning = rows[dest]
            parser.add_argument("--" + dest.replace("_", "-"), type=kind, help=f"{meaning} ({key})")
    parser.add_argument("--opts", nargs="+", default=[], metavar="KEY VALUE",
                        help=f"override any config key, e.g. --opts {opts_example}")
    parser.add_argument("--output", metavar="DIR", help=f"output folder (default: {output})")
    parser.add_argument("--resume", metavar="auto|FILE",
                        help="continue: 'auto' from OUTPUT/last.pth if present, or FILE")
    add_allow_changed(parser)
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an output folder that holds a run, replacing its files")
    parser.add_argument("--device", default="auto", help="'cpu', 'cuda', ... (default: cuda if available)")


def run_options(args: argparse.Namespace) -> dict[str, object]:
    """The options every training command passes its task's ``train_*`` function unchanged."""
    return {"resume": args.resume, "overwrite": args.overwrite, "device": args.device,
            "allow_changed": args.allow_changed}


def train_into(train, cfg, args: argparse.Namespace, default_output: str, *data) -> tuple[Path, dict]:
    """``train(cfg, *data, OUTPUT, **run_options(args))``, OUTPUT being ``--output`` or ``default_output``;
    returns OUTPUT and what ``train`` returned (the run's summary)."""
    output = Path(args.output or default_output)
    return output, train(cfg, *data, output, **run_options(args))


def add_allow_changed(parser: argparse.ArgumentParser) -> None:
    """``--allow-changed KEY ...`` of every training command (LoopSettings.allow_changed)."""
    parser.add_argument(
        "--allow-changed", nargs="+", default=[], metavar="KEY",
        help="with --resume: settings (dotted config keys, or a whole section) this run may change from the "
             "checkpoint's; any other difference is refused")


def add_overwrite(parser: argparse.ArgumentParser, what: str = "output files") -> None:
    """``--overwrite`` of every command that writes files (polaformer.engine.output.claim_outputs)."""
    parser.add_argument("--overwrite", action="store_true", help=f"replace existing {what} (refused otherwise)")


def usage_error(command: str | None, message: str) -> int:
    """Print ``polaformer COMMAND: error: MESSAGE`` on one line of stderr; returns the exit status."""
    prog = f"polaformer {command}" if command else "polaformer"
    print(one_line(f"{prog}: error: {message}"), file=sys.stderr)
    return USAGE_ERROR


def is_main_process() -> bool:
    """Rank 0 under torchrun (which sets RANK), or a plain process."""
    return os.environ.get("RANK", "0") == "0"


def print_summary(line: str) -> None:
    """A training command's one summary line on stdout, from rank 0 only (as its one metrics.json)."""
    if is_main_process():
        print(line)
