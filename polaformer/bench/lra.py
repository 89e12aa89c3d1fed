"""``polaformer bench lra`` (also ``polaformer lra bench``): the paper's Table 6 (appendix A.3), measured here.

For every (sequence length, attention) the Long Range Arena model of :mod:`polaformer.tasks.lra.model`
(the paper's LRA setting: dim 64, FFN 128, 2 heads × 32, 2 layers; vocabulary 512, 10
classes, ``max_len`` = the length, the attention with its default options) runs full training
steps — forward, cross-entropy, backward, AdamW step — on random tokens of exactly that length,
in a fresh subprocess so that every peak memory is its own. Per measurement:

1. one warm-up step (thread pools, AdamW state, one-off allocations);
2. one memory step: on CPU the peak resident memory of that step above the resident memory
   just before it (glibc set to unmap every freed buffer over 64 KiB, the kernel's peak-RSS
   mark reset right before: :mod:`polaformer.bench.harness`);
   on CUDA ``torch.cuda.max_memory_allocated`` over that step (model, optimizer state and
   activations);
3. the CPU allocator switched to buffer reuse (:func:`polaformer.runtime.tune_cpu_allocator`)
   and one untimed step to refill its heap;
4. ``steps`` timed steps (``time.perf_counter``, CUDA synchronised); throughput is the batch
   size over the median step time.

The attentions of one length run back to back, and each length's throughput and memory are
also given as ratios to softmax attention's, as in the paper. Lengths 1024, 2048 and 4096 are
those of the tasks (Image and Pathfinder 1K, ListOps 2K, Text and Retrieval 4K); a Retrieval
example is two such sequences, which this benchmark does not model.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..engine.output import make_folder
from ..runtime import tune_cpu_allocator
from .harness import (
    check_device,
    loadavg,
    log_log_axes,
    machine_info,
    markdown_table as table,
    peak_rss_bytes,
    pyplot,
    release_freed_buffers,
    reset_peak_rss,
    rss_now_bytes,
    run_child,
    save_figure,
    write_json,
    write_text,
)

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_STEPS",
    "REFERENCE",
    "run_lra_bench",
    "compute_ratios",
    "markdown_table",
    "write_plot",
]

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_BATCH_SIZE = 4
DEFAULT_STEPS = 3
DEFAULT_TIMEOUT_S = 600.0
WARMUP_STEPS = 1
VOCAB_SIZE = 512
NUM_CLASSES = 10
REFERENCE = "softmax"
TASKS = {1024: "Image, Pathfinder", 2048: "ListOps", 4096: "Text, Retrieval"}


# --------------------------------------------------------------------------- the child

def _train_child(spec: dict) -> dict:
    """Throughput and peak memory of training steps of one (attention, length); runs in a fresh process."""
    from torch.nn import functional as F

    from ..tasks.lra.model import LRAClassifier, LRAModelConfig

    release_freed_buffers()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec.get("seed", 0))
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    cfg = LRAModelConfig(vocab_size=spec["vocab_size"], num_classes=spec["num_classes"], max_len=spec["length"],
                         attention=spec["attention"])
    model = LRAClassifier(cfg).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    batch, length = spec["batch_size"], spec["length"]
    tokens = torch.randint(0, cfg.vocab_size, (batch, length), device=device)
    labels = torch.randint(0, cfg.num_classes, (batch,), device=device)
    losses = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens, None), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(spec["warmup_steps"]):
        step()

    optimizer.zero_grad(set_to_none=True)  # the measured step allocates its gradients itself
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        reset = reset_peak_rss()
        base = rss_now_bytes()
    step()
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        memory = {"peak_memory_mb": peak / 2**20, "baseline_memory_mb": base / 2**20,
                  "step_memory_mb": max(0, peak - base) / 2**20,
                  "memory_source": "torch.cuda.max_memory_allocated over one training step "
                                   "(model, optimizer state, batch and activations)"}
    else:
        peak = peak_rss_bytes()
        memory = {"peak_memory_mb": max(0, peak - base) / 2**20, "baseline_memory_mb": base / 2**20,
                  "process_peak_mb": peak / 2**20,
                  "memory_source": "peak RSS of one training step above the RSS before it "
                                   + ("(VmHWM reset before the step)" if reset else "(process ru_maxrss)")}

    tune_cpu_allocator()  # buffer reuse for the timing, after the memory step (it would hide the peak)
    step()  # refills the now-retaining heap: not timed
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    final_loss = float(losses[-1])
    return {
        "attention": spec["attention"], "length": length, "batch_size": batch,
        "params": sum(p.numel() for p in model.parameters()),
        "step_seconds": seconds, "best_step_seconds": min(times), "step_times": times,
        "samples_per_s": batch / seconds,
        "loss": final_loss, "loss_finite": bool(torch.isfinite(torch.tensor(final_loss))),
        **memory,
    }


CHILDREN = {"train": _train_child}


# --------------------------------------------------------------------------- driver helpers

def _emit(msg: str, log: Callable[[str], None] | None) -> None:
    logger.info(msg)
    if log is not None:
        log(msg)


def _resolve_attentions(attentions) -> list[str]:
    from ..tasks.lra.attention import ATTENTIONS

    if attentions is None:
        names = list(ATTENTIONS)
    else:
        names = list(dict.fromkeys(attentions))
        unknown = [a for a in names if a not in ATTENTIONS]
        if unknown:
            raise ValueError(f"unknown attention(s) {', '.join(map(repr, unknown))}; known: {', '.join(ATTENTIONS)}")
        if not names:
            raise ValueError(f"no attention given; known: {', '.join(ATTENTIONS)}")
    if REFERENCE not in names:  # the ratios need it
        names.insert(0, REFERENCE)
    return names


def _positive_ints(values, name: str) -> list[int]:
    out = list(dict.fromkeys(values))
    if not out or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in out):
        raise ValueError(f"{name} must be positive integers, got {values!r}")
    return out


def _ok(row: dict) -> bool:
    return "error" not in row


def compute_ratios(rows: list[dict], reference: str = REFERENCE) -> dict:
    """Per length (str key) and attention, throughput and peak memory over the reference's (None where missing).

    Also fills ``throughput_ratio``/``memory_ratio`` into every row, and adds ``"average"``: each
    attention's ratios averaged (arithmetic mean) over the lengths where both it and the reference
    were measured — the average row of the paper's table.
    """
    ratios: dict = {}
    for length in dict.fromkeys(r["length"] for r in rows):
        ref = next((r for r in rows if r["length"] == length and r["attention"] == reference and _ok(r)), None)
        per = ratios[str(length)] = {}
        for r in rows:
            if r["length"] != length:
                continue
            t = m = None
            if ref is not None and _ok(r):
                t = r["samples_per_s"] / ref["samples_per_s"]
                m = r["peak_memory_mb"] / ref["peak_memory_mb"] if ref["peak_memory_mb"] > 0 else None
            r["throughput_ratio"], r["memory_ratio"] = t, m
            per[r["attention"]] = {"throughput": t, "memory": m}
    average = {}
    for name in dict.fromkeys(r["attention"] for r in rows):
        entry = {}
        for key in ("throughput", "memory"):
            vals = [per[name][key] for per in ratios.values() if name in per and per[name][key] is not None]
            entry[key] = sum(vals) / len(vals) if vals else None
        entry["lengths"] = sum(1 for per in ratios.values() if name in per and per[name]["throughput"] is not None)
        average[name] = entry
    ratios["average"] = average
    return ratios


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def markdown_table(results: dict) -> str:
    """Table 6 shape: a row block per length (T and M per attention, ratio to softmax in parentheses), then the
    average."""
    rows = results["rows"]
    settings = results["settings"]
    machine = results["machine"]
    mem_unit = "MB above the step's baseline RSS" if machine["device"] == "cpu" else "MB, max_memory_allocated"
    lines = [
        f"Training throughput T (samples/s) and peak memory M ({mem_unit}) of the LRA model, "
        f"batch {settings['batch_size']}, median of {settings['steps']} timed step(s); "
        f"ratios to {REFERENCE} in parentheses.",
        f"Machine: {machine['cpu_model']}, {machine['threads']} threads, torch {machine['torch']}, "
        f"device {machine['device']}" + (f" ({machine['gpu']})" if machine.get("gpu") else "") + ".",
        "",
    ]
    cells = []
    for length in settings["lengths"]:
        label = f"**{length}" + (f" ({TASKS[length]})" if length in TASKS else "") + "**"
        for i, r in enumerate(r for r in rows if r["length"] == length):
            head = "" if i else label
            if not _ok(r):
                cells.append([head, r["attention"], f"error: {r['error']}", ""])
                continue
            cells.append([head, r["attention"], f"{r['samples_per_s']:.2f} ({_fmt_ratio(r['throughput_ratio'])})",
                          f"{r['peak_memory_mb']:.1f} ({_fmt_ratio(r['memory_ratio'])})"])
    for i, (name, avg) in enumerate(results["ratios"]["average"].items()):
        cells.append(["" if i else "**average ratio**", name, f"({_fmt_ratio(avg['throughput'])})",
                      f"({_fmt_ratio(avg['memory'])})"])
    lines += [table(["length", "attention", "T (samples/s)", "M (MB)"], cells)]
    lines += ["", f"Average: the arithmetic mean over the lengths of each attention's ratios to {REFERENCE}."]
    failed = [r for r in rows if not _ok(r)]
    if failed:
        lines.append(f"{len(failed)} measurement(s) failed; see results.json.")
    return "\n".join(lines) + "\n"


def write_plot(results: dict, path: Path, dpi: int = 80) -> None:
    """Two log-log panels: throughput and peak memory against sequence length, one line per attention."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    rows = [r for r in results["rows"] if _ok(r)]
    names = list(dict.fromkeys(r["attention"] for r in results["rows"]))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:pink", "tab:gray", "tab:olive",
               "tab:cyan", "gold", "navy", "teal", "salmon"]
    fixed = {REFERENCE: "black", "pola": "tab:red", "pacs": "tab:purple"}
    others = iter(palette * (1 + len(names) // len(palette)))
    markers = "os^vD<>phX*P"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for i, name in enumerate(names):
        sel = sorted((r for r in rows if r["attention"] == name), key=lambda r: r["length"])
        if not sel:
            continue
        style = dict(marker=markers[i % len(markers)], label=name, lw=1.2, ms=5,
                     color=fixed.get(name) or next(others))
        if name in fixed:
            style.update(lw=2.2)
        lengths = [r["length"] for r in sel]
        axes[0].plot(lengths, [r["samples_per_s"] for r in sel], **style)
        axes[1].plot(lengths, [max(r["peak_memory_mb"], 1e-3) for r in sel], **style)
    settings, machine = results["settings"], results["machine"]
    mem_label = ("peak memory above step baseline (MB)" if machine["device"] == "cpu"
                 else "peak memory, max_memory_allocated (MB)")
    for ax, ylabel, title in ((axes[0], "training throughput (samples/s)", "throughput"),
                              (axes[1], mem_label, "peak memory")):
        log_log_axes(ax, "sequence length", ylabel, title, x_base=2)
        ax.set_xticks(settings["lengths"], [str(n) for n in settings["lengths"]])
        ax.xaxis.set_minor_formatter(NullFormatter())
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"LRA training step, batch {settings['batch_size']}, {machine['device']} "
                 f"({machine['threads']} threads)")
    save_figure(fig, path, dpi)


# --------------------------------------------------------------------------- driver

def run_lra_bench(out, *, attentions=None, lengths=None, batch_size=None, steps=None, device="cpu",
                  log: Callable[[str], None] | None = None, timeout_s: float | None = None) -> dict:
    """Measure training throughput and peak memory of every (attention, length); write the Table 6 files.

    ``attentions``: names of :data:`polaformer.tasks.lra.attention.ATTENTIONS` (default all; softmax is
    added as the ratios' reference if missing). ``lengths`` default 1024 2048 4096, ``batch_size``
    4, ``steps`` 3 timed steps (after a warm-up, a memory step and an allocator refill step).
    ``timeout_s`` bounds each subprocess (default 600 s). A failed or timed-out measurement is kept
    as a row with an ``error`` and the run goes on. Raises ``ValueError`` for an unknown attention,
    bad lengths/batch/steps or an unusable device.

    Writes ``results.json``, ``table.md`` and ``bench_lra.png`` into ``out``; returns
    ``{"files": [...], "wall_time_s": ..., "rows": [...]}``.
    """
    names = _resolve_attentions(attentions)
    lengths = _positive_ints(DEFAULT_LENGTHS if lengths is None else lengths, "lengths")
    batch_size = _positive_ints([DEFAULT_BATCH_SIZE if batch_size is None else batch_size], "batch_size")[0]
    steps = _positive_ints([DEFAULT_STEPS if steps is None else steps], "steps")[0]
    device = check_device(device)
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    out = Path(out)
    make_folder(out)

    started = time.perf_counter()
    threads = torch.get_num_threads()
    settings = {"attentions": names, "lengths": lengths, "batch_size": batch_size, "steps": steps,
                "warmup_steps": WARMUP_STEPS, "device": device, "timeout_s": timeout, "threads": threads,
                "vocab_size": VOCAB_SIZE, "num_classes": NUM_CLASSES, "reference": REFERENCE,
                "model": "LRAModelConfig defaults (dim 64, hidden 128, 2 heads x 32, 2 layers, dropout 0.1), "
                         "max_len = length, attention default options",
                "optimizer": "AdamW(lr=1e-4, weight_decay=0.01)",
                "protocol": "warm-up step; memory step; allocator refill step; `steps` timed steps (median)"}
    _emit(f"lra bench: {len(names)} attention(s) x {len(lengths)} length(s), batch {batch_size}, "
          f"{steps} timed step(s), {device}, {threads} threads -> {out}", log)
    rows = []
    for length in lengths:
        for name in names:
            spec = {"attention": name, "length": length, "batch_size": batch_size, "steps": steps,
                    "warmup_steps": WARMUP_STEPS, "device": device, "threads": threads,
                    "vocab_size": VOCAB_SIZE, "num_classes": NUM_CLASSES, "seed": 0}
            t0, load0 = time.perf_counter(), loadavg()
            row = run_child(__name__, "train", spec, timeout=timeout)
            row.update(attention=name, length=length, batch_size=batch_size,
                       child_wall_s=time.perf_counter() - t0, loadavg_1m=[load0, loadavg()])
            rows.append(row)
            if _ok(row):
                _emit(f"L={length:>5} {name:<11} {row['samples_per_s']:9.2f} samples/s "
                      f"({row['step_seconds'] * 1e3:9.1f} ms/step)  peak {row['peak_memory_mb']:9.1f} MB", log)
            else:
                _emit(f"L={length:>5} {name:<11} failed: {row['error']}", log)

    ratios = compute_ratios(rows)
    results = {"machine": machine_info(device), "settings": settings, "rows": rows, "ratios": ratios}
    results["wall_time_s"] = time.perf_counter() - started  # the measurements
    write_text(out / "table.md", markdown_table(results))
    write_plot(results, out / "bench_lra.png")
    results["wall_time_s"] = time.perf_counter() - started  # and the files
    write_json(out / "results.json", results)
    files = ["results.json", "table.md", "bench_lra.png"]
    _emit(f"lra bench done in {results['wall_time_s']:.0f} s: {', '.join(files)}", log)
    return {"files": files, "wall_time_s": results["wall_time_s"], "rows": rows}
