"""Start-up time of the ``polaformer`` command: ``--help``, a subcommand's ``--help`` and an argument error, each a
whole ``python -m polaformer`` process timed from outside (wall clock, start to exit), with the interpreter alone
and ``import torch`` / ``import timm`` as yardsticks.

    python benchmarks/bench_startup.py [--runs 15] [--checkout DIR ...] [--markdown]

Every (checkout, command) pair runs ``--runs`` times, the pairs taken in turn (A B C ... A B C ...) so a machine
whose speed drifts moves them alike; the table gives the median, min and max seconds. ``--checkout`` (repeatable)
times the package of other checkouts side by side (``PYTHONPATH`` set to each), e.g. one from before issue 51.
docs/cli.md holds the figures.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (label, arguments after the interpreter, exit status expected)
COMMANDS = [
    ("polaformer --help", ["-m", "polaformer", "--help"], 0),
    ("polaformer train --help", ["-m", "polaformer", "train", "--help"], 0),
    ("polaformer lm train --help", ["-m", "polaformer", "lm", "train", "--help"], 0),
    ("polaformer train --epochs 0 (an argument error)", ["-m", "polaformer", "train", "--epochs", "0"], 2),
]
YARDSTICKS = [
    ("python -c pass", ["-c", "pass"], 0),
    ("python -c 'import torch'", ["-c", "import torch"], 0),
    ("python -c 'import timm'", ["-c", "import timm"], 0),
]


def time_once(arguments: list[str], checkout: Path | None, expected: int) -> float:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *arguments], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=checkout or REPO, timeout=300)
    seconds = time.perf_counter() - start
    if result.returncode != expected:
        raise SystemExit(f"{' '.join(arguments)} in {checkout}: exit {result.returncode}, expected {expected}: "
                         f"{result.stderr.decode(errors='replace')[-500:]}")
    return seconds


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        avx512 = " avx512f" in info
    except (OSError, StopIteration):
        avx512 = False
    return f"{name}, {os.cpu_count()} CPUs{', AVX-512' if avx512 else ''}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each command (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first, for the file cache")
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="also time the package of this checkout (repeatable; default: this one only)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    checkouts = [REPO, *[c.resolve() for c in args.checkout]]
    pairs = [(label, arguments, expected, checkout) for checkout in checkouts
             for label, arguments, expected in COMMANDS]
    pairs += [(label, arguments, expected, None) for label, arguments, expected in YARDSTICKS]
    times: dict[int, list[float]] = {i: [] for i in range(len(pairs))}
    for round_ in range(args.warmup + args.runs):
        for i, (_, arguments, expected, checkout) in enumerate(pairs):
            seconds = time_once(arguments, checkout, expected)
            if round_ >= args.warmup:
                times[i].append(seconds)
    print(f"{machine()}; {args.runs} runs each, interleaved; wall seconds from start to exit")
    rows = []
    for i, (label, _, _, checkout) in enumerate(pairs):
        where = "" if checkout is None else (checkout.name if len(checkouts) > 1 else "")
        values = times[i]
        rows.append((label + (f" [{where}]" if where else ""), statistics.median(values), min(values), max(values)))
    width = max(len(row[0]) for row in rows)
    if args.markdown:
        print("| command | median (s) | min | max |\n| --- | --- | --- | --- |")
        for label, median, low, high in rows:
            print(f"| `{label}` | {median:.2f} | {low:.2f} | {high:.2f} |")
    else:
        print(f"{'command':<{width}}  median     min     max")
        for label, median, low, high in rows:
            print(f"{label:<{width}}  {median:6.2f}  {low:6.2f}  {high:6.2f}")


if __name__ == "__main__":
    main()
