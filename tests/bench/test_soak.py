"""benchmarks/bench_soak.py: its smoke mode trains both runs through the command line and records every step; its
growth criterion fails a run whose memory or time per step grows."""
import csv
import importlib.util

from conftest import REPO


def _soak():
    spec = importlib.util.spec_from_file_location("bench_soak", REPO / "benchmarks" / "bench_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_mode_records_every_step_of_both_runs(tmp_path, capsys):
    soak = _soak()
    path = tmp_path / "soak.csv"
    assert soak.main_soak(soak.parse_args(["--smoke", "--csv", str(path)])) == 0
    rows = list(csv.DictReader(path.open()))
    steps = {run: [int(r["step"]) for r in rows if r["run"] == run] for run in ("lm", "digits")}
    per_epoch = soak.DIGITS_TRAIN // soak.SMOKE_DIGITS_BATCH
    digits = -(-soak.SMOKE_STEPS // per_epoch) * per_epoch  # whole epochs
    assert steps == {"lm": list(range(1, soak.SMOKE_STEPS + 1)), "digits": list(range(1, digits + 1))}
    assert all(int(r["rss_kib"]) > 0 and int(r["wall_us"]) > 0 and int(r["cpu_us"]) >= 0 for r in rows)
    table = capsys.readouterr().out
    assert f"| lm | {soak.SMOKE_STEPS} |" in table and f"| digits | {digits} |" in table


def test_growth_criterion_flags_memory_and_time_that_grow():
    soak = _soak()
    flat = [(800_000, 20_000, 10_000)] * 400
    assert not soak.verdict(flat)["rss_grew"] and not soak.verdict(flat)["cpu_grew"]
    leak = [(800_000 + 40 * i, 20_000, 10_000) for i in range(400)]  # 40 KiB a step: 7.8 MiB between the quarters
    assert soak.verdict(leak)["rss_grew"] and not soak.verdict(leak)["cpu_grew"]
    slower = [(800_000, 20_000, 10_000 + 50 * i) for i in range(400)]  # 10 ms -> 27.5 ms a step
    assert soak.verdict(slower)["cpu_grew"] and not soak.verdict(slower)["rss_grew"]
    jitter = [(800_000 + (i % 7) * 512, 20_000, 10_000 + (i % 5) * 2_000) for i in range(400)]  # flat, noisy
    assert not soak.verdict(jitter)["rss_grew"] and not soak.verdict(jitter)["cpu_grew"]
