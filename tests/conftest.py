import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]  # the repository root
REFERENCE = REPO.parent / "shared" / "reference"


def require_reference(path: Path) -> Path:
    """``path`` under ../shared/reference; where it is missing the test is skipped on a developer's machine and
    fails under CI (``CI=true``), where the reference data must be beside the clone."""
    if not path.exists():
        message = f"reference data not found at {path} (the official code's outputs, ../shared/reference)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def load_vector(case: str):
    """(record, tensors) of a reference vector in ../shared/reference/vectors."""
    from safetensors.torch import load_file

    folder = require_reference(REFERENCE / "vectors")
    record = json.loads((folder / f"{case}.json").read_text())
    return record, load_file(folder / f"{case}.safetensors")


def official_state_dict(tensors):
    return {k[len("state_dict."):]: v for k, v in tensors.items() if k.startswith("state_dict.")}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
