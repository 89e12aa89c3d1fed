"""Backbone forward time and peak memory at detection resolutions: Pola vs softmax attention, side by side.

Pola-PVT-T (``pola_pvt_tiny``, linear attention in every stage) against the softmax PVT-T of the same
size (``attn_type='SSSS'``: spatial-reduction attention with PVT's reduction ratios 8/4/2/1), and
Pola-Swin-T (official layout: global linear attention in stages 1-2, 7x7 softmax windows in 3-4)
against Swin-T with 7x7 softmax windows everywhere (``attn_type='SSSS'``). Feature-pyramid
forward (``features_only``, what a detector runs), batch 1, inference mode, float32.

Every (model, size) runs in its own subprocess so that peak memory is its own: on CUDA
``torch.cuda.max_memory_allocated`` during the forward, on CPU the growth of the process's peak
resident set over its size before the forward (ru_maxrss). Times: torch.utils.benchmark, median.

    python benchmarks/bench_dense.py                          # 512, 800x1344, 1024, 1536
    python benchmarks/bench_dense.py --sizes 512 1024x1024 --json out.json --device cuda
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys

MODELS = {
    "Pola-PVT-T": ("pola_pvt_tiny", {}),
    "PVT-T (softmax)": ("pola_pvt_tiny", {"attn_type": "SSSS"}),
    "Pola-Swin-T": ("pola_swin_t", {}),
    "Swin-T (softmax)": ("pola_swin_t", {"attn_type": "SSSS"}),
}
PAIRS = (("Pola-PVT-T", "PVT-T (softmax)"), ("Pola-Swin-T", "Swin-T (softmax)"))


def parse_size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w or h)


def measure(label: str, size: tuple[int, int], device: str, min_run_time: float) -> dict:
    """Run in the child: build, warm up, time, and report the forward's peak memory."""
    import timm
    import torch
    from torch.utils import benchmark

    import polaformer.models  # noqa: F401  (registers the families)

    name, kwargs = MODELS[label]
    model = timm.create_model(name, features_only=True, **kwargs).eval().to(device)
    x = torch.randn(1, 3, *size, device=device)
    params = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        if device == "cuda":
            model(x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model(x)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            base = _rss_now()
            model(x)
            peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)
        timer = benchmark.Timer("model(x)", globals={"model": model, "x": x}, num_threads=torch.get_num_threads())
        time = timer.blocked_autorange(min_run_time=min_run_time).median
    return {"model": label, "size": f"{size[0]}x{size[1]}", "params_M": params / 1e6, "time_s": time,
            "peak_MiB": peak / 2**20}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["512", "800x1344", "1024", "1536"],
                        help="HxW or S (square); multiples of 32 (800x1333 is padded to 800x1344 by the detectors)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timing per measurement")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], parse_size(args.child[1]), args.device, args.min_run_time)))
        return

    rows = []
    for size in args.sizes:
        for label in MODELS:
            cmd = [sys.executable, __file__, "--device", args.device, "--min-run-time", str(args.min_run_time),
                   "--child", label, size]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                rows.append({"model": label, "size": size, "error": last})
                print(f"{label} {size}: failed ({last})", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)

    import torch

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} threads, batch 1, float32, features_only forward")
    print("| size | model | params (M) | time (s) | peak memory (MiB) | softmax / Pola time | softmax / Pola memory |")
    print("|---|---|---|---|---|---|---|")
    by_key = {(r["model"], r["size"]): r for r in rows}
    for size in args.sizes:
        size = "x".join(map(str, parse_size(size)))
        for pola, softmax in PAIRS:
            a, b = by_key.get((pola, size)), by_key.get((softmax, size))
            for r in (a, b):
                if r is None or "error" in r:
                    continue
                ratio_t = ratio_m = ""
                if r is a and b and "error" not in b and a and "error" not in a:
                    ratio_t = f"{b['time_s'] / a['time_s']:.2f}x"
                    ratio_m = f"{b['peak_MiB'] / max(a['peak_MiB'], 1e-9):.2f}x"
                print(f"| {size} | {r['model']} | {r['params_M']:.1f} | {r['time_s']:.3f} | {r['peak_MiB']:.0f} | "
                      f"{ratio_t} | {ratio_m} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
