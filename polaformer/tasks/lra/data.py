"""Long Range Arena data: the five tasks, read from the files users actually hold.

:func:`load_lra_split` looks into a folder and reads whichever of these it finds (first match wins):

a. Skyformer's preprocessed pickles ``{name}.{train,dev,test}.pickle`` (what the PolaFormer paper
   trained on), through an unpickler that admits numpy arrays and numbers only;
b. the LRA release's ListOps ``basic_{train,val,test}.tsv`` (or our generator's, see
   :mod:`polaformer.tasks.lra.listops`);
c. IMDb's ``aclImdb/`` folder;
d. the LRA release's AAN pairs ``new_aan_pairs.{train,eval,test}.tsv``;
e. CIFAR-10's ``cifar-10-batches-py/`` folder;
f. the LRA release's Pathfinder PNG folders ``pathfinder32/{difficulty}/``.

Every dataset yields ``(tokens, label)``: ``tokens`` is the unpadded 1-D ``torch.long`` sequence
(a ``(tokens_a, tokens_b)`` pair for retrieval) and ``label`` an ``int``; :func:`collate_lra` pads a
batch. Token ids follow the LRA/Skyformer preprocessing so that a model sees the same ids whichever
file it came from (ListOps ids are fixed by us; theirs depend on Python's set order):

- text tasks (listops, text, retrieval): 0 is padding and every real token is >= 1. Text and
  retrieval are byte level: id = byte + 1 (tfds ``ByteTextEncoder``, which LRA's text and matching
  input pipelines use with ``tokenizer='char'``), ids 1..256 in a vocabulary of 512.
- image and pathfinder: id = pixel value 0..255, exactly as LRA (``tf.cast(image, tf.int32)``) and
  Skyformer's pickles hold them; image's vocabulary is 256, so there is no room for a +1 shift.
  These sequences always have 1,024 tokens and are never padded, so 0 (a black pixel) is a real
  token. Note that LRA's model (``src_padding_mask = inputs > 0``) and Skyformer's dataset
  (``mask = input_ids != 0``) treat black pixels as padding and exclude them from attention and
  pooling; our ``padding_mask`` comes from sequence lengths and keeps them. A model that wants the
  reference behaviour can mask ``tokens == 0`` itself.

Every problem with a file raises :class:`LRADataError`, one line naming the file and the problem.
"""
from __future__ import annotations

import importlib
import io
import logging
import math
import os
import pickle
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from ...data.folder import DatasetError
from ...files import UnreadableFileError, open_regular, read_bytes, read_image, read_text
from .listops import encode_listops_array

