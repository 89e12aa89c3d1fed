"""`polaformer lra bench` (Table 6 on this machine): output files, ratios, errors — on tiny sizes."""
from __future__ import annotations

import json

import pytest

from polaformer.bench.lra import compute_ratios, markdown_table, run_lra_bench

ATTENTIONS = ("softmax", "pola")
LENGTHS = (64, 128)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lra_bench")
    lines = []
    result = run_lra_bench(out, attentions=list(ATTENTIONS), lengths=list(LENGTHS), batch_size=2, steps=1,
                           log=lines.append, timeout_s=120)
    return out, result, lines


@pytest.mark.slow
def test_writes_the_three_files(tiny_run):
    out, result, lines = tiny_run
    assert result["files"] == ["results.json", "table.md", "bench_lra.png"]
    for name in result["files"]:
        assert (out / name).is_file()
    assert (out / "bench_lra.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["wall_time_s"] > 0
    assert lines and any("pola" in line for line in lines)


@pytest.mark.slow
def test_rows_are_ordered_by_length_and_all_measured(tiny_run):
    out, result, _ = tiny_run
    rows = result["rows"]
    # Each length's attentions run back to back.
    assert [(r["length"], r["attention"]) for r in rows] == [(n, a) for n in LENGTHS for a in ATTENTIONS]
    for r in rows:
        assert "error" not in r, r
        assert r["samples_per_s"] > 0 and r["peak_memory_mb"] > 0
        assert r["batch_size"] == 2 and len(r["step_times"]) == 1 and r["loss_finite"]


@pytest.mark.slow
def test_results_json_and_ratios(tiny_run):
    out, result, _ = tiny_run
    res = json.loads((out / "results.json").read_text())
    assert res["machine"]["torch"] and res["machine"]["threads"] >= 1 and "cpu_model" in res["machine"]
    s = res["settings"]
    assert s["lengths"] == list(LENGTHS) and s["attentions"] == list(ATTENTIONS)
    assert s["batch_size"] == 2 and s["steps"] == 1 and s["device"] == "cpu"
    assert len(res["rows"]) == len(LENGTHS) * len(ATTENTIONS)
    for n in LENGTHS:
        per = res["ratios"][str(n)]
        assert per["softmax"] == {"throughput": 1.0, "memory": 1.0}
        for a in ATTENTIONS:
            assert per[a]["throughput"] > 0 and per[a]["memory"] > 0
    assert res["ratios"]["average"]["softmax"]["throughput"] == 1.0
    assert res["ratios"]["average"]["softmax"]["memory"] == 1.0
    for r in res["rows"]:
        ref = next(x for x in res["rows"] if x["length"] == r["length"] and x["attention"] == "softmax")
        assert r["throughput_ratio"] == pytest.approx(r["samples_per_s"] / ref["samples_per_s"])
        assert r["memory_ratio"] == pytest.approx(r["peak_memory_mb"] / ref["peak_memory_mb"])


@pytest.mark.slow
def test_markdown_lists_every_attention_and_length(tiny_run):
    out, _, _ = tiny_run
    md = (out / "table.md").read_text()
    for a in ATTENTIONS:
        assert f"| {a} |" in md
    for n in LENGTHS:
        assert f"**{n}**" in md
    assert "average" in md and "(1.00×)" in md


def test_unknown_attention_is_a_one_line_value_error(tmp_path):
    with pytest.raises(ValueError, match="known: softmax") as err:
        run_lra_bench(tmp_path, attentions=["softmax", "nope"], lengths=[64], steps=1)
    assert "\n" not in str(err.value) and "'nope'" in str(err.value)
    assert not (tmp_path / "results.json").exists()


def test_failed_measurement_is_recorded_and_ratios_skip_it():
    rows = [
        {"attention": "softmax", "length": 64, "samples_per_s": 2.0, "peak_memory_mb": 10.0},
        {"attention": "pola", "length": 64, "samples_per_s": 4.0, "peak_memory_mb": 5.0},
        {"attention": "softmax", "length": 128, "error": "timed out after 1 s"},
        {"attention": "pola", "length": 128, "samples_per_s": 3.0, "peak_memory_mb": 6.0},
    ]
    ratios = compute_ratios(rows)
    assert ratios["64"]["pola"] == {"throughput": 2.0, "memory": 0.5}
    assert ratios["128"]["pola"] == {"throughput": None, "memory": None}
    assert ratios["average"]["pola"] == {"throughput": 2.0, "memory": 0.5, "lengths": 1}
    results = {"rows": rows, "ratios": ratios,
               "settings": {"batch_size": 2, "steps": 1, "lengths": [64, 128]},
               "machine": {"device": "cpu", "cpu_model": "x", "threads": 1, "torch": "t"}}
    md = markdown_table(results)
    assert "error: timed out after 1 s" in md and "n/a" in md
