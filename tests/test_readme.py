"""The README's Python examples run as written and print what their comments claim."""
import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_two_setup_commands_first():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("polaformer train")
    # ruff, the suite, then the numerics-sensitive tests on torch's scalar kernels (tests/README.md)
    assert first_block[1].endswith(
        "ruff check . && python -m pytest -q && ATEN_CPU_CAPABILITY=default python -m pytest -q -m numerics")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_and_prints_its_claims(index):
    """Each ``print(...)  # CLAIM`` line prints CLAIM (``tensor(True)``, a shape), in order."""
    claims = re.findall(r"^print\(.*\)\s*#\s*(.+?)\s*$", BLOCKS[index], flags=re.M)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(BLOCKS[index], f"README block {index}", "exec"), {})
    assert printed.getvalue().splitlines() == claims


def test_readme_claims_the_padded_sequence_matches_its_unpadded_self():
    assert any("# tensor(True)" in block for block in BLOCKS)
