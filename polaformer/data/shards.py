"""Image classification data as tar shards in the WebDataset layout (what timm reads as ``wds/NAME``).

Layout (as timm's ``create_dataset("wds/...", root=DIR)``, ``--data-dir DIR``)::

    DIR/_info.json                      (or info.json) the splits: shard names and sample counts
    DIR/NAME-train-000000.tar ...       samples KEY.jpg (or .png, .webp, ...) + KEY.cls (the label, as text)
    DIR/NAME-validation-000000.tar ...

``_info.json`` holds ``{"splits": {"train": {"filenames": [...], "shard_lengths": [...], "num_samples": N},
"validation": {...}}}`` (timm's keys; a split called ``val`` is taken when there is no ``validation``), and, when
:func:`write_shards` wrote it, ``"classes"``: the class names in label order. The members of one sample lie
next to each other and share their name up to the first dot (the sample's key).

Nothing is scanned up front: the sample counts come from the info file, which is trusted (a shard holding
another number of samples than it says stops the run when it is read). The training split is streamed:

- every epoch the shards are shuffled with ``(seed, epoch)``, the same order on every process, and dealt out
  to the ``processes x loader workers`` readers in turn; each reader opens only its own shards, one at a time,
  and yields its samples in an order shuffled with ``(seed, epoch, shard)`` (a shard's undecoded samples are held
  in memory while it is read);
- every reader yields the same number of samples per epoch, ``Q``: the samples of the ``S // R`` smallest shards
  (``S`` shards, ``R`` readers: each reader is sure to hold that many), rounded down to whole batches. All
  processes thus take the same number of steps; the few samples beyond ``Q`` of a reader are left out of that
  epoch (others in the next). ``S < R`` is refused;
- resuming mid-epoch (the engine's ``set_start``) skips the batches already trained: whole shards by their
  counts, without reading them. With the same processes, batch size and ``DATA.NUM_WORKERS`` the run continues
  with exactly the samples that followed; with others the epoch's order is another, and the run skips the same
  number of batches of it (some samples of that epoch are then seen twice, some not at all).

The validation split is read in order, its shards dealt out to the readers; every sample is evaluated once
(the engine sums the counts over the processes). Unreadable images are skipped and counted as in image folders
(:func:`~.folder.collate_skip_corrupt`); a sample without image or label, a label outside the classes, a shard
missing or unreadable raise :class:`ShardError`, one line.
"""
from __future__ import annotations

import functools
import io
import json
import logging
import os
import posixpath
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from ..files import MAX_CONFIG_BYTES, MAX_IMAGE_BYTES, UnreadableFileError, open_regular, read_bytes, read_text
from .folder import (
    IMG_EXTENSIONS,
    DatasetError,
    ImageFolderDataset,
    build_transform,
    collate_skip_corrupt,
    mixup_active,
    to_rgb,
)

__all__ = ["INFO_NAMES", "ShardError", "ShardStream", "SplitInfo", "build_shard_datasets", "find_info",
           "open_eval_split", "read_info", "read_split", "write_shards"]

logger = logging.getLogger(__name__)

INFO_NAMES = ("_info.json", "info.json")  # timm's names, looked for in this order
TRAIN_SPLIT = "train"
VAL_SPLITS = ("validation", "val")
IMAGE_EXTS = tuple(e.lstrip(".") for e in IMG_EXTENSIONS)  # the member names' extensions that hold the image
LABEL_EXT = "cls"


class ShardError(DatasetError):
    """Shards that cannot be trained on (one line).

    Raised in a DataLoader worker it reaches the main process rebuilt from the worker's traceback text; it keeps
    only its own message there, so that the command's error stays one line.
    """

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


@dataclass(frozen=True)
class SplitInfo:
    """One split of the info file: its shards (paths) and their sample counts."""

    name: str
    paths: tuple[str, ...]
    lengths: tuple[int, ...]
    info_path: str

    @property
    def num_samples(self) -> int:
        return sum(self.lengths)


def find_info(root: str | os.PathLike) -> Optional[Path]:
    """The info file of a folder of shards, or None."""
    return next((Path(root) / name for name in INFO_NAMES if (Path(root) / name).is_file()), None)


def read_info(root: str | os.PathLike) -> tuple[dict, Path]:
    path = find_info(root)
    if path is None:
        raise ShardError(f"no shard info file in {root}: expected {' or '.join(INFO_NAMES)} listing the shards of "
                         "each split (polaformer data shard writes one)")
    try:
        info = json.loads(read_text(path, MAX_CONFIG_BYTES))
    except (ValueError, UnreadableFileError) as e:
        raise ShardError(f"{path}: not a readable JSON file ({str(e).splitlines()[0]})") from None
    if not isinstance(info, dict) or not isinstance(info.get("splits"), dict):
        raise ShardError(f"{path}: no 'splits' mapping (timm's layout: splits -> name -> filenames, shard_lengths)")
    return info, path