__all__ = [
    "PATHFINDER_DIFFICULTIES",
    "TASKS",
    "LRADataError",
    "LRADataset",
    "PathfinderImages",
    "TaskSpec",
    "cifar10_grayscale",
    "collate_lra",
    "load_lra_split",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """What a model needs to know about a task: vocabulary, classes, longest sequence, one or two inputs."""

    name: str
    vocab_size: int
    num_classes: int
    max_len: int
    dual: bool = False


# Skyformer's src/config.py, with max_seq_len rounded up to a power of two as its main.py does.
TASKS: dict[str, TaskSpec] = {
    "listops": TaskSpec("listops", vocab_size=32, num_classes=10, max_len=2048),
    "text": TaskSpec("text", vocab_size=512, num_classes=2, max_len=4096),
    "retrieval": TaskSpec("retrieval", vocab_size=512, num_classes=2, max_len=4096, dual=True),
    "image": TaskSpec("image", vocab_size=256, num_classes=10, max_len=1024),
    "pathfinder": TaskSpec("pathfinder", vocab_size=512, num_classes=2, max_len=1024),
}
_TEXT_TASKS = ("listops", "text", "retrieval")
# Truncation of raw files, as the LRA/Skyformer preprocessing (max_length=2000 / 4000 per document).
_RAW_CAP = {"listops": 2000, "text": 4000, "retrieval": 4000}
_PIXELS = 1024
PATHFINDER_DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
_SPLITS = ("train", "dev", "test")


class LRADataError(DatasetError):
    """A missing, malformed or unsafe LRA data file; the message names the file and the problem."""


# ----------------------------------------------------------------------------- datasets


class LRADataset(Dataset):
    """Sequences held in memory as compact integer arrays; items are ``(tokens, label)``.

    ``sequences_b`` is given for the dual task (retrieval), and items are then
    ``((tokens_a, tokens_b), label)``. ``source`` names where the data came from, for messages.
    """

    def __init__(
        self,
        task: str,
        sequences: Sequence[np.ndarray],
        labels: Sequence[int] | np.ndarray,
        sequences_b: Sequence[np.ndarray] | None = None,
        source: str = "",
    ):
        self.task = task
        self.spec = TASKS[task]
        self.sequences = sequences
        self.sequences_b = sequences_b
        self.labels = np.asarray(labels, dtype=np.int64)
        self.source = source
        if len(self.sequences) != len(self.labels) or (
            sequences_b is not None and len(sequences_b) != len(self.labels)
        ):
            raise ValueError("sequences, sequences_b and labels must have the same length")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        tokens = torch.from_numpy(np.asarray(self.sequences[index], dtype=np.int64))
        if self.sequences_b is not None:
            tokens_b = torch.from_numpy(np.asarray(self.sequences_b[index], dtype=np.int64))
            return (tokens, tokens_b), int(self.labels[index])
        return tokens, int(self.labels[index])

    def __repr__(self) -> str:
        return f"LRADataset(task={self.task!r}, examples={len(self)}, source={self.source!r})"


class PathfinderImages(Dataset):
    """Pathfinder PNGs decoded on access (a split holds up to 160,000 files); items are ``(tokens, label)``.

    Images must be 32x32; 8-bit grey (mode ``L``) is read as is, any other mode is converted to
    ``L`` by Pillow. A file that cannot be decoded raises :class:`LRADataError` naming it.
    """

    def __init__(self, paths: Sequence[Path], labels: Sequence[int], source: str = ""):
        self.task = "pathfinder"
        self.spec = TASKS["pathfinder"]
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.source = source

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        path = self.paths[index]
        try:
            with read_image(path) as image:
                if image.mode != "L":
                    image = image.convert("L")
                pixels = np.asarray(image, dtype=np.uint8)
        except (OSError, UnreadableFileError) as exc:
            raise LRADataError(f"{path}: not a readable PNG ({getattr(exc, 'detail', exc)})") from exc
        if pixels.shape != (32, 32):
            raise LRADataError(f"{path}: expected a 32x32 image, got {pixels.shape[1]}x{pixels.shape[0]}")
        return torch.from_numpy(pixels.reshape(-1).astype(np.int64)), int(self.labels[index])

    def __repr__(self) -> str:
        return f"PathfinderImages(examples={len(self)}, source={self.source!r})"


def _pad(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in sequences])
    tokens = pad_sequence(sequences, batch_first=True, padding_value=0)
    padding_mask = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]
    return tokens, padding_mask


def collate_lra(batch: Sequence[tuple[Any, int]]) -> dict[str, torch.Tensor]:
    """Pad a list of ``(tokens, label)`` items with 0 to the longest sequence in the batch.

    Returns ``tokens`` (B, L) long, ``padding_mask`` (B, L) bool with True at padding (the
    ``key_padding_mask`` convention of ``nn.MultiheadAttention``) and ``label`` (B,) long; for pairs
    also ``tokens_b`` and ``padding_mask_b``, padded to their own longest. The mask comes from the
    lengths, not from id 0, so pixel value 0 in image tasks is never masked.
    """
    if not batch:
        raise ValueError("collate_lra got an empty batch")
    labels = torch.tensor([int(label) for _, label in batch], dtype=torch.long)
    if isinstance(batch[0][0], tuple):
        tokens, padding_mask = _pad([item[0][0] for item in batch])
        tokens_b, padding_mask_b = _pad([item[0][1] for item in batch])
        return {
            "tokens": tokens,
            "padding_mask": padding_mask,
            "tokens_b": tokens_b,
            "padding_mask_b": padding_mask_b,
            "label": labels,
        }
    tokens, padding_mask = _pad([item[0] for item in batch])
    return {"tokens": tokens, "padding_mask": padding_mask, "label": labels}


