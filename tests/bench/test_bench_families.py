"""`polaformer bench FAMILY`: a smoke run of every family on tiny sizes, through the command line."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from polaformer.backends.cpu.native import native_kernels
from polaformer.bench import harness
from polaformer.bench.native import run_native
from polaformer.cli import main

# The torch ops, not the native kernels: these runs check the benchmarks, not the kernels, and should not
# wait on a native build that another process holds.
TORCH_OPS_ONLY = {"POLAFORMER_NATIVE": "0"}


@pytest.fixture
def torch_ops_only(monkeypatch):
    """This process and its children run without the native kernels."""
    for key, value in TORCH_OPS_ONLY.items():
        monkeypatch.setenv(key, value)


def test_official_script_keeps_its_path_and_flags(tmp_path):
    """benchmarks/bench_models_vs_official.py runs `polaformer bench official` (the official-way baseline
    needs no checkout of the authors' code)."""
    files = {kind: tmp_path / f"out.{kind}" for kind in ("json", "md", "csv")}
    env = {**os.environ, **TORCH_OPS_ONLY, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_models_vs_official.py"), "--models", "pola_pvt_v2_b0",
         "--batches", "1", "--modes", "infer", "--threads", "1", "--rounds", "1", "--min-time", "0.001",
         "--floor", "--matmul-floor", "--json", str(files["json"]), "--markdown", str(files["md"]),
         "--csv", str(files["csv"])],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(files["json"].read_text())
    (row,) = result["rows"]
    assert row["model"] == "pola_pvt_v2_b0" and row["mode"] == "infer" and row["batch"] == 1
    assert row["ratio"] == pytest.approx(row["official_ms"] / row["ours_ms"])
    assert row["floor_ms"] > 0 and row["products_ms"] > 0 and len(row["samples_ms"]["ours"]) == 1
    assert result["meta"]["threads"] == 1 and result["meta"]["rounds"] == 1
    table = files["md"].read_text()
    assert "| pola_pvt_v2_b0 |" in table and "bound official/floor" in table and "bound official/products" in table
    (csv_row,) = csv.DictReader(files["csv"].open())
    assert csv_row["model"] == "pola_pvt_v2_b0" and float(csv_row["ratio"]) > 0 and "samples_ms" not in csv_row


def test_native_against_torch_ops():
    if native_kernels() is None:
        pytest.skip("native kernels unavailable here")
    lines = []
    rows = run_native(threads=1, rounds=1, min_time=0.001, pola_shapes=[(1, 2, 64, 16)],
                      pacs_shapes=[(1, 2, 8, 16)], log=lines.append)
    assert [(r["case"], r["mode"]) for r in rows] == [
        (case, mode) for case in ("pola (1, 2, 64, 16)", "pacs+rope (1, 2, 8, 16)") for mode in ("infer", "train")]
    for r in rows:
        assert r["torch ops"] > 0 and r["native"] > 0 and r["ratio"] == pytest.approx(r["torch ops"] / r["native"])
    assert len(lines) == len(rows)


def test_pacs_fused_against_functional(tmp_path, capsys, torch_ops_only):
    out = tmp_path / "pacs.json"
    assert main(["bench", "pacs", "--batch", "1", "--threads", "1", "--rounds", "1", "--min-time", "0.001",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["heads"], r["tokens"], r["mode"]) for r in rows] == [
        (h, n, mode) for h, n in ((1, 3136), (2, 784), (4, 196)) for mode in ("fwd", "fwd_bwd")]
    assert all(r["ratio"] == pytest.approx(r["functional_ms"] / r["fused_ms"]) for r in rows)
    assert "| 1 × 3136 × 32 | fwd |" in capsys.readouterr().out


@pytest.mark.slow
def test_dense_backbones_pola_against_softmax(tmp_path, capsys, torch_ops_only):
    out = tmp_path / "dense.json"
    assert main(["bench", "dense", "--sizes", "64", "--min-run-time", "0.001", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["Pola-PVT-T", "PVT-T (softmax)", "Pola-Swin-T", "Swin-T (softmax)"]
    for r in rows:
        assert "error" not in r, r
        assert r["size"] == "64x64" and r["time_s"] > 0 and r["peak_MiB"] >= 0 and r["params_M"] > 1
    table = capsys.readouterr().out
    assert "| 64x64 | Pola-PVT-T |" in table and "softmax / Pola time" in table


def test_deploy_variants(tmp_path, capsys, torch_ops_only):
    out = tmp_path / "deploy"
    assert main(["bench", "deploy", "--out", str(out), "--models", "pola_pvt_v2_b0", "--batches", "1",
                 "--img-size", "64", "--variants", "eager_fp32", "eager_channels_last", "--threads", "1",
                 "--rounds", "1", "--min-run-time", "0.001"]) == 0
    res = json.loads((out / "results.json").read_text())
    (row,) = res["rows"]
    assert set(row["images_per_s"]) == {"eager_fp32", "eager_channels_last"} and not row["errors"]
    assert row["ratio_to_eager_fp32"]["eager_fp32"] == 1.0
    assert row["max_abs_diff"]["eager_channels_last"] < 1e-3 * max(1.0, row["ref_max_abs"])
    assert res["environment"]["threads"] == 1 and res["environment"]["inductor_cache"] == "cold"
    assert "| pola_pvt_v2_b0 | 1 |" in (out / "table.md").read_text()
    assert "| pola_pvt_v2_b0 | 1 |" in capsys.readouterr().out


def test_interleaved_takes_one_sample_per_step_and_round():
    calls = {"a": 0, "b": 0}

    def step(key):
        def run():
            calls[key] += 1
        return run

    samples = harness.interleaved({"a": step("a"), "b": step("b")}, rounds=3, min_time=0.001, calls=2)
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert all(s > 0 for v in samples.values() for s in v)
    # a warm-up call, then per sample Timer.timeit's own warm-up and the 2 timed calls
    assert calls["a"] == calls["b"] >= 1 + 3 * 2
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        harness.interleaved({"a": step("a")}, rounds=0, min_time=0.001)


def test_result_files_are_written_whole(tmp_path):
    rows = [{"a": 1, "b": "x", "nested": {"skip": True}}, {"a": 2, "c": None}]
    harness.write_csv(tmp_path / "rows.csv", rows)
    assert (tmp_path / "rows.csv").read_text() == "a,b,c\n1,x,\n2,,\n"
    harness.write_json(tmp_path / "rows.json", rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv", "rows.json"]  # no temporary left behind
    assert harness.markdown_table(["x", "y"], [[1, 2]]) == "| x | y |\n|---|---|\n| 1 | 2 |"
