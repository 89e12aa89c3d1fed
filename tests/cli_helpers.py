"""What the CLI error tests share: running ``polaformer.cli.main`` in-process, the one-line error
check, snapshots that prove no existing file changed, and a deadline for calls that could block on a FIFO."""
import hashlib
import io
import os
import re
import threading
from pathlib import Path

import pytest

from polaformer.cli import MAX_MESSAGE, main

ERROR = re.compile(r"^polaformer( [\w-]+)*: (error|interrupted)")


class quiet:
    """Silence stdout/stderr of an in-process command that is expected to succeed."""

    def __enter__(self):
        import contextlib

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        self._stack.enter_context(contextlib.redirect_stderr(io.StringIO()))

    def __exit__(self, *exc):
        self._stack.close()


def snapshot(root: Path) -> dict:
    """Each file's digest, and each folder (``NAME/``)."""
    return {f"{p.relative_to(root)}/" if p.is_dir() else str(p.relative_to(root)):
            "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_dir() or p.is_file()}


def assert_unchanged(before: dict, root: Path) -> None:
    """No file or folder of ``before`` changed or removed, and no empty folder left by the failed command."""
    after = snapshot(root)
    changed = [name for name, digest in before.items() if after.get(name) != digest]
    assert not changed, f"existing files changed or removed: {changed}"
    left = [name for name in after if name not in before and name.endswith("/") and not any((root / name).iterdir())]
    assert not left, f"empty folders left behind: {left}"


def error_line(err: str, *, logs_allowed: bool = False) -> str:
    """The single error line of ``err``. Commands that fail mid-run have logged progress lines
    first (``logs_allowed``); the error is then the last line and the only one of its kind."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR.match(line)]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0] if logs_allowed else lines == errors, err
    assert len(errors[0]) <= MAX_MESSAGE
    return errors[0]


def run_main(argv, capsys):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def within(seconds: float, fifo, call):
    """``call()`` in a thread; if it still runs after ``seconds`` it is blocked on ``fifo``: a writer is opened to
    release it and the test fails."""
    result = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001  (reported below)
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # a reader is waiting: this succeeds and releases it
        os.close(fd)
        thread.join(30)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in result:
        raise result["error"]
    return result["value"]
