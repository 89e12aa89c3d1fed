"""What every benchmark family shares: timing, peak memory in a fresh process, the machine, result files, plots.

Timing is ``torch.utils.benchmark`` after a warm-up call. Steps compared with each other are timed
*interleaved*: every round takes one sample of each step in turn, so load from other processes on the
cores hits all of them alike, and the median over rounds is reported.

Peak memory on CPU is the resident set of one call above the resident set just before it, in a fresh
interpreter per measurement (:func:`run_child`) so that every peak is its own: glibc is told to unmap
every freed buffer over 64 KiB (:func:`release_freed_buffers`) and the kernel's peak-RSS mark is reset
right before the call (:func:`reset_peak_rss`).
"""
from __future__ import annotations

import csv
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
from torch.utils import benchmark

__all__ = [
    "time_call",
    "interleaved",
    "medians",
    "release_freed_buffers",
    "reset_peak_rss",
    "rss_now_bytes",
    "peak_rss_bytes",
    "run_child",
    "check_device",
    "machine_info",
    "loadavg",
    "write_text",
    "write_json",
    "write_csv",
    "markdown_table",
    "pyplot",
    "log_log_axes",
    "save_figure",
]


# --------------------------------------------------------------------------- timing

def _timer(step: Callable[[], object], threads: int | None) -> benchmark.Timer:
    return benchmark.Timer("step()", globals={"step": step}, num_threads=threads or torch.get_num_threads())


def time_call(step: Callable[[], object], min_run_time: float, best: bool = False, threads: int | None = None) -> float:
    """Median (or, with ``best``, fastest) seconds per call of ``step`` after one warm-up, via blocked_autorange."""
    step()
    m = _timer(step, threads).blocked_autorange(min_run_time=min_run_time)
    return float(min(m.times) if best else m.median)


def interleaved(steps: dict, rounds: int, min_time: float, *, calls: int | str | None = None,
                threads: int | None = None) -> dict[str, list[float]]:
    """Seconds per call of every step, one sample per step and round, the steps taken in turn within a round.

    Each step is called once first (allocator, thread pools, primitive caches). A sample is
    ``blocked_autorange(min_time)``'s median when ``calls`` is None; ``calls`` back-to-back calls when an
    int (whole models, whose single calls are noisy); with ``"auto"``, as many back-to-back calls as fill
    ``min_time``, counted once per step from one timed call.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    timers, numbers = {}, {}
    for key, step in steps.items():
        step()
        timers[key] = _timer(step, threads)
        if calls == "auto":
            numbers[key] = max(1, round(min_time / timers[key].timeit(1).mean))
        elif calls is not None:
            numbers[key] = int(calls)
    samples = {key: [] for key in steps}
    for _ in range(rounds):
        for key, timer in timers.items():
            if key in numbers:
                samples[key].append(timer.timeit(numbers[key]).mean)
            else:
                samples[key].append(timer.blocked_autorange(min_run_time=min_time).median)
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {key: statistics.median(values) for key, values in samples.items()}


# --------------------------------------------------------------------------- memory

def rss_now_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_buffers() -> bool:
    """glibc: serve every buffer over 64 KiB by mmap and unmap it on free (fixed threshold, no dynamic growth).

    Then the RSS after a warm-up call is the true baseline, and the peak above it is what one call
    needs. ``tune_cpu_allocator`` (buffer reuse, for timing) goes after the memory measurement, since
    retained buffers would hide the peak.
    """
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.mallopt(-3, 1 << 16) == 1 and libc.mallopt(-1, 1 << 16) == 1  # M_MMAP/M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux ≥ 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS of this process: VmHWM (since the last :func:`reset_peak_rss`), else ``ru_maxrss``.

    VmHWM first because ``ru_maxrss`` survives fork+exec on Linux: a child started by a big parent
    would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def run_child(module: str, kind: str, spec: dict, timeout: float | None = None) -> dict:
    """Run ``module.CHILDREN[kind](spec)`` in a fresh interpreter; its result dict, or ``{"error": ...}``."""
    code = (f"import json, sys; from {module} import CHILDREN; "
            f"print('@@' + json.dumps(CHILDREN[{kind!r}](json.loads(sys.argv[1]))))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    error = f"exit status {proc.returncode}: {tail}"
    if proc.returncode == -9:
        error += " (killed: out of memory?)"
    return {"error": error}


# --------------------------------------------------------------------------- the machine

def check_device(device: str) -> str:
    """``device`` normalised (``cpu`` or ``cuda[:i]``); ValueError naming the problem otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: {err}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:i], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return str(dev)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> float | None:
    """The 1-minute load average: other processes on the cores slow every measurement."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def machine_info(device: str = "cpu", allocator_reuse: bool | None = None) -> dict:
    """Where a result was measured: CPU, its vector ISA, threads, library versions, the device."""
    info = {"cpu_model": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": device}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if allocator_reuse is not None:
        info["allocator_reuse"] = allocator_reuse
    return info


# --------------------------------------------------------------------------- result files

def write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`polaformer.engine.output.write_output`): a reader sees the old
    file or the whole new one."""
    from ..engine.output import write_output

    write_output(path, lambda f: f.write(text.encode()))


def write_json(path, data) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def write_csv(path, rows: list[dict]) -> None:
    """One line per row; the columns are every scalar field that any row has, in first-seen order."""
    columns = list(dict.fromkeys(k for row in rows for k, v in row.items()
                                 if v is None or isinstance(v, (str, int, float, bool))))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue())


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table, one line per row (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots

def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_log_axes(ax, xlabel: str, ylabel: str, title: str | None = None, x_base: int = 10) -> None:
    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(fig, path, dpi: int) -> None:
    from ..engine.output import write_output

    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, format=Path(path).suffix.lstrip(".") or "png", dpi=dpi))
    pyplot().close(fig)
