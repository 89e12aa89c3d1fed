"""Time the causal Pola op's training step on one CUDA GPU for docs/causal.md.

    python scripts/causal_gpu_bench.py --out causal_gpu.csv

Forward + backward (gradients of q, k, v) of ``causal_pola_linear_attention`` on the fused Triton kernels
(backend ``triton``) and in the torch formulation (backend ``torch``), and of
``scaled_dot_product_attention(is_causal=True)``, for B = 1, H = 8, head_dim 64 and N = 1k to 32k, in bf16 and
fp32. Times are ``triton.testing.do_bench`` medians in milliseconds; ``error`` is the relative RMS difference
between the Triton and torch outputs. A point that runs out of GPU memory is recorded as ``oom``; points left
when ``--time-limit`` seconds have passed are skipped. Prints a Markdown table and writes the CSV after every
point. ``--device cpu`` with ``TRITON_INTERPRET=1`` runs the same loop in Triton's interpreter with wall-clock
timing (a smoke test of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import csv
import time

import torch
import torch.nn.functional as F

from polaformer.ops import causal_pola_linear_attention, dispatch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
METHODS = ("triton", "torch", "sdpa")
FIELDS = ("tokens", "dtype", "method", "ms", "peak_mib", "error")


def _milliseconds(fn, device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _step(method, q, k, v, power, grad_out, chunk_size):
    """One forward + backward; returns the output."""
    if method == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        previous = dispatch.set_attention_backend(method)
        try:
            out = causal_pola_linear_attention(q, k, v, power, chunk_size=chunk_size)
        finally:
            dispatch.set_attention_backend(previous)
    torch.autograd.grad(out, (q, k, v), grad_out)
    return out


def _inputs(n, dtype, args, device):
    """q, k, v, power and the output gradient of one point, shared by the three methods."""
    q, k, v = (torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    power = torch.full((1, args.heads, 1, args.head_dim), 3.0, device=device)
    return q, k, v, power, torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype)


def _measure(method, inputs, chunk_size, device):
    """(ms, peak MiB, output) of one method at one point, or ("oom", "", None)."""
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out = _step(method, *inputs, chunk_size).detach()
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
        ms = _milliseconds(lambda: _step(method, *inputs, chunk_size), device)
    except torch.OutOfMemoryError:
        return "oom", "", None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ms, peak, out


def _relative_rms(actual, expected) -> float:
    expected = expected.double()
    return ((actual.double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def _cell(x, digits=2) -> str:
    return x if isinstance(x, str) else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="CSV path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=80.0, help="seconds; later points are skipped")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"triton {__import__('triton').__version__}; B = 1, H = {args.heads}, head_dim {args.head_dim}, "
              f"chunk {args.chunk_size}; forward + backward, ms (do_bench median)\n")
    print("| tokens | dtype | Pola Triton | Pola torch | SDPA causal | torch ÷ Triton | SDPA ÷ Triton | "
          "Triton vs torch |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    start = time.perf_counter()
    with open(args.out, "w", newline="") as file:
        writer = csv.DictWriter(file, FIELDS)
        writer.writeheader()
        for dtype_name in args.dtypes:
            for n in args.lengths:
                if time.perf_counter() - start > args.time_limit:
                    print(f"| {n:,} | {dtype_name} | skipped: past --time-limit {args.time_limit:g} s |||||")
                    continue
                torch.manual_seed(0)
                try:
                    inputs = _inputs(n, DTYPES[dtype_name], args, device)
                except torch.OutOfMemoryError:
                    print(f"| {n:,} | {dtype_name} | oom (inputs) |||||")
                    continue
                results = {m: _measure(m, inputs, args.chunk_size, device) for m in METHODS}
                del inputs
                outputs = results["triton"][2], results["torch"][2]
                error = _relative_rms(*outputs) if all(o is not None for o in outputs) else float("nan")
                for method, (ms, peak, _) in results.items():
                    writer.writerow(dict(tokens=n, dtype=dtype_name, method=method, ms=ms, peak_mib=peak,
                                         error=error if method == "triton" else ""))
                file.flush()
                triton_ms, torch_ms, sdpa_ms = (results[m][0] for m in METHODS)
                ratios = [b / triton_ms if not isinstance(b, str) and not isinstance(triton_ms, str) else "–"
                          for b in (torch_ms, sdpa_ms)]
                print(f"| {n:,} | {dtype_name} | {_cell(triton_ms)} | {_cell(torch_ms)} | {_cell(sdpa_ms)} | "
                      f"{_cell(ratios[0], 1)}× | {_cell(ratios[1], 1)}× | {error:.1e} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; CSV: {args.out}")


if __name__ == "__main__":
    main()
