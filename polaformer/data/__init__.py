"""Data sets known to the engine and the CLI, by name.

Each entry says how to build the ``(train, test)`` datasets and the image geometry the model
must be created for. Only the embedded ``digits`` set is registered here; ImageNet-layout
folders (``--data-path DIR``) are read by ``polaformer.data.folder``, tar shards in the WebDataset
layout by ``polaformer.data.shards``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.utils.data import Dataset

from . import digits


@dataclass(frozen=True)
class DataSpec:
    build: Callable[..., tuple[Dataset, Dataset]]  # build(augment=bool) -> (train, test)
    num_classes: int
    in_chans: int
    img_size: int


DATASETS = {
    "digits": DataSpec(digits.digits_datasets, digits.NUM_CLASSES, digits.IN_CHANS, digits.IMG_SIZE),
}
DEFAULT_DATA = "digits"


class UnknownDatasetError(ValueError):
    pass


def get_data_spec(name: str) -> DataSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownDatasetError(f"unknown data set {name!r} (known: {', '.join(sorted(DATASETS))})") from None


__all__ = ["DATASETS", "DEFAULT_DATA", "DataSpec", "UnknownDatasetError", "get_data_spec"]
