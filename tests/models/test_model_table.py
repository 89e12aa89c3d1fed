"""The README's model table is generated, never typed: it must equal the script's output."""
import importlib.util

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "model_table.py"


@pytest.mark.slow
def test_readme_model_table_is_current():
    spec = importlib.util.spec_from_file_location("model_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "run: python scripts/model_table.py --write"
