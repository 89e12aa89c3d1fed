"""polaformer.files, the one opener of the package's readers: a regular file of a bounded size, or one line."""
import os
import socket
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from cli_helpers import within
from polaformer.files import UnreadableFileError, open_regular, read_image, read_text


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFileError, match=r"pipe: a FIFO \(named pipe\), not a regular file$"):
        within(30, fifo, lambda: read_text(fifo))


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/", "a folder")])
def test_devices_and_folders_are_refused(path, kind):
    if not os.path.exists(path):
        pytest.skip(f"no {path} here")
    with pytest.raises(UnreadableFileError, match=f"{kind}, not a regular file"):
        open_regular(path)


def test_a_socket_is_refused():
    with tempfile.TemporaryDirectory() as folder:  # a short path: socket names are limited to about 100 bytes
        path = Path(folder) / "s"
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(str(path))
            with pytest.raises(UnreadableFileError, match="a socket, not a regular file"):
                open_regular(path)
        finally:
            server.close()


def test_size_cap_and_a_missing_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"x" * 2048)
    assert read_text(big, 2048) == "x" * 2048
    with pytest.raises(UnreadableFileError, match="more than the"):
        read_text(big, 2047)
    with pytest.raises(FileNotFoundError):  # callers name a missing file in their own words
        open_regular(tmp_path / "absent")


def test_read_image_names_a_bomb_and_undecodable_data(tmp_path):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    with pytest.raises(UnreadableFileError, match=r"bomb.png: cannot read the image \(Image size \(1600000000 pixels"):
        read_image(bomb)
    text = tmp_path / "text.png"
    text.write_text("not an image")
    with pytest.raises(UnreadableFileError, match=r"cannot read the image \(not an image format PIL knows\)"):
        read_image(text)
    good = tmp_path / "good.png"
    Image.new("RGB", (3, 2), (1, 2, 3)).save(good)
    assert read_image(good).getpixel((2, 1)) == (1, 2, 3)


def test_atomic_write_lives_here_and_a_failed_write_keeps_the_old_file(tmp_path):
    """The one writer (issue 53 moved it here from polaformer.checkpoint, which re-exports it): a full disk is one
    WriteError line naming the file, and the previous file is untouched."""
    import errno

    import polaformer.checkpoint
    from polaformer.files import WriteError, atomic_write

    assert polaformer.checkpoint.atomic_write is atomic_write and polaformer.checkpoint.WriteError is WriteError
    target = tmp_path / "out.bin"
    atomic_write(target, lambda f: f.write(b"old"))

    def full_disk(f):
        f.write(b"new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError) as info:
        atomic_write(target, full_disk)
    assert str(info.value) == f"cannot write {target}: no space left on device (any previous version of the file " \
                              "is unchanged)"
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]
