import json
import os
from collections import Counter
from pathlib import Path

import pytest

# Under pytest-xdist each worker takes one core: torch's threads would otherwise oversubscribe the machine.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Without CUDA the Triton kernels' tests run in Triton's interpreter on CPU tensors; triton reads the switch
# when a kernel is defined, so it is set before any test module can import the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]  # the repository root


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests run first (each file's own order kept): xdist hands out whole files
    (``--dist loadfile``), so with the longest first the two workers finish together."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
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


@pytest.fixture
def triton_backend():
    """Select the Triton kernels for one test, restoring the previous choice afterwards."""
    from polaformer.ops.dispatch import set_attention_backend

    previous = set_attention_backend("triton")
    yield
    set_attention_backend(previous)


@pytest.fixture
def device():
    """Where the kernels' inputs live: CUDA when present, else the CPU (under the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