def read_split(info: dict, info_path: Path, names: Sequence[str]) -> SplitInfo:
    """The first split of ``names`` the info file has, its listed shards checked to exist."""
    name = next((n for n in names if n in info["splits"]), None)
    if name is None:
        raise ShardError(f"{info_path} has no split {' or '.join(map(repr, names))} (it has: "
                         f"{', '.join(info['splits']) or 'none'})")
    split = info["splits"][name]
    files, lengths = (split.get(key) if isinstance(split, dict) else None for key in ("filenames", "shard_lengths"))
    if (not isinstance(files, list) or not isinstance(lengths, list) or len(files) != len(lengths) or not files
            or not all(isinstance(f, str) for f in files)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)):
        raise ShardError(f"{info_path}: split {name!r} needs 'filenames' (shard names) and 'shard_lengths' "
                         "(their sample counts, integers >= 0), two lists of the same, non-zero length")
    if "num_samples" in split and split["num_samples"] != sum(lengths):
        raise ShardError(f"{info_path}: split {name!r} says num_samples {split['num_samples']} but its shard_lengths "
                         f"add up to {sum(lengths)}")
    root = info_path.parent
    paths = tuple(str(root / f) for f in files)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        more = f" ({len(missing)} of the {len(paths)} listed are missing)" if len(missing) > 1 else ""
        raise ShardError(f"shard {missing[0]} is listed in {info_path} but missing{more}")
    return SplitInfo(name, paths, tuple(lengths), str(info_path))


