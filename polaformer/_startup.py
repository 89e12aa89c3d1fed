"""Ctrl-C while the ``polaformer`` command starts: status 130 and one line, not an import traceback.

Standard library only: it runs before torch is imported, which takes seconds. Once the command's
``main`` runs, :func:`polaformer.cli.main` reports an interrupt itself (naming the last checkpoint).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def is_command_line() -> bool:
    """Whether this process is the ``polaformer`` command importing the package: ``python -m polaformer``
    (Python sets ``sys.argv[0]`` to ``-m`` while it imports the package to run) or the console script."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) == "polaformer"


def prepare_environment(argv: list[str]) -> None:
    """What must be in the environment before torch is imported. ``bench gpu --smoke`` runs the Triton kernels in
    Triton's interpreter, which triton reads when it is imported (torch imports it), so the command sets
    ``TRITON_INTERPRET=1`` here, called by the package's ``__init__`` before it imports torch; a value the user
    set is kept."""
    words = [word for word in argv if not word.startswith("-")]
    if words[:2] == ["bench", "gpu"] and "--smoke" in argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@contextmanager
def interrupt_exits(command: bool):
    """Inside, Ctrl-C ends the process with status 130 and one line when ``command``; else it propagates."""
    try:
        yield
    except KeyboardInterrupt:
        if not command:
            raise
        print("polaformer: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
