"""What every ``polaformer`` subcommand shares: one-line errors, exit statuses, option types."""
from __future__ import annotations

import argparse
import os
import sys

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
