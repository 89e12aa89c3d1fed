"""Ctrl-C while the ``polaformer`` command starts: status 130 and one line, not an import traceback.

Standard library only: it runs before torch is imported, which takes seconds. Once the command's
``main`` runs, :func:`polaformer.cli.main` reports an interrupt itself (naming the last checkpoint).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
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


def _exit_at_once(signum, frame):
    os.write(2, b"polaformer: interrupted\n")
    os._exit(INTERRUPTED)


@contextmanager
def interrupt_exits(command: bool):
    """Inside, Ctrl-C ends the process with status 130 and one line when ``command``; else it propagates.

    For the command it ends the process at once, not by raising KeyboardInterrupt: raised inside an import, the
    interrupt can surface in C++ called through pybind11 (which aborts the process) or in class creation (a
    RuntimeError traceback), and while the command starts nothing has been written. :func:`raise_on_interrupt`
    hands Ctrl-C back to KeyboardInterrupt when the command's ``main`` starts."""
    installed = (command and threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if installed:
        signal.signal(signal.SIGINT, _exit_at_once)
    try:
        yield
    except KeyboardInterrupt:
        if not command:
            raise
        print("polaformer: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    finally:
        if installed:
            raise_on_interrupt()


def raise_on_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt again, as the command's ``main`` expects (it names the last checkpoint)."""
    if signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)
