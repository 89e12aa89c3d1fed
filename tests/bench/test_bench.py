"""`polaformer bench`: output structure on tiny sizes, the roofline helpers, one-line CLI errors."""
from __future__ import annotations

import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from polaformer.bench.scaling import (  # noqa: E402
    DEFAULT_METHODS,
    OP_METHODS,
    _child_op_memory,
    count_flops,
    fit_exponent,
    markdown_tables,
    matmul_gflops,
    roofline_fraction,
)
from polaformer.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main([
        "bench", "--quick", "--out", str(out), "--tokens", "64", "128", "--sizes", "32",
        "--models", "pola_pvt_tiny", "--min-run-time", "0.002", "--matmul-size", "128",
        "--max-softmax-tokens", "64", "--no-op-memory",
    ])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_quick_run_writes_results_and_plots(quick_run):
    out, res = quick_run
    assert res["plots"] == ["bench_ops.png", "bench_models.png"]
    for name in res["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
    assert res["matmul"]["size"] == 128 and res["matmul"]["gflops"] > 0
    # The roofline is the faster of the matmul rates measured before and after the ops.
    assert res["roofline_reference_gflops"] == max(res["matmul"]["gflops"], res["matmul_after"]["gflops"])
    assert res["config"]["tokens"] == [64, 128] and res["config"]["heads"] == 8

    # Every (N, method, mode) has a row; SDPA above --max-softmax-tokens is marked skipped.
    ops = {(r["tokens"], r["method"], r["mode"]): r for r in res["ops"]}
    assert set(ops) == {(n, m, mode) for n in (64, 128) for m in DEFAULT_METHODS for mode in ("fwd", "fwd_bwd")}
    assert ops[(128, "sdpa_softmax", "fwd_bwd")]["skipped"]
    assert "max-softmax-tokens" in ops[(128, "sdpa_softmax", "fwd")]["reason"]
    for key, row in ops.items():
        if row["skipped"]:
            continue
        assert row["seconds"] > 0 and row["flops"] > 0
        assert row["roofline_fraction"] == pytest.approx(row["gflops"] / res["roofline_reference_gflops"])
    # Backward costs FLOPs too.
    assert ops[(128, "fused_pola", "fwd_bwd")]["flops"] > ops[(128, "fused_pola", "fwd")]["flops"]

    summary = res["op_summary"]
    assert summary["exponent_range"] == [4096, 65536]
    assert summary["fused_pola_fwd_bwd_exponent"] is None  # no N in 4096..65536 here
    assert set(summary["speedup_vs_sdpa"]["fwd_bwd"]) == {"64"}

    models = res["models"]
    assert [(r["model"], r["attention"], r["size"]) for r in models] == [
        ("pola_pvt_tiny", "pola", 32), ("pola_pvt_tiny", "softmax", 32)]
    for row in models:
        assert "error" not in row, row
        assert row["images_per_s"] > 0 and row["peak_memory_mb"] > 0 and row["forward_peak_mb"] >= 0
    assert models[1]["attn_type"] == "SSSS"


def test_methods_option_adds_the_two_stream_formulation(tmp_path):
    out = tmp_path / "ops"
    code = main(["bench", "--out", str(out), "--tokens", "64", "--methods", "fused_pola", "two_stream_pola",
                 "--no-models", "--no-op-memory", "--min-run-time", "0.002", "--matmul-size", "64", "--batch", "2"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["methods"] == ["fused_pola", "two_stream_pola"] and res["config"]["batch"] == 2
    assert {(r["method"], r["mode"]) for r in res["ops"]} == {
        (m, mode) for m in ("fused_pola", "two_stream_pola") for mode in ("fwd", "fwd_bwd")}
    assert res["models"] == [] and res["plots"] == ["bench_ops.png"]
    assert "two_stream_pola / fused_pola (fwd_bwd): N=64:" in markdown_tables(res)


def test_two_stream_formulation_computes_the_fused_op():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 50, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(1, 3, 1, 16, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(OP_METHODS["two_stream_pola"](q, k, v, w), OP_METHODS["fused_pola"](q, k, v, w))


def test_op_memory_child_reports_a_peak():
    row = _child_op_memory({"tokens": 256, "heads": 2, "head_dim": 16, "method": "fused_pola", "threads": 1})
    assert row["tokens"] == 256 and row["input_mb"] > 0
    assert row["peak_rss_mb"] >= row["baseline_rss_mb"] and row["op_peak_mb"] >= 0


def test_roofline_helpers():
    mm = matmul_gflops(256, min_run_time=0.01)
    assert mm["gflops"] > 0.1
    # A matmul timed against the machine's matmul rate is a roofline fraction near 1.
    frac = roofline_fraction(2 * 256**3, mm["seconds"], mm["gflops"])
    assert frac == pytest.approx(1.0)
    assert roofline_fraction(1e9, 1.0, 4.0) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        roofline_fraction(1e9, 0.0, 4.0)
    # FLOP counting: SDPA forward is two (N×N×d) matmuls per head, 2 FLOPs per multiply-add.
    n, h, d = 128, 2, 16
    assert count_flops(OP_METHODS["sdpa_softmax"], n, h, d, "fwd") == 2 * 2 * n * n * d * h
    assert count_flops(OP_METHODS["fused_pola"], 4 * n, h, d, "fwd") == pytest.approx(
        4 * count_flops(OP_METHODS["fused_pola"], n, h, d, "fwd"), rel=0.05)


def test_fit_exponent():
    tokens = [1024, 4096, 16384, 65536]
    assert fit_exponent(tokens, [n**1.5 * 1e-9 for n in tokens]) == pytest.approx(1.5)
    assert fit_exponent(tokens, [1.0] * 4) == pytest.approx(0.0)
    assert fit_exponent([1024, 4096], [1.0, 2.0]) is None  # one point in 4096..65536
    assert math.isclose(fit_exponent([10, 100], [1.0, 10.0], lo=1, hi=1000), 1.0)


@pytest.mark.parametrize("argv, message", [
    (["bench"], "the following arguments are required: --out"),
    (["bench", "--out", "x", "--tokens", "0"], "--tokens: must be a positive integer"),
    (["bench", "--out", "x", "--head-dim", "63"], "--head-dim must be even"),
    (["bench", "--out", "x", "--min-run-time", "0"], "--min-run-time must be > 0"),
    (["bench", "--out", "x", "--models", "resnet50"], "invalid choice: 'resnet50'"),
    (["bench", "--out", "x", "--methods", "flash"], "unknown --methods flash; known: fused_pola"),
    (["bench", "official", "--models", "resnet50"], "no official counterpart for 'resnet50'"),
    (["bench", "official", "--min-time", "0"], "--min-time must be > 0"),
    (["bench", "native", "--rounds", "0"], "--rounds: must be a positive integer"),
    (["bench", "pacs", "--min-time", "-1"], "--min-time must be > 0"),
    (["bench", "dense", "--sizes", "12x"], "size must be HxW or S in pixels, got '12x'"),
    (["bench", "deploy", "--out", "x", "--variants", "tensorrt"], "unknown variant(s) 'tensorrt'"),
    (["bench", "deploy"], "the following arguments are required: --out"),
    (["bench", "lra", "--out", "x", "--attentions", "nope"], "unknown attention(s) 'nope'"),
    (["bench", "nope"], "invalid choice: 'nope'"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("polaformer") and message in err, err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["bench", "--out", str(target), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err
