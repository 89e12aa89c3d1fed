"""The text every Python ships with: the standard library's ``.py`` sources (and any ``.txt``/``.rst`` files
beside them), found through ``os.__file__``, cut into fixed-size blocks that a fixed seed deals into train and
validation, so both splits sample every part of the library alike."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["BLOCK_BYTES", "ByteWindows", "stdlib_corpus"]

SUFFIXES = (".py", ".txt", ".rst")
BLOCK_BYTES = 4096


def _stdlib_files() -> list[Path]:
    root = Path(os.__file__).resolve().parent
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]  # pruned, not walked and filtered
        files += [Path(folder, name) for name in names if name.endswith(SUFFIXES)]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int = 0, valid_fraction: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, valid)`` uint8 byte tensors.

    The files, in path order, are joined and cut into blocks of :data:`BLOCK_BYTES`; a permutation drawn from
    ``seed`` puts ``valid_fraction`` of the blocks in validation and the rest in training, each split keeping
    its blocks in permuted order. ``max_bytes`` > 0 keeps the first ``max_bytes`` of each split (for quick
    runs): still blocks from across the whole library, so the two splits stay alike."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0: all), got {max_bytes}")
    files = _stdlib_files()
    if not files:
        raise FileNotFoundError(f"no standard library files found under {Path(os.__file__).parent}")
    text = b"".join(path.read_bytes() for path in files)
    blocks = torch.frombuffer(bytearray(text[:len(text) // BLOCK_BYTES * BLOCK_BYTES]), dtype=torch.uint8)
    blocks = blocks.reshape(-1, BLOCK_BYTES)
    if len(blocks) < 2:
        raise ValueError(f"the standard library under {Path(os.__file__).parent} holds under two blocks of text")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    n_valid = min(len(blocks) - 1, max(1, round(len(blocks) * valid_fraction)))
    splits = []
    for part in (order[n_valid:], order[:n_valid]):
        if max_bytes:
            part = part[:-(-max_bytes // BLOCK_BYTES)]
        data = blocks[part].flatten()
        splits.append(data[:max_bytes] if max_bytes else data)
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
