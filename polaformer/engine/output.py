"""The training output folder: one run at a time, and no finished run replaced by accident.

:class:`OutputLock` holds an exclusive ``fcntl.flock`` on ``OUTPUT/.polaformer.lock`` for the whole
run. The kernel drops the lock when its process dies, however it dies, so a killed run never
leaves the folder locked; the file holds the owner's pid for the error message of the next comer.
Creating the lock file is also the check that the folder is writable, before any epoch runs.
"""
from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError

LOCK_NAME = ".polaformer.lock"


class OutputLock:
    """An exclusive lock on an output folder (created if needed); :meth:`release` gives it back."""

    def __init__(self, folder: str | os.PathLike):
        import fcntl

        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the output folder {self.folder}: {_reason(e)}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(f"the output folder {self.folder} is not writable: {_reason(e)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_pid(fd)
                os.close(fd)
                who = f"process {owner}" if owner else "another process"
                raise ConfigError(
                    f"the output folder {self.folder} is in use by {who} (lock {self.path}); wait for that run "
                    "to end or choose another --output"
                ) from None
            # The previous owner may have removed the file between our open and our lock: then we
            # hold a lock on a file nobody else will see, and must try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:
            self.release()
            raise ConfigError(f"the output folder {self.folder} is not writable: {_reason(e)}") from None

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked: nobody else can hold this file
        os.close(self.fd)  # closing drops the lock
        self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _reason(error: OSError) -> str:
    return (error.strerror or str(error)).lower()
