"""The one way the package opens a file it reads (a regular file only, of a bounded size) and writes one (whole).

Opening a FIFO for reading blocks until a writer appears (forever, for a user who passed one by mistake); a
character device such as ``/dev/zero`` never ends; a socket cannot be opened at all. :func:`open_regular` opens
without blocking, checks what the descriptor is, and refuses all of these in one line, as it refuses a file
larger than its reader's cap (a "bomb": a config of gigabytes, a checkpoint larger than the memory it must be
read into). :func:`read_image` adds the image decoder's own bomb check (PIL's pixel limit) in the same words.

Every reader of the package goes through here: configuration files, checkpoints (``torch.load`` and
safetensors), images (data folders, ``analyze``, ``detect predict``, ``sr``), annotation and data files.
Every file the package writes goes through :func:`atomic_write` (a command's outputs through
:mod:`polaformer.engine.output`, which claims them first): a reader, or a crash at any moment, sees the old file or
the new one whole, and a full disk is one :class:`WriteError` line.
"""
from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable

__all__ = ["MAX_CONFIG_BYTES", "MAX_IMAGE_BYTES", "UnreadableFileError", "WriteError", "atomic_write", "open_regular",
           "read_bytes", "read_image", "read_image_or_raise", "read_text"]

MAX_CONFIG_BYTES = 16 * 2**20  # a configuration or annotation list written by hand is far smaller
MAX_IMAGE_BYTES = 2**30  # an encoded image; its decoded pixels are capped by PIL's MAX_IMAGE_PIXELS

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class UnreadableFileError(ValueError):
    """A file the package refuses to read: not a regular file, too large, or not decodable (one line)."""

    def __init__(self, path, reason: str, detail: str | None = None):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason
        self.detail = detail or reason  # the reason without the reader's words around it


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _size(count: int) -> str:
    return f"{count / 2**30:.3g} GiB" if count >= 2**30 else f"{count / 2**20:.3g} MiB"


def open_regular(path: str | os.PathLike, limit: int | None = None) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file of at most ``limit`` bytes.

    A missing file raises :class:`FileNotFoundError` (callers name it in their own words); anything else that
    is not a readable regular file raises :class:`UnreadableFileError`. The open itself never blocks (O_NONBLOCK,
    which regular files ignore), so a FIFO is refused instead of waited on.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:  # a socket (ENXIO), no permission, a name too long...
        if os.path.exists(path) and not os.path.isfile(path):
            raise UnreadableFileError(path, f"{_kind(os.stat(path).st_mode)}, not a regular file") from None
        raise UnreadableFileError(path, (e.strerror or str(e)).lower()) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFileError(path, f"{_kind(info.st_mode)}, not a regular file")
        if limit is not None and info.st_size > limit:
            raise UnreadableFileError(path, f"{_size(info.st_size)}, more than the {_size(limit)} this reads")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, limit: int | None = MAX_CONFIG_BYTES) -> bytes:
    with open_regular(path, limit) as f:
        return f.read()


def read_text(path: str | os.PathLike, limit: int | None = MAX_CONFIG_BYTES, encoding: str = "utf-8") -> str:
    """The file decoded as ``encoding`` (``UnicodeDecodeError`` names the first bad byte)."""
    return read_bytes(path, limit).decode(encoding)


def read_image(path: str | os.PathLike, limit: int = MAX_IMAGE_BYTES):
    """The image at ``path`` as a decoded PIL image (pixels loaded, the file closed).

    PIL refuses images of more than ``2 * Image.MAX_IMAGE_PIXELS`` pixels (a few hundred bytes of PNG can
    declare 40000x40000); that, undecodable data and truncated files raise :class:`UnreadableFileError`
    ``PATH: cannot read the image (REASON)``.
    """
    from PIL import Image, UnidentifiedImageError

    with open_regular(path, limit) as f:
        try:
            image = Image.open(f)
            image.load()
        except UnidentifiedImageError:  # its message names the file object, not the file
            detail = "not an image format PIL knows"
            raise UnreadableFileError(path, f"cannot read the image ({detail})", detail) from None
        except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnreadableFileError(path, f"cannot read the image ({detail})", detail) from None
    return image


def read_image_or_raise(path: str | os.PathLike, error: type[Exception]):
    """:func:`read_image`, a missing or unreadable file raised as ``error("cannot read image PATH: WHY")``, the
    one line of the command that asked for it."""
    try:
        return read_image(path)
    except FileNotFoundError:
        raise error(f"cannot read image {path}: no such file") from None
    except UnreadableFileError as e:
        raise error(f"cannot read image {path}: {e.detail}") from None


# --- writing files ---------------------------------------------------------------------------

class WriteError(OSError):
    """A file could not be written (full disk, no permission); the previous file is unchanged (one line)."""

    def __init__(self, path, error: OSError):
        super().__init__(error.errno, f"cannot write {path}: {(error.strerror or str(error)).lower()} "
                                      "(any previous version of the file is unchanged)")

    def __str__(self) -> str:
        return self.strerror


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it over ``path``.

    Readers (and a crash at any moment) see either the old complete file or the new complete
    one, never a half-written one. The temporary file lives in the same folder because
    ``os.replace`` is only atomic within one file system; it is removed if ``write`` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        f = open(tmp, "xb")
    except OSError as e:
        raise WriteError(path, e) from e
    recording = _RecordingFile(f)
    try:
        with f:
            write(recording)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        interrupt = _interrupt_behind(e)
        if interrupt is not None and interrupt is not e:
            # Ctrl-C inside torch's zip writer: its cleanup fails ("unexpected pos") and would hide the interrupt
            raise interrupt from None
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(path, e) from e
        if recording.error is not None and isinstance(e, Exception):  # a writer turned it into its own error
            raise WriteError(path, recording.error) from e
        raise
    _fsync_dir(path.parent)
    return path


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt ``error`` is, or was raised while handling, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _RecordingFile:
    """The temporary file, remembering a failed write: torch's zip writer reports a full disk met after its
    first record as ``RuntimeError: ... unexpected pos``, and the reason would be lost."""

    def __init__(self, f: BinaryIO):
        self._file, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a folder be opened for this.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
