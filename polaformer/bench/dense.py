"""Backbone forward time and peak memory at detection resolutions: Pola vs softmax attention, side by side.

Pola-PVT-T (``pola_pvt_tiny``, linear attention in every stage) against the softmax PVT-T of the same
size (``attn_type='SSSS'``: spatial-reduction attention with PVT's reduction ratios 8/4/2/1), and
Pola-Swin-T (official layout: global linear attention in stages 1-2, 7x7 softmax windows in 3-4)
against Swin-T with 7x7 softmax windows everywhere (``attn_type='SSSS'``). Feature-pyramid
forward (``features_only``, what a detector runs), batch 1, inference mode, float32.

Every (model, size) runs in its own subprocess so that peak memory is its own: on CUDA
``torch.cuda.max_memory_allocated`` during the forward, on CPU the peak resident set of one forward
over the resident set before it (:mod:`polaformer.bench.harness`). Times: torch.utils.benchmark, median.

    polaformer bench dense                          # 512, 800x1344, 1024, 1536
    polaformer bench dense --sizes 512 1024x1024 --json out.json --device cuda
"""
from __future__ import annotations

from typing import Callable

import torch

from .harness import (
    check_device,
    machine_info,
    markdown_table,
    peak_rss_bytes,
    release_freed_buffers,
    reset_peak_rss,
    rss_now_bytes,
    run_child,
    time_call,
)

MODELS = {
    "Pola-PVT-T": ("pola_pvt_tiny", {}),
    "PVT-T (softmax)": ("pola_pvt_tiny", {"attn_type": "SSSS"}),
    "Pola-Swin-T": ("pola_swin_t", {}),
    "Swin-T (softmax)": ("pola_swin_t", {"attn_type": "SSSS"}),
}
PAIRS = (("Pola-PVT-T", "PVT-T (softmax)"), ("Pola-Swin-T", "Swin-T (softmax)"))
DEFAULT_SIZES = ("512", "800x1344", "1024", "1536")


def parse_size(text: str) -> tuple[int, int]:
    """``HxW`` or ``S`` (square) as (height, width); ValueError naming the text otherwise."""
    h, sep, w = text.partition("x")
    if not (h.isdigit() and (w.isdigit() or not sep)) or int(h) < 1 or (sep and int(w) < 1):
        raise ValueError(f"size must be HxW or S in pixels, got {text!r}")
    return int(h), int(w or h)


def _child_forward(spec: dict) -> dict:
    """Build, warm up, measure one forward's peak memory, then time; runs in a fresh process."""
    import timm

    import polaformer.models  # noqa: F401  (registers the families)
    from polaformer import accelerate

    release_freed_buffers()
    device = torch.device(spec["device"])
    name, kwargs = MODELS[spec["model"]]
    model = accelerate(timm.create_model(name, features_only=True, **kwargs).eval(), inference=True).to(device)
    x = torch.randn(1, 3, *spec["size"], device=device)

    def forward():
        with torch.inference_mode():
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()

    forward()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        reset_peak_rss()
        base = rss_now_bytes()
        forward()
        peak = max(0, peak_rss_bytes() - base)
    return {"model": spec["model"], "size": "x".join(map(str, spec["size"])),
            "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
            "time_s": time_call(forward, spec["min_run_time"]), "peak_MiB": peak / 2**20}


CHILDREN = {"forward": _child_forward}


def run_dense(*, sizes=DEFAULT_SIZES, device: str = "cpu", min_run_time: float = 1.0,
              log: Callable[[str], None] = print) -> list[dict]:
    """One row per (size, model); a failed measurement is a row with an ``error``."""
    device = check_device(device)
    parsed = [parse_size(s) for s in sizes]
    rows = []
    for size in parsed:
        for label in MODELS:
            row = run_child(__name__, "forward", {"model": label, "size": size, "device": device,
                                                  "min_run_time": min_run_time})
            row.update(model=label, size="x".join(map(str, size)))
            rows.append(row)
            log(f"{label} {row['size']}: " + (f"failed ({row['error']})" if "error" in row else
                                             f"{row['time_s']:.3f} s, {row['peak_MiB']:.0f} MiB"))
    return rows


def table(rows: list[dict], device: str) -> str:
    """Pola and softmax rows per size, with softmax / Pola time and memory on the Pola row."""
    machine = machine_info(device)
    by_key = {(r["model"], r["size"]): r for r in rows}
    cells = []
    for size in dict.fromkeys(r["size"] for r in rows):
        for pola, softmax in PAIRS:
            a, b = by_key.get((pola, size)), by_key.get((softmax, size))
            for r in (a, b):
                if r is None or "error" in r:
                    continue
                ratio_t = ratio_m = ""
                if r is a and b and "error" not in b:
                    ratio_t = f"{b['time_s'] / a['time_s']:.2f}x"
                    ratio_m = f"{b['peak_MiB'] / max(a['peak_MiB'], 1e-9):.2f}x"
                cells.append([size, r["model"], f"{r['params_M']:.1f}", f"{r['time_s']:.3f}", f"{r['peak_MiB']:.0f}",
                              ratio_t, ratio_m])
    return (f"{machine['cpu_model']}, torch {machine['torch']}, device {device}, {machine['threads']} threads, "
            "batch 1, float32, features_only forward\n\n"
            + markdown_table(["size", "model", "params (M)", "time (s)", "peak memory (MiB)", "softmax / Pola time",
                              "softmax / Pola memory"], cells) + "\n")
