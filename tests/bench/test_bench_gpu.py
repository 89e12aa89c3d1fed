"""`polaformer bench gpu --smoke`: every method once at tiny shapes on the CPU, the Triton kernels in the
interpreter, through the command line in a fresh process (the interpreter must be chosen before triton
defines the kernels); and how a run records a method that fails and stops at its time limit."""
import csv
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from polaformer.bench import gpu

triton = pytest.importorskip("triton")


@pytest.mark.slow
def test_smoke_run_writes_a_row_per_method_and_mode(tmp_path):
    """As a user types it: the command chooses Triton's interpreter itself, before torch imports triton (setting
    it later left triton's own library functions compiled, and every Triton row failed)."""
    out = tmp_path / "gpu.csv"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update({"POLAFORMER_NATIVE": "0", "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-m", "polaformer", "bench", "gpu", "--smoke", "--dtypes", "bf16",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    cells = {(row["method"], row["mode"], row["causal"]) for row in rows}
    assert {("pola_triton", "fwd", "False"), ("pola_triton", "fwd_bwd", "False"), ("pola_torch", "fwd_bwd", "False"),
            ("sdpa", "fwd", "False"), ("pola_triton", "fwd_bwd", "True"), ("sdpa", "fwd_bwd", "True")} <= cells
    assert all(row["error"] == "" and float(row["ms"]) > 0 and row["dtype"] == "bf16" for row in rows)
    # compiled and CUDA-graph timings are GPU-only: each row gives the reason in place of a time
    assert all(row["compiled_ms"] == row["graph_ms"] == ""
               and row["compiled_error"] == row["graph_error"] == "CUDA only" for row in rows)
    machine = (f"cpu ({platform.machine()})", torch.__version__, triton.__version__)
    assert all((row["device"], row["torch"], row["triton"]) == machine for row in rows)


def test_a_failing_method_is_a_row_with_its_reason(monkeypatch):
    def broken(q, k, v, extra):
        raise RuntimeError("no kernel for this shape\nsecond line")

    def sdpa(q, k, v, extra):
        return F.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(gpu, "methods", lambda shape, smoke: {"broken": gpu.Method(broken), "sdpa": gpu.Method(sdpa)})
    rows = gpu.run_gpu(smoke=True, dtypes=("fp32",), modes=("fwd",), log=lambda line: None)
    assert [(row["method"], row["error"], row["ms"] is None) for row in rows[:2]] == [
        ("broken", "no kernel for this shape", True), ("sdpa", None, False)]


def test_past_the_time_limit_no_row_starts():
    lines, written = [], []
    rows = gpu.run_gpu(smoke=True, time_limit=1e-9, log=lines.append, on_shape_done=written.append)
    assert rows == [] and written == [[]] and lines == ["time limit of 1e-09 s reached: 0 rows"]
