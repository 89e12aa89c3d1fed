"""compat.from_official covers every reference vector: strict load of the official state_dict, same output."""
import pytest
import torch

from conftest import REFERENCE, load_vector, official_state_dict, require_reference
from polaformer.compat import from_official

CASES = sorted(p.stem for p in (REFERENCE / "vectors").glob("*.json"))


def test_reference_vectors_present():
    require_reference(REFERENCE / "vectors")
    assert len(CASES) >= 11


@pytest.mark.parametrize("case", CASES)
def test_every_vector_loads_strictly_and_matches(case):
    record, tensors = load_vector(case)
    module = from_official(record).double()
    assert set(module.state_dict()) == set(record["state_dict_keys"])
    module.load_state_dict(official_state_dict(tensors), strict=True)
    module.eval()
    args = record["forward_args"]
    with torch.no_grad():
        if "sin" in args:
            out = module(tensors["input"], tensors["sin"], tensors["cos"])
        elif "H" in args:
            out = module(tensors["input"], args["H"], args["W"])
        else:
            out = module(tensors["input"])
    tol = record["tolerance_hint"] * max(1.0, record["output_abs_max"])
    assert (out - tensors["output"]).abs().max().item() <= tol
