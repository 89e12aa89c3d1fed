"""What commands write: no file replaced by accident, every file written whole.

:class:`OutputLock` holds an exclusive ``fcntl.flock`` on ``OUTPUT/.polaformer.lock`` for a training's
whole run. The kernel drops the lock when its process dies, however it dies, so a killed run never
leaves the folder locked; the file holds the owner's pid for the error message of the next comer.
Creating the lock file is also the check that the folder is writable, before any epoch runs.

The other commands' files (pictures, samples, exported models, tables, benchmark rows) go through
:func:`claim_outputs` before any work starts, then :func:`write_output`: a file that exists already is
refused in one line unless ``overwrite`` (``--overwrite``), several outputs that would share a name get
distinct ones (:func:`distinct_names`: ``x.png``, ``x-2.png``...), and each is written atomically
(:func:`polaformer.files.atomic_write`: a reader, or a crash, sees the old file or the new one whole).

Both make their folders through :func:`make_folder`, which records what it created: ``polaformer.cli.main``
removes those a failed command left empty (:func:`remove_empty_made_folders`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ..files import atomic_write
from .config import ConfigError

__all__ = ["LOCK_NAME", "OutputLock", "claim_outputs", "distinct_names", "forget_made_folders", "make_folder",
           "remove_empty_made_folders", "write_image", "write_output"]

LOCK_NAME = ".polaformer.lock"

_made: list[Path] = []  # the folders make_folder created since forget_made_folders


def make_folder(folder: Path) -> None:
    """``mkdir -p folder``, remembering the folders it created so that a command that fails can remove those it
    left empty (:func:`remove_empty_made_folders`)."""
    new = [f for f in (folder, *folder.parents) if not os.path.lexists(f)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output folder {folder}: {_reason(e)}") from None
    _made.extend(new)


def forget_made_folders() -> None:
    """Start a command's record of the folders it made."""
    _made.clear()


def remove_empty_made_folders() -> None:
    """Remove the folders made since :func:`forget_made_folders` that hold nothing, deepest first: a command that
    failed before writing leaves no empty output folder behind."""
    for folder in sorted(set(_made), key=lambda f: len(f.parts), reverse=True):
        try:
            folder.rmdir()  # refuses a folder that holds anything
        except OSError:
            pass
    _made.clear()


class OutputLock:
    """An exclusive lock on an output folder (created if needed, :func:`make_folder`); :meth:`release` gives it
    back."""

    def __init__(self, folder: str | os.PathLike):
        import fcntl

        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        make_folder(self.folder)
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


# --- the files of other commands -------------------------------------------------------------------

def distinct_names(stems: Iterable[str], folder: str | os.PathLike, suffix: str) -> list[Path]:
    """``folder/STEM{suffix}`` for each stem; a stem already used by an earlier one gets ``-2``, ``-3``... so that
    two inputs of the same name (``a/x.png b/x.png``) never write one output."""
    taken: set[str] = set()
    paths = []
    for stem in stems:
        name, copy = stem, 1
        while name in taken:
            copy += 1
            name = f"{stem}-{copy}"
        taken.add(name)
        paths.append(Path(folder) / f"{name}{suffix}")
    return paths


def claim_outputs(paths: Iterable[str | os.PathLike], overwrite: bool = False, option: str = "--output") -> list[Path]:
    """Check, before any work, that ``paths`` can be written: none is a folder, and none exists unless
    ``overwrite``; their folders are created. A refusal is one :class:`ConfigError` line naming the file and
    what to do (``option`` names the command's output option). Returns the paths."""
    paths = [Path(p) for p in paths]
    folders = [p for p in paths if p.is_dir()]
    if folders:
        raise ConfigError(f"{folders[0]} is a folder, not a file {option} can write")
    existing = [p for p in paths if os.path.lexists(p)]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise ConfigError(f"{existing[0]} already exists{more}: --overwrite replaces it, or choose another {option}")
    for folder in {p.parent for p in paths}:
        make_folder(folder)
    return paths


def write_output(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Write a claimed output atomically (``write`` gets the open temporary file)."""
    return atomic_write(path, write)


def write_image(path: str | os.PathLike, image) -> Path:
    """Write a PIL image (or an (H, W[, C]) uint8 array) atomically, in the format its suffix names."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    path = Path(path)
    kind = Image.registered_extensions().get(path.suffix.lower(), "PNG")
    return atomic_write(path, lambda f: image.save(f, format=kind))
