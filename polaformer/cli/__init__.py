"""The ``polaformer`` command: one module per task, each adding its subcommands to one parser.

- :mod:`.classification`: ``train`` a model, ``eval`` a checkpoint, ``throughput``, ``analyze``,
  ``export`` to ONNX;
- :mod:`.ablate`: ``ablate`` (paper Table 3's component ablations, several seeds, table and chart);
- :mod:`.bench`: ``bench`` (the attention op and model benchmarks);
- :mod:`.data`: ``data shard`` (an image folder as WebDataset tar shards);
- :mod:`.lra`: ``lra train|eval|generate|curves|bench`` (the Long Range Arena);
- :mod:`.dense`: ``detect train|eval|predict`` and ``segment train|eval``;
- :mod:`.lm`: ``lm train|eval|sample`` (causal byte-level language models);
- :mod:`.sr`: ``sr train|eval|upscale`` (super-resolution);
- :mod:`.diffusion`: ``diffusion train|sample|fid`` (class-conditional PolaDiT);
- :mod:`.checkpoint`: ``checkpoint consolidate`` (a sharded checkpoint as one file).
- :mod:`.convert`: ``convert weights|train|demo`` (trained softmax models into Pola).

Dependencies point one way: this package -> the tasks -> the engine. Every user error (a bad option,
a missing or foreign checkpoint, an unknown model) and every environmental fault (a full disk, a busy
output folder, a diverged training) ends the command with exit status 2 and a single
``polaformer...: error: ...`` line on stderr of at most MAX_MESSAGE characters; Ctrl-C ends it with
status 130 and one line. docs/errors.md lists the cases.
"""
from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from .._startup import raise_on_interrupt
from ..runtime import tune_cpu_allocator
from .ablate import add_ablate_parser
from .bench import add_bench_parser
from .checkpoint import add_checkpoint_parser
from .classification import add_classification_parsers
from .common import INTERRUPTED, MAX_MESSAGE, OneLineParser, one_line, usage_error
from .convert import add_convert_parser
from .data import add_data_parser
from .dense import add_dense_parsers
from .diffusion import add_diffusion_parser
from .lm import add_lm_parser
from .lra import add_lra_parser
from .sr import add_sr_parser

__all__ = ["MAX_MESSAGE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="polaformer", description="Train and evaluate PolaFormer models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_classification_parsers(commands)
    add_ablate_parser(commands)
    add_bench_parser(commands)
    add_data_parser(commands)
    add_lra_parser(commands)
    add_dense_parsers(commands)
    add_lm_parser(commands)
    add_sr_parser(commands)
    add_diffusion_parser(commands)
    add_checkpoint_parser(commands)
    add_convert_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The parser imports no torch, timm or model, so --help and argument errors answer at once. Under the
    # `polaformer` command the start-up's Ctrl-C handler (_startup.interrupt_exits) is still in place while the
    # runtime is imported below: an interrupt there ends the command in one line.
    args = build_parser().parse_args(argv)
    errors = _user_errors()
    raise_on_interrupt()  # the command has started: an interrupt now may have a checkpoint to name
    from ..engine.output import forget_made_folders, remove_empty_made_folders

    tune_cpu_allocator()  # reuse freed large CPU buffers instead of page-faulting them in again
    forget_made_folders()
    code = 1
    try:
        code = _run(args, errors)
        return code
    finally:
        if code != 0:  # a failed command leaves no empty output folder behind
            remove_empty_made_folders()


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors every command reports in one line with status 2. Importing them imports torch, timm and the
    models, what every command runs on; the last, FloatingPointError, is an op's refused overflow."""
    from ..data import UnknownDatasetError
    from ..data.folder import DatasetError
    from ..engine import CheckpointError, ConfigError, ModelBuildError, TrainingDivergedError
    from ..files import UnreadableFileError, WriteError
    from ..tasks.classification.evaluation import EvalError

    return (CheckpointError, ModelBuildError, UnknownDatasetError, ConfigError, DatasetError, EvalError,
            UnreadableFileError, WriteError, TrainingDivergedError, FloatingPointError)


def _run(args, errors: tuple[type[Exception], ...]) -> int:
    from ..engine import TrainingInterrupted

    with _log_to_stderr():
        try:
            return args.handler(args)
        except errors as e:
            return usage_error(getattr(args, "error_command", None), str(e))
        except OSError as e:  # the environment: a full disk, a file that cannot be written or read
            where = f": {e.filename}" if e.filename else ""
            return usage_error(None, f"{(e.strerror or str(e)).lower()}{where}")
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