# ----------------------------------------------------------------------------- checks shared by readers


def _label(value: Any, spec: TaskSpec, where: str) -> int:
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, (bool, np.bool_)):
        raise LRADataError(f"{where}: non-integer label {value!r}")
    if isinstance(value, (int, np.integer)):
        label = int(value)
    elif isinstance(value, (float, np.floating)) and float(value).is_integer():
        label = int(value)
    elif isinstance(value, (str, bytes)):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            number = float(text.strip())
        except ValueError:
            raise LRADataError(f"{where}: non-integer label {text.strip()!r}") from None
        if not number.is_integer():
            raise LRADataError(f"{where}: non-integer label {text.strip()!r}")
        label = int(number)
    else:
        raise LRADataError(f"{where}: non-integer label {value!r}")
    if not 0 <= label < spec.num_classes:
        raise LRADataError(f"{where}: label {label} out of range 0..{spec.num_classes - 1}")
    return label


def _check_ids(ids: np.ndarray, spec: TaskSpec, where: str) -> np.ndarray:
    """Validate a finished, unpadded id sequence and store it compactly (uint16 fits every vocabulary)."""
    if ids.size == 0:
        raise LRADataError(f"{where}: empty sequence")
    if ids.size > spec.max_len:
        raise LRADataError(f"{where}: sequence of {ids.size} tokens exceeds {spec.name}'s max_len {spec.max_len}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= spec.vocab_size:
        bad = low if low < 0 else high
        raise LRADataError(f"{where}: token id {bad} outside the vocabulary 0..{spec.vocab_size - 1}")
    return ids.astype(np.uint16)


def _bytes_to_ids(data: bytes, cap: int) -> np.ndarray:
    """Byte-level ids as tfds' ByteTextEncoder gives them: byte value + 1, so 0 stays padding."""
    return np.frombuffer(data[:cap], dtype=np.uint8).astype(np.uint16) + 1


# ----------------------------------------------------------------------------- (a) Skyformer pickles


def _numpy_global(module_names: tuple[str, ...], name: str) -> Any:
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"numpy has no {name} in {module_names}")


_MULTIARRAY = ("numpy._core.multiarray", "numpy.core.multiarray")
_NUMERIC = ("numpy._core.numeric", "numpy.core.numeric")
# (module, name) as written in the file -> how to find the object in the installed numpy.
_PICKLE_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: importlib.import_module("_codecs").encode,  # bytes, protocol 2
}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _PICKLE_ALLOWED[(_module, "_reconstruct")] = lambda: _numpy_global(_MULTIARRAY, "_reconstruct")
    _PICKLE_ALLOWED[(_module, "scalar")] = lambda: _numpy_global(_MULTIARRAY, "scalar")