def _members(path: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` of each sample of the tar file at ``path``, read front to back."""
    key, sample = None, {}
    try:
        with open_regular(path) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                base = os.path.basename(member.name)
                if not member.isfile() or base.startswith(".") or "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                name = posixpath.join(posixpath.dirname(member.name), stem)
                if name != key and key is not None:
                    yield key, sample
                    sample = {}
                key = name
                sample[ext.lower()] = tar.extractfile(member).read() if member.size <= MAX_IMAGE_BYTES else b""
    except (tarfile.TarError, EOFError, OSError, UnreadableFileError) as e:
        raise ShardError(f"{path}: not a readable tar file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                         ) from None
    if key is not None:
        yield key, sample


class ShardStream(IterableDataset):
    """One split of a folder of shards: ``(transform(image), label)`` per sample, ``None`` for an unreadable image.

    ``shuffle=True`` (training): per epoch and reader as the module says; :meth:`set_layout` (the engine calls
    it) gives the processes, workers and batch size, :meth:`set_epoch` and :meth:`set_start` (samples of this
    process already trained this epoch) take the part of a sampler, and ``len()`` is this process's samples per
    epoch. ``shuffle=False`` (evaluation): every sample once, shards in the info file's order; ``len()`` is the
    split's samples. ``classes``: the class names when the info file has them, else None.
    """

    def __init__(self, split: SplitInfo, transform: Optional[Callable] = None, *, shuffle: bool, num_classes: int,
                 classes: Optional[list[str]] = None, image_shape: Optional[tuple[int, ...]] = None,
                 classes_from: str = "the info file's classes"):
        self.split, self.transform, self.shuffle = split, transform, shuffle
        self.num_classes, self.classes, self.classes_from = num_classes, classes, classes_from
        self.image_shape = image_shape
        self.collate_fn = functools.partial(collate_skip_corrupt, image_shape=image_shape)
        self.epoch = self.start = 0
        self.set_layout(0, 1)

    @property
    def num_samples(self) -> int:
        return self.split.num_samples

    def set_layout(self, rank: int, world_size: int, *, num_workers: int = 0, batch_size: int = 1,
                   seed: int = 0) -> None:
        self.rank, self.world_size, self.seed, self.batch_size = rank, world_size, seed, batch_size
        self.workers = max(1, num_workers)
        if not self.shuffle:
            return
        readers, lengths = world_size * self.workers, sorted(self.split.lengths)
        if len(lengths) < readers:
            raise ShardError(
                f"{len(lengths)} training shards cannot be shared by {world_size} processes x {self.workers} loader "
                f"workers: each of the {readers} readers needs shards of its own; write at least {readers} shards "
                "(polaformer data shard --samples-per-shard) or lower DATA.NUM_WORKERS")
        sure = sum(lengths[: len(lengths) // readers])
        self.quota = sure // batch_size * batch_size
        if self.quota == 0:
            raise ShardError(
                f"each of the {readers} readers of the {len(lengths)} training shards is sure of only {sure} samples "
                f"per epoch, less than one batch of {batch_size}: write larger shards or use fewer workers")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, samples: int) -> None:
        self.start = samples

    def __len__(self) -> int:
        return self.quota * self.workers - self.start if self.shuffle else self.num_samples

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.shuffle:
            if workers != self.workers:
                raise ShardError(f"the shards were laid out for {self.workers} loader workers, not {workers}")
            return self._train_samples(worker)
        return self._eval_samples(self.rank * workers + worker, self.world_size * workers)

    def _train_samples(self, worker: int):
        # Batches come from the workers in turn: after b batches the next is reader b % W's, and the loader
        # asks worker 0 first.
        done = self.start // self.batch_size
        reader = (worker + done) % self.workers
        skip = len(range(reader, done, self.workers)) * self.batch_size
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.split.paths))
        mine = order[self.rank * self.workers + reader::self.world_size * self.workers]
        left = self.quota - skip
        for index in mine.tolist():
            if left <= 0:
                return
            if skip >= self.split.lengths[index]:  # trained already: not read
                skip -= self.split.lengths[index]
                continue
            samples = list(self._checked(index))
            permutation = np.random.default_rng([self.seed, self.epoch, index]).permutation(len(samples))
            taken = permutation[skip:skip + left].tolist()
            for position in taken:
                yield self._decode(*samples[position])
            left, skip = left - len(taken), 0

    def _eval_samples(self, reader: int, readers: int):
        for index in range(reader, len(self.split.paths), readers):
            for sample in self._checked(index):
                yield self._decode(*sample)

    def _checked(self, index: int) -> Iterator[tuple[str, str, bytes, int]]:
        """``(where, key, image bytes, label)`` of each sample of shard ``index``, its count checked."""
        path, count = self.split.paths[index], 0
        for key, members in _members(path):
            image = next((ext for ext in IMAGE_EXTS if ext in members), None)
            if image is None:
                raise ShardError(f"{path}: sample {key!r} has no image (members: {', '.join(sorted(members))}; "
                                 f"expected one of .{', .'.join(IMAGE_EXTS)})")
            if LABEL_EXT not in members:
                raise ShardError(f"{path}: sample {key!r} has no label (a .{LABEL_EXT} member)")
            text = members[LABEL_EXT].decode("ascii", "replace").strip()
            label = int(text) if text.lstrip("-").isdigit() else None
            if label is None or not 0 <= label < self.num_classes:
                raise ShardError(f"{path}: sample {key!r} has label {text!r}, not a class index "
                                 f"0..{self.num_classes - 1} ({self.num_classes} classes: {self.classes_from})")
            count += 1
            yield path, key, members[image], label
        if count != self.split.lengths[index]:
            raise ShardError(f"{path} holds {count} samples, {self.split.info_path} says {self.split.lengths[index]}")

    def _decode(self, path: str, key: str, data: bytes, label: int):
        try:
            with Image.open(io.BytesIO(data)) as opened:
                opened.load()
                image = to_rgb(opened)
        except Exception as err:  # any decoding failure: PIL raises many kinds
            logger.warning("skipping unreadable image %s in %s: %s: %s", key, path, type(err).__name__, err)
            return None
        return (self.transform(image) if self.transform is not None else image), label

    def check_readable(self) -> None:
        """Read the first sample of the first shard: a shard that is no tar file, or samples written without
        labels, stop the run here, before a model is built."""
        samples = self._checked(0)
        try:
            next(samples, None)
        finally:
            samples.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(split={self.split.name!r}, shards={len(self.split.paths)}, "
                f"samples={self.num_samples}, shuffle={self.shuffle})")


def _open(root, num_classes: int, source: str):
    """The info file, its path, its class names (or None) and the number of classes with where it comes from."""
    info, info_path = read_info(root)
    classes = info.get("classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ShardError(f"{info_path}: 'classes' must be a list of class names")
    if classes:
        num_classes, source = len(classes), "the info file's classes"
    if num_classes < 2:
        raise ShardError(f"{info_path}: {num_classes} classes ({source}): a classifier needs at least 2")
    return info, info_path, classes or None, num_classes, source


def open_eval_split(root: str | os.PathLike, num_classes: int, source: str) -> ShardStream:
    """The validation split of the shards in ``root``, in order, without a transform (``polaformer eval``); the
    info file's classes, else ``num_classes`` (``source`` says where that number comes from)."""
    info, info_path, classes, num_classes, source = _open(root, num_classes, source)
    return ShardStream(read_split(info, info_path, VAL_SPLITS), shuffle=False, num_classes=num_classes,
                       classes=classes, classes_from=source)


def build_shard_datasets(cfg, *, is_distributed: bool = False):
    """``(train_set, val_set, num_classes)`` for the shards in ``cfg.DATA.DATA_PATH`` (see the module).

    The classes are the info file's ``classes`` when it lists them, else ``MODEL.NUM_CLASSES`` of them. The
    transforms and collate functions are the image folders' (:func:`~.folder.build_transform`).
    """
    root = os.path.expanduser(os.fspath(cfg.DATA.DATA_PATH or ""))
    if not root:
        raise DatasetError("no data folder given: set DATA.DATA_PATH (polaformer train --data-path DIR)")
    if not os.path.isdir(root):
        raise DatasetError(f"data folder not found: {root}")
    info, info_path, classes, num_classes, source = _open(root, cfg.MODEL.NUM_CLASSES, "MODEL.NUM_CLASSES")
    size = cfg.DATA.IMG_SIZE
    shape = (3, size, size)
    splits = (read_split(info, info_path, (TRAIN_SPLIT,)), read_split(info, info_path, VAL_SPLITS))
    train_set, val_set = (
        ShardStream(split, build_transform(cfg, shuffle), shuffle=shuffle, num_classes=num_classes,
                    classes=classes, image_shape=shape, classes_from=source)
        for split, shuffle in zip(splits, (True, False)))
    train_set.check_readable()
    train_set.collate_fn = functools.partial(collate_skip_corrupt, image_shape=shape, even=mixup_active(cfg))
    rank0 = not is_distributed or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        logger.info("data %s: %d classes, %d train images in %d shards, %d val images in %d shards", root,
                    num_classes, train_set.num_samples, len(splits[0].paths), val_set.num_samples, len(splits[1].paths))
    return train_set, val_set, num_classes


# --------------------------------------------------------------------------------------------
# writing shards


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)  # fixed owner, mode and time: the same folder gives the same bytes
    member.size, member.mode, member.mtime = len(data), 0o644, 0
    tar.addfile(member, io.BytesIO(data))


def _write_atomic(path: Path, write: Callable) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as f:
            write(f)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_shards(source: str | os.PathLike, out: str | os.PathLike, *, samples_per_shard: int = 1000,
                 seed: int = 0, name: Optional[str] = None, overwrite: bool = False) -> dict:
    """Write the ImageNet-layout folder ``source`` (``train/<class>/``, ``val/<class>/``) as shards in ``out``.

    Training samples are shuffled (with ``seed``) before they are cut into shards of ``samples_per_shard`` (the
    last one may hold fewer), since a reader shuffles only within a shard; validation samples keep the folder's
    order. Each image goes in as its file's bytes (``.jpeg`` named ``.jpg``, as timm looks for ``.jpg``), with
    its class index as ``.cls``. The info file (``_info.json``, with the class names) is written last, so a folder
    whose writing was interrupted has none and is refused (``overwrite`` removes the old one first; shards of the
    old set with other names stay, unlisted). Returns the info.
    """
    if samples_per_shard < 1:
        raise DatasetError(f"samples per shard must be a positive integer, got {samples_per_shard}")
    source, out = Path(source).expanduser(), Path(out).expanduser()
    sets = {split: ImageFolderDataset(source / folder)
            for split, folder in ((TRAIN_SPLIT, "train"), ("validation", "val"))}
    if sets[TRAIN_SPLIT].classes != sets["validation"].classes:
        raise DatasetError(f"train and val class folders differ in {source}")
    name = name or source.resolve().name
    if find_info(out) is not None and not overwrite:
        raise DatasetError(f"{find_info(out)} already exists: --overwrite replaces the shards, or choose another OUT")
    out.mkdir(parents=True, exist_ok=True)
    for stale in INFO_NAMES:  # first: replacing shards that an old info file lists would leave it describing them
        (out / stale).unlink(missing_ok=True)
    info = {"name": name, "splits": {}, "classes": sets[TRAIN_SPLIT].classes}
    for split, dataset in sets.items():
        order = np.arange(len(dataset))
        if split == TRAIN_SPLIT:
            order = np.random.default_rng(seed).permutation(len(dataset))
        filenames, lengths = [], []
        for first in range(0, len(order), samples_per_shard):
            filename = f"{name}-{split}-{len(filenames):06d}.tar"
            chunk = order[first:first + samples_per_shard].tolist()

            def write(f, chunk=chunk, first=first):
                with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                    for position, index in enumerate(chunk, start=first):
                        path = dataset.path(index)
                        ext = os.path.splitext(path)[1].lower().lstrip(".").replace("jpeg", "jpg")
                        _add(tar, f"{position:08d}.{ext}", read_bytes(path, MAX_IMAGE_BYTES))
                        _add(tar, f"{position:08d}.{LABEL_EXT}", str(int(dataset.targets[index])).encode())

            _write_atomic(out / filename, write)
            filenames.append(filename)
            lengths.append(len(chunk))
        info["splits"][split] = {"name": split, "num_samples": len(order), "filenames": filenames,
                                 "shard_lengths": lengths}
    text = json.dumps(info, indent=1) + "\n"
    _write_atomic(out / INFO_NAMES[0], lambda f: f.write(text.encode()))
    return info
