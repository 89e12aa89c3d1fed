"""What every ``polaformer`` subcommand shares: one-line errors, exit statuses, option types, and the options that set
configuration keys: each training command's own (:data:`FLAG_KEYS`) and the engine options, every ``train``
command's flags read from their one declaration (:mod:`polaformer.engine.options`)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import yaml

from .._startup import INTERRUPTED  # noqa: F401  (the status of Ctrl-C, before and after main starts)
from ..engine.config import load_yaml
from ..engine.options import Option, keyed_values, options_of

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



# Each training command's own options and the configuration keys they set (option dest -> dotted key):
# classification's keys are yacs-style (configs/), the others lower case. Its engine options come from their
# declarations (TRAIN_TASKS names the configuration each command's options are keys of).
FLAG_KEYS = {
    "train": {
        "model": "MODEL.NAME", "data": "DATA.DATASET", "data_path": "DATA.DATA_PATH",
        "label_smoothing": "MODEL.LABEL_SMOOTHING", "augment": "AUG.DIGITS_SHIFT", "device": "DEVICE",
        "output": "OUTPUT",
    },
    "lra train": {
        "eval_batches": "train.eval_batches", "limit_train": "train.limit_train", "limit_dev": "train.limit_dev",
        "limit_test": "train.limit_test",
    },
    "lm train": {
        "model": "model.name", "attention": "model.attention", "context": "model.context",
        "max_bytes": "data.max_bytes",
    },
    "sr train": {
        "scale": "model.scale", "train_hr": "data.train_hr", "train_lr": "data.train_lr", "valid_hr": "data.valid_hr",
        "valid_lr": "data.valid_lr", "patch_size": "data.patch_size",
    },
    "dense train": {  # detect train and segment train
        "backbone": "model.backbone", "backbone_weights": "model.backbone_weights", "train_size": "data.train_size",
        "val_size": "data.val_size",
    },
    "convert train": {
        "stage": "stage", "source": "model.source", "teacher": "model.teacher", "target": "model.target",
        "init": "init", "data": "data.name", "data_path": "data.path", "pretrained": "model.pretrained",
        "lora": "finetune.lora", "attention_weight": "transfer.attention_weight",
    },
    "diffusion train": {
        "model": "model.name", "attention": "model.attention", "data": "data.name", "image_size": "data.image_size",
        "channels": "data.channels",
    },
}
# the task (polaformer.engine.options) whose configuration each training command sets
TRAIN_TASKS = {"train": "classification", "lra train": "lra", "lm train": "lm", "sr train": "sr",
               "dense train": "dense", "convert train": "convert", "diffusion train": "diffusion"}


def option_values(command: str, args: argparse.Namespace) -> dict[str, object]:
    """``{option name: value}`` of the engine options of ``command`` given on the command line."""
    return {option.name: getattr(args, option.name) for option in options_of(TRAIN_TASKS[command])
            if getattr(args, option.name, None) is not None}


def flag_values(command: str, args: argparse.Namespace) -> dict[str, object]:
    """``{config key: value}`` of the options of ``command`` (its own, :data:`FLAG_KEYS`, and its engine options)
    given on the command line."""
    own = {key: getattr(args, flag) for flag, key in FLAG_KEYS[command].items() if getattr(args, flag) is not None}
    return {**own, **dict(keyed_values(TRAIN_TASKS[command], option_values(command, args)))}


def set_flags(cfg, command: str, args: argparse.Namespace) -> None:
    """Set the config key of every option of ``command`` given, naming the option in any error."""
    for flag, key in FLAG_KEYS[command].items():
        if getattr(args, flag) is not None:
            cfg.set_path(key, getattr(args, flag), source=f"--{flag.replace('_', '-')}")
    for name, value in option_values(command, args).items():
        for key, setting in keyed_values(TRAIN_TASKS[command], {name: value}):
            cfg.set_path(key, setting, source=f"--{name.replace('_', '-')}")


def _parse_as(option: Option, task: str):
    """The argparse type of a number ``option``: text that is no number of its kind is refused at once, in the words
    of its range; the range itself is checked with the configuration, once, naming the key
    (:func:`polaformer.engine.options.check_options`)."""
    rule = option.rule(task)

    def parse(text: str):
        try:
            if option.kind is int or (option.kind == "number" and re.fullmatch(r"[+-]?\d+", text.strip())):
                return int(text)
            return float(text)
        except ValueError:
            what = rule.but(optional=False, note="").describe() if rule is not None else (
                f"be {'an integer' if option.kind is int else 'a number'}")
            raise argparse.ArgumentTypeError(f"must {what}, got {text!r}") from None

    return parse


def _parse_switch(text: str):
    """A setting that is off (``false``, ``null``), on (``true``) or a name (``torch.compile``'s backend)."""
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        return text
    return False if value is None else value


def add_engine_options(parser: argparse.ArgumentParser, command: str) -> None:
    """A flag for every engine option of ``command``'s task, from its declaration: its type (or choices) and help
    text ending with the configuration key it sets. Each defaults to None (the configuration's value)."""
    task = TRAIN_TASKS[command]
    for option in options_of(task):
        flags = option.flags or ("--" + option.name.replace("_", "-"),)
        kwargs: dict = {"dest": option.name, "default": None, "help": f"{option.help} ({option.key(task)})"}
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.choices:
            kwargs["choices"] = option.choices
        elif option.kind == "any":
            kwargs.update(type=_parse_switch, nargs="?", const=True, metavar=option.metavar)
        elif option.kind is str:
            kwargs["metavar"] = option.metavar
        else:
            kwargs.update(type=_parse_as(option, task), metavar=option.metavar)
        parser.add_argument(*flags, **kwargs)


def add_command_group(commands, name: str, help: str, description: str, **defaults):
    """The command ``polaformer NAME COMMAND ...`` (its subcommands added to what this returns); ``defaults``:
    values its every subcommand's arguments hold (``error_command``: the command its errors name)."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.set_defaults(**defaults)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


# What the options of several train commands that are not engine options mean: dest -> (type, meaning); FLAG_KEYS
# names the key each sets, which its help text ends with.
TRAIN_FLAG_MEANINGS = {
    "eval_batches": (int, "validation batches per evaluation, 0 = all"),
}


def add_train_options(parser: argparse.ArgumentParser, command: str, own=(), *, output: str,
                      opts_example: str) -> None:
    """The options of the step-based ``train`` subcommand ``command`` after those it adds itself: its own, in the
    order of ``FLAG_KEYS[command]`` (each its ``own`` ``(dest, type, meaning)`` row or else its row of
    :data:`TRAIN_FLAG_MEANINGS`, the help text ending with its key), its engine options (:func:`add_engine_options`);
    then ``--opts``, ``--output`` (default: ``output``), ``--resume``, ``--allow-changed``, ``--overwrite`` and
    ``--device``, which :func:`run_options` hands on."""
    keys = FLAG_KEYS[command]
    rows = {**TRAIN_FLAG_MEANINGS, **{dest: (kind, meaning) for dest, kind, meaning in own}}
    for dest, key in keys.items():
        if dest in rows:
            kind, meaning = rows[dest]
            parser.add_argument("--" + dest.replace("_", "-"), type=kind, help=f"{meaning} ({key})")
    add_engine_options(parser, command)
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
