"""The text every Python ships with: the standard library's ``.py`` sources (and any ``.txt``/``.rst`` files
beside them), found through ``os.__file__``, split by file with a fixed seed into train and validation bytes."""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["ByteWindows", "stdlib_corpus"]

SUFFIXES = (".py", ".txt", ".rst")


def _stdlib_files() -> list[Path]:
    root = Path(os.__file__).resolve().parent
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
    files = [p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()
             and not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int = 0, valid_fraction: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, valid)`` uint8 byte tensors: files shuffled by ``seed``, the first ``valid_fraction`` of
    them (by count) for validation; ``max_bytes`` > 0 caps each split (for quick runs)."""
    files = _stdlib_files()
    if not files:
        raise FileNotFoundError(f"no standard library files found under {Path(os.__file__).parent}")
    random.Random(seed).shuffle(files)
    n_valid = max(1, int(len(files) * valid_fraction))
    splits = []
    for part in (files[n_valid:], files[:n_valid]):
        chunks, size = [], 0
        for path in part:
            data = path.read_bytes()
            chunks.append(data)
            size += len(data)
            if max_bytes and size >= max_bytes:
                break
        joined = b"".join(chunks)
        splits.append(torch.frombuffer(bytearray(joined[:max_bytes] if max_bytes else joined), dtype=torch.uint8))
    return splits[0], splits[1]


class ByteWindows(Dataset):
    """Windows of ``length + 1`` bytes, the first ``length`` as input and the last ``length`` as target.

    ``stride`` (default ``length``) spaces the windows' starts."""

    def __init__(self, data: torch.Tensor, length: int, stride: int | None = None):
        if len(data) < length + 1:
            raise ValueError(f"{len(data)} bytes are fewer than one window of {length + 1}")
        self.data, self.length, self.stride = data, length, stride or length
        self.count = (len(data) - length - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        window = self.data[i * self.stride:i * self.stride + self.length + 1].long()
        return window[:-1], window[1:]
