"""`polaformer bench gpu --smoke`: every method once at a tiny shape on the CPU, the Triton kernels in the
interpreter, through the command line in a fresh process (the interpreter must be chosen before triton
defines the kernels)."""
import csv
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")


def test_smoke_run_writes_a_row_per_method_and_mode(tmp_path):
    out = tmp_path / "gpu.csv"
    env = {**os.environ, "TRITON_INTERPRET": "1", "POLAFORMER_NATIVE": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "polaformer", "bench", "gpu", "--smoke", "--dtypes", "bf16",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    cells = {(row["method"], row["mode"]) for row in rows}
    assert {("pola_triton", "fwd"), ("pola_triton", "fwd_bwd"), ("pola_torch", "fwd_bwd"), ("sdpa", "fwd")} <= cells
    assert all(row["error"] == "" and float(row["ms"]) > 0 and row["dtype"] == "bf16" for row in rows)