for _module in ("numpy.core.numeric", "numpy._core.numeric"):
    _PICKLE_ALLOWED[(_module, "_frombuffer")] = lambda: _numpy_global(_NUMERIC, "_frombuffer")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers, numbers, strings, numpy arrays and numpy scalars, nothing else.

    A pickle names every callable it will run (``find_class``); LRA pickles need only numpy's array,
    dtype and scalar constructors, so any other name is refused before anything is called.
    ``encoding='latin1'`` reads Python 2 pickles (CIFAR-10's batches) as numpy expects.
    """

    def __init__(self, file, path: Path):
        super().__init__(file, encoding="latin1")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        resolve = _PICKLE_ALLOWED.get((module, name))
        if resolve is None:
            raise LRADataError(
                f"{self.path}: refused to unpickle the global {module}.{name} "
                f"(LRA data files may only hold numpy arrays, numbers and plain containers)"
            )
        return resolve()

    def persistent_load(self, pid: Any) -> Any:
        raise LRADataError(f"{self.path}: refused a persistent id in the pickle")


def _read_pickle(path: Path) -> Any:
    try:
        with open_regular(path) as f:
            return _NumpyOnlyUnpickler(f, path).load()
    except (LRADataError, MemoryError):
        raise
    except Exception as exc:
        raise LRADataError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc})") from exc


def _pickled_sequence(value: Any, spec: TaskSpec, where: str) -> np.ndarray:
    array = np.asarray(value) if not isinstance(value, np.ndarray) else value
    if array.ndim != 1:
        raise LRADataError(f"{where}: expected a 1-D array of token ids, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise LRADataError(f"{where}: expected integer token ids, got dtype {array.dtype}")
    if spec.name in _TEXT_TASKS:
        nonzero = np.flatnonzero(array)
        if nonzero.size == 0:
            raise LRADataError(f"{where}: empty sequence (all padding)")
        array = array[: nonzero[-1] + 1]
        if nonzero.size != array.size:
            position = int(np.flatnonzero(array == 0)[0])
            raise LRADataError(f"{where}: padding id 0 inside the sequence at position {position}")
    else:
        if array.size != _PIXELS:
            raise LRADataError(f"{where}: expected {_PIXELS} pixels, got {array.size}")
        if array.min() < 0 or array.max() > 255:
            bad = int(array.min()) if array.min() < 0 else int(array.max())
            raise LRADataError(f"{where}: pixel value {bad} outside 0..255")
    return _check_ids(array, spec, where)


def _load_pickle(path: Path, spec: TaskSpec, limit: int | None) -> LRADataset:
    records = _read_pickle(path)
    if not isinstance(records, list):
        raise LRADataError(f"{path}: expected a list of examples, got {type(records).__name__}")
    if limit is not None:
        records = records[:limit]
    keys = ("input_ids_0", "input_ids_1") if spec.dual else ("input_ids_0",)
    columns: list[list[np.ndarray]] = [[] for _ in keys]
    labels = []
    for index, record in enumerate(records):
        where = f"{path}: example {index}"
        if not isinstance(record, dict):
            raise LRADataError(f"{where} is a {type(record).__name__}, expected a dict")
        for key in (*keys, "label"):
            if key not in record:
                raise LRADataError(f"{where} has no {key!r} (keys: {sorted(map(str, record))})")
        labels.append(_label(record["label"], spec, where))
        for column, key in zip(columns, keys):
            column.append(_pickled_sequence(record[key], spec, f"{where} {key}"))
    if not labels:
        raise LRADataError(f"{path}: no examples")
    if spec.name in ("image", "pathfinder"):
        columns = [np.stack(column).astype(np.uint8) for column in columns]
    return LRADataset(
        spec.name, columns[0], labels, columns[1] if spec.dual else None, source=str(path)
    )


def _pickle_names(task: str, difficulty: str) -> list[str]:
    if task == "pathfinder":
        return [f"lra-pathfinder32-{difficulty}", f"pathfinder32-{difficulty}", "pathfinder"]
    return [f"lra-{task}", task]


# ----------------------------------------------------------------------------- (b) ListOps TSV


def _unquote(field: str) -> str:
    if len(field) >= 2 and field[0] == field[-1] == '"':
        return field[1:-1].replace('""', '"')
    return field


def _load_listops_tsv(path: Path, spec: TaskSpec, limit: int | None, style: str) -> LRADataset:
    """LRA's ListOps TSV: header with ``Source`` and ``Target`` columns (LRA selects them by name)."""
    sequences, labels = [], []
    try:
        with io.TextIOWrapper(open_regular(path), encoding="utf-8", newline="") as f:
            header = f.readline().rstrip("\r\n").split("\t")
            header = [_unquote(name) for name in header]
            for column in ("Source", "Target"):
                if column not in header:
                    raise LRADataError(f"{path}: missing column {column!r} (header: {header})")
            source_col, target_col = header.index("Source"), header.index("Target")
            for line_number, line in enumerate(f, start=2):
                if limit is not None and len(labels) >= limit:
                    break
                line = line.rstrip("\r\n")
                if not line:
                    continue
                fields = line.split("\t")
                where = f"{path}: line {line_number}"
                if len(fields) != len(header):
                    raise LRADataError(f"{where}: expected {len(header)} tab-separated fields, got {len(fields)}")
                labels.append(_label(_unquote(fields[target_col]), spec, where))
                try:
                    ids = encode_listops_array(_unquote(fields[source_col]), style)  # type: ignore[arg-type]
                except ValueError as exc:
                    raise LRADataError(f"{where}: {exc}") from None
                sequences.append(_check_ids(ids[: _RAW_CAP["listops"]], spec, where))
    except UnicodeDecodeError as exc:
        raise LRADataError(f"{path}: not UTF-8 text ({exc})") from None
    if not labels:
        raise LRADataError(f"{path}: no examples")
    return LRADataset("listops", sequences, labels, source=str(path))


# ----------------------------------------------------------------------------- (c) IMDb


def _review_order(path: Path) -> tuple[int, str]:
    match = re.match(r"(\d+)_", path.name)
    return (int(match.group(1)) if match else -1, path.name)


def _load_imdb(root: Path, split: str, spec: TaskSpec, limit: int | None) -> LRADataset:
    """aclImdb reviews, byte level, whitespace-stripped as tfds' imdb_reviews builder does.

    LRA has no IMDb validation set: its text pipeline evaluates on the test set (``valid_raw =
    data['test']``), and Skyformer's config counts 25,000 dev examples. So ``dev`` reads
    ``aclImdb/test`` too. Reviews alternate neg/pos (each class in file-id order), so a ``limit``
    keeps both classes.
    """
    folder = root / ("train" if split == "train" else "test")
    if split == "dev":
        log.info("IMDb has no validation set; dev is the test set, as in LRA and Skyformer")
    per_class = []
    for label, name in enumerate(("neg", "pos")):  # tfds ClassLabel(names=['neg', 'pos'])
        class_dir = folder / name
        if not class_dir.is_dir():
            raise LRADataError(f"{class_dir}: missing folder (expected aclImdb/{folder.name}/{{neg,pos}}/*.txt)")
        files = sorted(class_dir.glob("*.txt"), key=_review_order)
        per_class.append([(path, label) for path in files])
    order = [item for pair in zip(*per_class) for item in pair]
    shorter = min(len(files) for files in per_class)
    order += [item for files in per_class for item in files[shorter:]]
    if not order:
        raise LRADataError(f"{folder}: no reviews (*.txt) in neg/ or pos/")
    if limit is not None:
        order = order[:limit]
    sequences, labels = [], []
    for path, label in order:
        text = read_bytes(path, None).strip()
        sequences.append(_check_ids(_bytes_to_ids(text, _RAW_CAP["text"]), spec, str(path)))
        labels.append(label)
    return LRADataset("text", sequences, labels, source=str(folder))


# ----------------------------------------------------------------------------- (d) AAN pairs


def _load_aan_tsv(path: Path, spec: TaskSpec, limit: int | None) -> LRADataset:
    """AAN pairs: no header, five tab-separated columns ``label id1 id2 text1 text2``.

    The layout, the float label and the absence of quoting (``use_quote_delim=False``) are those of
    LRA's ``lra_benchmarks/matching/input_pipeline.py``; each document is byte level and cut to
    4,000 bytes (Skyformer's ``max_length=4000``).
    """
    sequences_a, sequences_b, labels = [], [], []
    cap = _RAW_CAP["retrieval"]
    with open_regular(path) as f:
        for line_number, line in enumerate(f, start=1):
            if limit is not None and len(labels) >= limit:
                break
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            fields = line.split(b"\t")
            where = f"{path}: line {line_number}"
            if len(fields) != 5:
                raise LRADataError(
                    f"{where}: expected 5 tab-separated fields (label, id1, id2, text1, text2), got {len(fields)}"
                )
            labels.append(_label(fields[0], spec, where))
            sequences_a.append(_check_ids(_bytes_to_ids(fields[3], cap), spec, f"{where} text1"))
            sequences_b.append(_check_ids(_bytes_to_ids(fields[4], cap), spec, f"{where} text2"))
    if not labels:
        raise LRADataError(f"{path}: no examples")
    return LRADataset("retrieval", sequences_a, labels, sequences_b, source=str(path))


# ----------------------------------------------------------------------------- (e) CIFAR-10


_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_TEST = ["test_batch"]
_CIFAR_DEV_FRACTION = 0.1  # tfds split='train[90%:]': the last 5,000 of 50,000


def cifar10_grayscale(images: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) uint8 RGB -> (N, 1024) uint8 grey, as ``tf.image.rgb_to_grayscale`` computes it.

    TensorFlow converts uint8 to float32 by multiplying with 1/255, takes the dot product with
    (0.2989, 0.5870, 0.1140), and converts back by multiplying with 255.5 and truncating. We do the
    same in float32; results can differ from TensorFlow's only where the float32 sum lands within
    rounding of an integer boundary.
    """
    scaled = images.astype(np.float32) * np.float32(1.0 / 255.0)
    weights = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
    grey = scaled @ weights
    return (grey * np.float32(255.5)).astype(np.uint8).reshape(len(images), -1)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    if not path.is_file():
        raise LRADataError(f"{path}: missing CIFAR-10 batch file")
    entry = _read_pickle(path)
    if not isinstance(entry, dict):
        raise LRADataError(f"{path}: expected a dict, got {type(entry).__name__}")
    entry = {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in entry.items()}
    for key in ("data", "labels"):
        if key not in entry:
            raise LRADataError(f"{path}: missing key {key!r} (keys: {sorted(map(str, entry))})")
    data, labels = entry["data"], entry["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise LRADataError(
            f"{path}: 'data' must be a uint8 array of shape (N, 3072), got {type(data).__name__} {shape}"
        )
    if len(labels) != len(data):
        raise LRADataError(f"{path}: {len(labels)} labels for {len(data)} images")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), list(labels)


def _read_cifar(folder: Path, train: bool) -> tuple[np.ndarray, list[int]]:
    """All images (N, 32, 32, 3) and labels of the train or test batches, in file order.

    torchvision's CIFAR10 checks the MD5 of every batch before it unpickles them, so for the
    genuine files we let it read them. Files whose MD5 differs (re-packed, or small test fixtures,
    whose checksums cannot be made to match) are read by our numpy-only unpickler instead; both give
    the same arrays.
    """
    names = _CIFAR_TRAIN if train else _CIFAR_TEST
    for name in names:
        if not (folder / name).is_file():
            raise LRADataError(f"{folder / name}: missing CIFAR-10 batch file")
    try:
        from torchvision.datasets import CIFAR10

        dataset = None
        if folder.name == CIFAR10.base_folder:
            dataset = CIFAR10(str(folder.parent), train=train, download=False)
    except (ImportError, RuntimeError):
        dataset = None
    if dataset is not None:
        return np.asarray(dataset.data), [int(t) for t in dataset.targets]
    log.info("%s: not the checksummed CIFAR-10 release; reading it with the numpy-only unpickler", folder)
    parts = [_read_cifar_batch(folder / name) for name in names]
    return np.concatenate([images for images, _ in parts]), [t for _, labels in parts for t in labels]


def _load_cifar(folder: Path, split: str, spec: TaskSpec, limit: int | None) -> LRADataset:
    """Grey-scale CIFAR-10 as LRA's image pipeline: train = the first 90% of the training batches
    (45,000), dev = the last 10% (5,000), test = the test batch (10,000).

    LRA slices tfds' copy, whose order is tfds' own shuffle of the same images; we slice the files'
    order, so the dev images are a different (equally random) 5,000.
    """
    images, targets = _read_cifar(folder, train=split != "test")
    if split != "test":
        cut = len(images) - int(math.floor(len(images) * _CIFAR_DEV_FRACTION + 0.5))
        images, targets = (images[:cut], targets[:cut]) if split == "train" else (images[cut:], targets[cut:])
    if limit is not None:
        images, targets = images[:limit], targets[:limit]
    where = f"{folder} ({split})"
    labels = [_label(t, spec, f"{where}: example {i}") for i, t in enumerate(targets)]
    if not labels:
        raise LRADataError(f"{where}: no examples")
    return LRADataset("image", cifar10_grayscale(images), labels, source=str(folder))


# ----------------------------------------------------------------------------- (f) Pathfinder


def _metadata_order(path: Path) -> tuple[int, str]:
    return (int(path.stem) if path.stem.isdigit() else -1, path.name)


def _load_pathfinder(root: Path, split: str, limit: int | None, seed: int) -> PathfinderImages:
    """Pathfinder-32 from its PNG folder, split 80/10/10 as LRA and Skyformer split it.

    ``metadata/*.npy`` are text files (despite the name), one image per line:
    ``<folder> <file name> <...> <label> ...``, the image at ``root/<folder>/<file name>`` and the
    label in the fourth field (LRA's ``lra_benchmarks/data/pathfinder.py``). All lines of all
    metadata files (in numeric file order) are shuffled with a fixed seed and cut at 80% and 90%
    (Skyformer's ``create_pathfinder.py`` does the same with an unseeded shuffle). Empty image files,
    which LRA filters out, are skipped within the split.
    """
    spec = TASKS["pathfinder"]
    metadata_files = sorted((root / "metadata").glob("*.npy"), key=_metadata_order)
    if not metadata_files:
        raise LRADataError(f"{root / 'metadata'}: no metadata files (*.npy)")
    entries: list[tuple[Path, int]] = []
    for meta in metadata_files:
        try:
            lines = read_text(meta, None).splitlines()
        except UnicodeDecodeError:
            raise LRADataError(f"{meta}: not a text metadata file") from None
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            fields = line.split()
            where = f"{meta}: line {line_number}"
            if len(fields) < 4:
                raise LRADataError(f"{where}: expected at least 4 space-separated fields, got {len(fields)}")
            entries.append((root / fields[0] / fields[1], _label(fields[3], spec, where)))
    random.Random(seed).shuffle(entries)
    bp80, bp90 = int(len(entries) * 0.8), int(len(entries) * 0.9)
    chosen = {"train": entries[:bp80], "dev": entries[bp80:bp90], "test": entries[bp90:]}[split]
    kept: list[tuple[Path, int]] = []
    empty = 0
    for path, label in chosen:
        if limit is not None and len(kept) >= limit:
            break
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LRADataError(f"{path}: image listed in the metadata is missing") from None
        if size == 0:
            empty += 1
            continue
        kept.append((path, label))
    if empty:
        log.info("%s: skipped %d empty image files in the %s split, as LRA does", root, empty, split)
    if not kept:
        raise LRADataError(f"{root}: no images in the {split} split")
    return PathfinderImages([p for p, _ in kept], [label for _, label in kept], source=str(root))


# ----------------------------------------------------------------------------- format detection


def _first_dir(candidates: list[Path], test: Callable[[Path], bool]) -> Path | None:
    return next((c for c in candidates if c.is_dir() and test(c)), None)


def _holds_any(names: Iterable[str]) -> Callable[[Path], bool]:
    names = list(names)
    return lambda folder: any((folder / name).is_file() for name in names)


def _release_dirs(data_dir: Path, sub: str) -> list[Path]:
    """``data_dir`` itself, and ``sub`` inside it or inside an extracted LRA release."""
    return [data_dir, data_dir / sub, data_dir / "lra_release" / sub, data_dir / "lra_release" / "lra_release" / sub]


def _split_file(folder: Path, name: str, release: str) -> Path:
    """``folder/name``, the file of one split of a release whose other split files ``folder`` holds."""
    path = folder / name
    if not path.is_file():
        raise LRADataError(f"{path}: missing file (other {release} splits are there)")
    return path


def load_lra_split(
    task: str,
    data_dir: str | os.PathLike,
    split: str,
    *,
    limit: int | None = None,
    pathfinder_difficulty: str = "curv_contour_length_14",
    listops_tokens: str = "lra",
    pathfinder_seed: int = 0,
) -> Dataset:
    """One split of an LRA task from whatever files ``data_dir`` holds (see the module docstring).

    ``split`` is ``train``, ``dev`` (alias ``val``) or ``test``. ``limit`` keeps the first N
    examples. ``pathfinder_difficulty`` picks ``curv_baseline``, ``curv_contour_length_9`` or
    ``curv_contour_length_14`` (LRA's Pathfinder-32 "hard", the default). ``listops_tokens``
    (``lra`` or ``skyformer``) picks the ListOps tokenisation of TSV files, see
    :func:`polaformer.tasks.lra.listops.encode_listops`. ``pathfinder_seed`` fixes the 80/10/10 shuffle.
    """
    if task not in TASKS:
        raise LRADataError(f"unknown LRA task {task!r}; expected one of {', '.join(TASKS)}")
    spec = TASKS[task]
    split = "dev" if split == "val" else split
    if split not in _SPLITS:
        raise LRADataError(f"unknown split {split!r}; expected train, dev (or val) or test")
    if limit is not None and limit < 1:
        raise LRADataError(f"limit must be a positive number of examples, got {limit}")
    if pathfinder_difficulty not in PATHFINDER_DIFFICULTIES:
        raise LRADataError(
            f"unknown Pathfinder difficulty {pathfinder_difficulty!r}; "
            f"expected one of {', '.join(PATHFINDER_DIFFICULTIES)}"
        )
    if listops_tokens not in ("lra", "skyformer"):
        raise LRADataError(f"unknown ListOps tokenisation {listops_tokens!r}; expected 'lra' or 'skyformer'")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise LRADataError(f"{data_dir}: not a folder")

    looked_for: list[str] = []

    # (a) pickles, in data_dir or Skyformer's data/lra_processed
    names = _pickle_names(task, pathfinder_difficulty)
    looked_for.append(f"{names[0]}.{split}.pickle (or {', '.join(names[1:])})")
    for folder in (data_dir, data_dir / "lra_processed"):
        for name in names:
            path = folder / f"{name}.{split}.pickle"
            if path.is_file():
                log.info("reading %s", path)
                return _load_pickle(path, spec, limit)
        for name in names:
            others = [folder / f"{name}.{s}.pickle" for s in _SPLITS if s != split]
            if any(p.is_file() for p in others):
                raise LRADataError(f"{folder / f'{name}.{split}.pickle'}: missing file (other splits are there)")

    # (b)-(f) the raw release formats
    if task == "listops":
        file_names = {"train": "basic_train.tsv", "dev": "basic_val.tsv", "test": "basic_test.tsv"}
        looked_for.append("basic_{train,val,test}.tsv (also in listops-1000/)")
        folder = _first_dir(_release_dirs(data_dir, "listops-1000"), _holds_any(file_names.values()))
        if folder is not None:
            return _load_listops_tsv(_split_file(folder, file_names[split], "ListOps"), spec, limit, listops_tokens)
    elif task == "text":
        looked_for.append("aclImdb/{train,test}/{neg,pos}/*.txt")
        folder = _first_dir([data_dir / "aclImdb", data_dir], lambda d: (d / "train").is_dir() or (d / "test").is_dir())
        if folder is not None:
            return _load_imdb(folder, split, spec, limit)
    elif task == "retrieval":
        file_names = {s: f"new_aan_pairs.{'eval' if s == 'dev' else s}.tsv" for s in _SPLITS}
        looked_for.append("new_aan_pairs.{train,eval,test}.tsv (also in tsv_data/)")
        folder = _first_dir(_release_dirs(data_dir, "tsv_data"), _holds_any(file_names.values()))
        if folder is not None:
            return _load_aan_tsv(_split_file(folder, file_names[split], "AAN"), spec, limit)
    elif task == "image":
        looked_for.append("cifar-10-batches-py/{data_batch_1..5,test_batch}")
        folder = _first_dir([data_dir / "cifar-10-batches-py", data_dir], _holds_any(_CIFAR_TRAIN + _CIFAR_TEST))
        if folder is not None:
            return _load_cifar(folder, split, spec, limit)
    else:
        sub = f"pathfinder32/{pathfinder_difficulty}"
        looked_for.append(f"{sub}/metadata/*.npy")
        candidates = [data_dir, data_dir / pathfinder_difficulty] + _release_dirs(data_dir, sub)[1:]
        folder = _first_dir(candidates, lambda d: (d / "metadata").is_dir())
        if folder is not None:
            return _load_pathfinder(folder, split, limit, pathfinder_seed)

    raise LRADataError(f"{data_dir}: no LRA {task} files found; looked for {'; '.join(looked_for)}")
