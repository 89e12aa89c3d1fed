import json
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


def load_vector(case: str):
    """(record, tensors) of a reference vector in ../shared/reference/vectors."""
    from safetensors.torch import load_file

    folder = REFERENCE / "vectors"
    if not folder.is_dir():
        pytest.skip(f"reference data not found at {folder}")
    record = json.loads((folder / f"{case}.json").read_text())
    return record, load_file(folder / f"{case}.safetensors")


def official_state_dict(tensors):
    return {k[len("state_dict."):]: v for k, v in tensors.items() if k.startswith("state_dict.")}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
