"""Soak: a test-sized ``polaformer lm train`` and a digits ``polaformer train``, each for thousands of optimizer
steps in this process, with the resident memory (RSS, /proc/self/statm) and the time of every step recorded; the
script fails (exit 1) if either grows. Linux only (it reads /proc). Not a CI test: minutes, not seconds.

    python benchmarks/bench_soak.py                       # 3,000 steps each, CSV benchmarks/results/soak.csv
    python benchmarks/bench_soak.py --steps 2000 --csv benchmarks/results/soak_zen5.csv
    python benchmarks/bench_soak.py --smoke               # a few steps of each, no verdict: the script works

Each command runs through ``polaformer.cli.main`` as typed; a global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) samples after every step. The CSV has one row per
step: run, step, RSS (KiB), wall and CPU time since the previous step (microseconds). Evaluations and checkpoint
writes fall inside some steps' times; the medians below do not see them.

Growth criterion, per run: the median over the last quarter of the steps against the median over the second
quarter (the first quarter is warm-up: the allocator's pools, lazily built kernels and caches fill there).
- RSS may grow by at most 4 MiB. A leak worth finding keeps something per step: a retained autograd graph or
  activation of these models is 100 KiB or more per step (well over 4 MiB between the quarters, which are hundreds
  of steps apart), a loss tensor kept in a list about 0.5 KiB (0.25 MiB over 500 steps: below, as are the run's
  own history records, a few hundred bytes per evaluation). glibc's heap moves in steps of its trim and mmap
  thresholds (128 KiB up to a few MiB), which bounds the jitter of a flat run.
- CPU time per step (this process's, all threads) may grow by at most 25%. Work that grows with the step count
  (a scan of a growing list, a checkpoint that grows) doubles it between the quarters at most a few thousand steps
  in; CPU time, unlike wall time, hardly moves when the machine is shared, and the medians of hundreds of steps
  drop the evaluations and the outliers.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from polaformer.cli import main

RSS_GROWTH_MIB = 4.0
CPU_GROWTH = 1.25
DIGITS_TRAIN = 1437  # images of the digits training split (batches drop the last partial one)
SMOKE_STEPS, SMOKE_DIGITS_BATCH = 10, 256
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def cpu_name() -> str:
    """The CPU's model name and family (/proc/cpuinfo)."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')})"


def rss_kib() -> int:
    """This process's resident memory: /proc/self/statm's second field, in pages."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_KIB


def commands(steps: int, folder: Path, digits_batch: int = 32) -> dict[str, list[str]]:
    """The two runs: a test-sized LM (pola_lm_tiny, context 16, batch 4) and a one-block digits classifier, for at
    least ``steps`` updates each (the classifier in whole epochs)."""
    eval_every = max(1, steps // 6)
    epochs = max(1, -(-steps // (DIGITS_TRAIN // digits_batch)))
    return {
        "lm": ["lm", "train", "--context", "16", "--steps", str(steps), "--batch-size", "4", "--max-bytes", "20000",
               "--eval-every", str(eval_every), "--device", "cpu", "--output", str(folder / "lm"), "--opts",
               "model.name", "pola_lm_tiny", "train.eval_batches", "2", "train.warmup_steps", "10"],
        "digits": ["train", "--model", "pola_deit_digits", "--model-kwarg", "depth=1", "--epochs", str(epochs),
                   "--batch-size", str(digits_batch), "--device", "cpu", "--output", str(folder / "digits")],
    }


def soak(argv: list[str]) -> list[tuple[int, int, int]]:
    """Run ``polaformer ARGV``; returns (RSS KiB, wall us, CPU us) of every optimizer step."""
    samples = []
    last = [time.perf_counter(), time.process_time()]

    def after_step(optimizer, args, kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        samples.append((rss_kib(), round((wall - last[0]) * 1e6), round((cpu - last[1]) * 1e6)))
        last[:] = wall, cpu

    handle = register_optimizer_step_post_hook(after_step)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the summary line; the log goes to stderr
            code = main(argv)
    finally:
        handle.remove()
    if code != 0:
        raise SystemExit(f"polaformer {' '.join(argv)} exited with {code}")
    return samples


def quarters(values: list[float]) -> tuple[float, float]:
    """Medians of the second and of the last quarter."""
    n = len(values)
    return statistics.median(values[n // 4:n // 2]), statistics.median(values[3 * n // 4:])


def verdict(samples: list[tuple[int, int, int]]) -> dict:
    rss = quarters([s[0] / 1024 for s in samples])
    cpu = quarters([s[2] / 1000 for s in samples])
    wall = quarters([s[1] / 1000 for s in samples])
    return {"steps": len(samples), "rss_mib": rss, "cpu_ms": cpu, "wall_ms": wall,
            "rss_grew": rss[1] - rss[0] > RSS_GROWTH_MIB, "cpu_grew": cpu[1] > CPU_GROWTH * cpu[0]}


def main_soak(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    sizes = (SMOKE_STEPS, SMOKE_DIGITS_BATCH) if args.smoke else (args.steps, 32)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, argv in commands(sizes[0], Path(folder), sizes[1]).items():
            if name in args.runs:
                results[name] = soak(argv)
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["run", "step", "rss_kib", "wall_us", "cpu_us"])
            for name, samples in results.items():
                writer.writerows([name, step, *sample] for step, sample in enumerate(samples, start=1))
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s); "
          f"medians of the second -> last quarter of the steps")
    print("| run | steps | RSS (MiB) | CPU ms/step | wall ms/step | grew |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    failed = False
    for name, samples in results.items():
        v = verdict(samples)
        grew = [what for what, flag in (("RSS", v["rss_grew"]), ("CPU time", v["cpu_grew"])) if flag]
        failed |= bool(grew) and not args.smoke
        print(f"| {name} | {v['steps']} | {v['rss_mib'][0]:.1f} -> {v['rss_mib'][1]:.1f} | "
              f"{v['cpu_ms'][0]:.2f} -> {v['cpu_ms'][1]:.2f} | {v['wall_ms'][0]:.2f} -> {v['wall_ms'][1]:.2f} | "
              f"{', '.join(grew) or 'no'} |")
    if failed:
        print(f"growth beyond {RSS_GROWTH_MIB} MiB of RSS or x{CPU_GROWTH} of CPU time per step", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps of each run (default 3000)")
    parser.add_argument("--runs", nargs="+", choices=("lm", "digits"), default=["lm", "digits"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the least disturbed)")
    parser.add_argument("--csv", help="per-step rows (default: benchmarks/results/soak.csv; none with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="10 steps of each (digits at batch 256), no verdict: check that the script runs")
    args = parser.parse_args(argv)
    if args.csv is None and not args.smoke:
        args.csv = "benchmarks/results/soak.csv"
    if args.steps < 8:
        parser.error(f"--steps must be at least 8 (four quarters of two steps), got {args.steps}")
    return args


if __name__ == "__main__":
    sys.exit(main_soak(parse_args()))
