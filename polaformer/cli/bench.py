"""``polaformer bench``: the attention op and model scaling benchmarks (the parser and a thin call)."""
from __future__ import annotations

import os

from .common import positive_int, usage_error

__all__ = ["add_bench_parser"]


def add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="attention op and model speed/memory scaling, with a matmul roofline (writes JSON + plots)",
        description="(a) op level: fused Pola vs SDPA softmax vs ELU+1 and focused linear attention, forward and "
                    "forward+backward, over N tokens; (b) model level: images/s and peak memory of Pola-PVT-T and "
                    "Pola-Swin-T against softmax attention over input sizes; (c) large-matmul GFLOP/s and each op's "
                    "roofline fraction. Writes DIR/results.json, DIR/bench_ops.png, DIR/bench_models.png.",
    )
    bench.add_argument("--out", required=True, metavar="DIR", help="output folder")
    bench.add_argument("--tokens", type=positive_int, nargs="+", metavar="N",
                       help="op sequence lengths (default: 196 1024 4096 16384 65536; --quick: 196 1024 4096)")
    bench.add_argument("--heads", type=positive_int, default=8, help="op heads (default: %(default)s)")
    bench.add_argument("--head-dim", type=positive_int, default=64, help="op head size, even (default: %(default)s)")
    bench.add_argument("--sizes", type=positive_int, nargs="+", metavar="S",
                       help="model input sizes (default: 224 448 640 1024; --quick: 224)")
    bench.add_argument("--models", nargs="+", metavar="NAME", choices=["pola_pvt_tiny", "pola_swin_t"],
                       help="models to compare with their softmax variants (default: pola_pvt_tiny pola_swin_t)")
    bench.add_argument("--no-models", action="store_true", help="skip the model-level part")
    bench.add_argument("--min-run-time", type=float, metavar="S",
                       help="seconds per measurement (default: 1.0; --quick: 0.05)")
    bench.add_argument("--max-softmax-tokens", type=positive_int, default=16384, metavar="N",
                       help="skip SDPA above this N (O(N²); default: %(default)s)")
    bench.add_argument("--matmul-size", type=positive_int, metavar="S",
                       help="square matmul for the machine's GFLOP/s (default: 4096; --quick: 1024)")
    bench.add_argument("--no-op-memory", action="store_true",
                       help="skip the per-N peak-memory subprocesses of the fused op")
    bench.add_argument("--quick", action="store_true", help="fewer, smaller measurements (explicit options win)")
    bench.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..benchmarks.suite import (
        DEFAULT_MODELS, DEFAULT_SIZES, DEFAULT_TOKENS, QUICK_SIZES, QUICK_TOKENS, BenchConfig, run_bench,
    )

    if args.head_dim % 2:
        return usage_error("bench", f"--head-dim must be even (Pola splits values in two), got {args.head_dim}")
    min_run_time = args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0)
    if not min_run_time > 0:
        return usage_error("bench", f"--min-run-time must be > 0, got {args.min_run_time}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return usage_error("bench", f"--out {args.out!r} exists and is not a folder")
    config = BenchConfig(
        out=args.out,
        tokens=tuple(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)),
        heads=args.heads, head_dim=args.head_dim,
        sizes=tuple(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)),
        models=() if args.no_models else tuple(args.models or DEFAULT_MODELS),
        min_run_time=min_run_time, max_softmax_tokens=args.max_softmax_tokens,
        matmul_size=args.matmul_size or (1024 if args.quick else 4096),
        op_memory=not args.no_op_memory, quick=args.quick,
    )
    results = run_bench(config, log=lambda msg: print(msg, flush=True))
    exponent = results["op_summary"].get("fused_pola_fwd_bwd_exponent")
    exponent_text = "n/a (needs 2 sizes in 4096..65536)" if exponent is None else f"{exponent:.3f} (N 4096..65536)"
    print(f"fused Pola fwd+bwd time exponent {exponent_text}; wrote results.json, {', '.join(results['plots'])} "
          f"-> {args.out} ({results['wall_time_s']:.0f} s)")
    return 0
