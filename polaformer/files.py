"""The one way the package opens a file it reads: a regular file only, of a bounded size.

Opening a FIFO for reading blocks until a writer appears (forever, for a user who passed one by mistake); a
character device such as ``/dev/zero`` never ends; a socket cannot be opened at all. :func:`open_regular` opens
without blocking, checks what the descriptor is, and refuses all of these in one line, as it refuses a file
larger than its reader's cap (a "bomb": a config of gigabytes, a checkpoint larger than the memory it must be
read into). :func:`read_image` adds the image decoder's own bomb check (PIL's pixel limit) in the same words.

Every reader of the package goes through here: configuration files, checkpoints (``torch.load`` and
safetensors), images (data folders, ``analyze``, ``detect predict``, ``sr``), annotation and data files.
Files are written by :func:`polaformer.checkpoint.atomic_write` and, for a command's outputs,
:mod:`polaformer.engine.output`.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["MAX_CONFIG_BYTES", "MAX_IMAGE_BYTES", "UnreadableFileError", "open_regular", "read_bytes", "read_image",
           "read_image_or_raise", "read_text"]

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
