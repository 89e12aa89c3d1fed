"""``polaformer bench [FAMILY]``: the scaling suite, or one benchmark family of :mod:`polaformer.bench`."""
from __future__ import annotations

import argparse
import os
import sys

from .common import add_overwrite, positive_int, usage_error

__all__ = ["add_bench_parser", "add_lra_bench_arguments"]


def add_bench_parser(commands) -> None:
    """``polaformer bench``: the scaling suite itself, or one benchmark family named after it."""
    bench = commands.add_parser(
        "bench", help="speed and memory benchmarks: op/model scaling with a matmul roofline by default, or a FAMILY",
        description="Without FAMILY: (a) op level: fused Pola vs SDPA softmax vs ELU+1 and focused linear attention "
                    "(and, with --methods, the official two-stream formulation), forward and forward+backward, over N "
                    "tokens; (b) model level: images/s and peak memory of Pola-PVT-T and Pola-Swin-T against softmax "
                    "attention over input sizes; (c) large-matmul GFLOP/s and each op's roofline fraction. Writes "
                    "DIR/results.json, DIR/bench_ops.png, DIR/bench_models.png. 'polaformer bench FAMILY --help' "
                    "describes the others.",
    )
    # --out is checked in cmd_bench: a required option here would be demanded of every FAMILY too.
    bench.add_argument("--out", metavar="DIR", help="output folder (required without FAMILY)")
    bench.add_argument("--tokens", type=positive_int, nargs="+", metavar="N",
                       help="op sequence lengths (default: 196 1024 4096 16384 65536; --quick: 196 1024 4096)")
    bench.add_argument("--heads", type=positive_int, default=8, help="op heads (default: %(default)s)")
    bench.add_argument("--head-dim", type=positive_int, default=64, help="op head size, even (default: %(default)s)")
    bench.add_argument("--batch", type=positive_int, default=1, help="op batch (default: %(default)s)")
    bench.add_argument("--methods", nargs="+", metavar="NAME",
                       help="op methods: fused_pola sdpa_softmax elu_linear focused_linear two_stream_pola "
                            "(default: all but two_stream_pola)")
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
    add_overwrite(bench, "results in --out")
    bench.set_defaults(handler=cmd_bench)
    families = bench.add_subparsers(dest="bench_family", metavar="FAMILY")

    def rows_files(parser, markdown=False):
        parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
        parser.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (scalar fields)")
        if markdown:
            parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
        add_overwrite(parser)

    official = families.add_parser(
        "official", help="whole models against the authors' code: inference and training step, same weights",
        description="Builds the official models from local checkouts (POLAFORMER_OFFICIAL_DIR, "
                    "POLAFORMERPP_OFFICIAL_DIR; a family without one is skipped), loads their weights into ours, "
                    "checks equal outputs, then times both interleaved. Pola-DeiT and Pola-PVTv2 are compared with "
                    "our model running the official formulation. Also: python benchmarks/bench_models_vs_official.py.",
    )
    official.add_argument("--models", nargs="+", metavar="NAME", default=["pola_pvt_tiny", "pola_swin_t", "POLA_b0",
                          "pola_deit_tiny_patch16_224", "pola_pvt_v2_b0"], help="default: all five")
    official.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    official.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"])
    official.add_argument("--threads", type=positive_int, default=2)
    official.add_argument("--rounds", type=positive_int, default=15, help="interleaved rounds (default: %(default)s)")
    official.add_argument("--min-time", type=float, default=0.05, metavar="S",
                          help="seconds per timing sample, at least one step (default: %(default)s)")
    official.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    official.add_argument("--floor", action="store_true",
                          help="also time ours with the attention cores removed (bounds the reachable ratio)")
    official.add_argument("--matmul-floor", action="store_true",
                          help="also time ours with the linear-attention cores reduced to their matrix products")
    rows_files(official, markdown=True)
    official.set_defaults(handler=cmd_bench_family, run_family=_bench_official, seconds_flags=("--min-time",))

    native = families.add_parser(
        "native", help="the native CPU kernels against the torch ops of the same stages, interleaved",
        description="The Pola and PaCS ops at the models' stage shapes (and whole models with --models), inference "
                    "and training, with the native kernels and with the torch ops; ratio torch ops / native.",
    )
    native.add_argument("--models", nargs="*", default=[], metavar="NAME", help="timm names of whole models to time")
    native.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    native.add_argument("--threads", type=positive_int, default=2)
    native.add_argument("--rounds", type=positive_int, default=3)
    native.add_argument("--min-time", type=float, default=0.3, metavar="S", help="seconds per op sample")
    native.add_argument("--model-steps", type=positive_int, default=6, help="steps per whole-model sample")
    rows_files(native)
    native.set_defaults(handler=cmd_bench_family, run_family=_bench_native, seconds_flags=("--min-time",))

    pacs = families.add_parser(
        "pacs", help="PolaFormer++'s fused PaCS op against its functional graph, forward and forward+backward",
        description="Shapes of POLA_b0's linear stages at 224 px (head_dim 32, RoPE on), timed interleaved.",
    )
    pacs.add_argument("--batch", type=positive_int, default=8)
    pacs.add_argument("--threads", type=positive_int, default=2)
    pacs.add_argument("--rounds", type=positive_int, default=5)
    pacs.add_argument("--min-time", type=float, default=0.2, metavar="S")
    rows_files(pacs)
    pacs.set_defaults(handler=cmd_bench_family, run_family=_bench_pacs, seconds_flags=("--min-time",))

    gpu = families.add_parser(
        "gpu", help="the Triton attention kernels against the torch path, SDPA, flash_bla and fla, on a CUDA GPU",
        description="Pola (and PaCS, when its kernels exist) forward and forward+backward, bf16 and fp32, at "
                    "Pola-PVT, Pola-Swin, DiT/high-resolution and causal shapes, eager, under torch.compile and "
                    "replayed from a CUDA graph: triton.testing.do_bench medians and peak memory. --smoke runs "
                    "each method once at tiny shapes on the CPU under TRITON_INTERPRET=1.",
    )
    gpu.add_argument("--out", dest="gpu_csv", metavar="FILE", required=True, help="write the rows as CSV")
    gpu.add_argument("--batch", type=positive_int, default=8, help="images per call (default: %(default)s)")
    gpu.add_argument("--dtypes", nargs="+", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    gpu.add_argument("--modes", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"])
    gpu.add_argument("--models", nargs="+", choices=["pola_pvt", "pola_swin", "dit", "causal"],
                     default=["pola_pvt", "pola_swin", "dit", "causal"],
                     help="row groups, run in the order given (default: all four, as listed)")
    gpu.add_argument("--variants", nargs="*", choices=["compiled", "graph"], default=["compiled", "graph"],
                     help="timings besides eager: torch.compile, CUDA graph replay (default: both; none: eager only)")
    gpu.add_argument("--time-limit", type=float, metavar="S",
                     help="start no row after S seconds (the CSV keeps every shape finished)")
    gpu.add_argument("--smoke", action="store_true", help="one tiny CPU run of every method (no timing)")
    add_overwrite(gpu, "a file at --out")
    gpu.set_defaults(handler=cmd_bench_family, run_family=_bench_gpu, seconds_flags=())

    gpu_models = families.add_parser(
        "gpu-models", help="whole models on a CUDA GPU: training step and inference, ours vs official vs softmax",
        description="Every family (Pola-PVT-T, Pola-PVTv2-b0/b2, Pola-Swin-T, Pola-DeiT-T/S, PolaFormer++ b0/b2, "
                    "PolaDiT-S/2, pola_lm_small at 4096 tokens), bf16 autocast, eager and torch.compile: images/s "
                    "(tokens/s), median ms per step and peak memory, against the official code with the same "
                    "weights (POLAFORMER_OFFICIAL_DIR, POLAFORMERPP_OFFICIAL_DIR; see scripts/prepare_official.sh) "
                    "and the softmax model; --dense adds the backbones' features_only forward+backward at 512 and "
                    "1024 px. A CSV row is written after every measurement. See docs/gpu_models.md.",
    )
    gpu_models.add_argument("--out", dest="gpu_models_csv", metavar="FILE", required=True,
                            help="write the rows as CSV")
    gpu_models.add_argument("--models", nargs="+", metavar="NAME",
                            help="families, by our timm names (default: all, classification first)")
    gpu_models.add_argument("--impls", nargs="+", metavar="IMPL", help="ours official softmax (default: all three)")
    gpu_models.add_argument("--modes", nargs="+", metavar="MODE", help="train infer (default: both)")
    gpu_models.add_argument("--variants", nargs="+", metavar="VARIANT",
                            help="eager compile reduce-overhead (default: eager compile)")
    gpu_models.add_argument("--size", nargs="+", metavar="NAME=SIZE", default=[],
                            help="a family's image side, DiT latent side or LM tokens in place of its own, e.g. "
                                 "pola_deit_tiny_patch16_224=1024 pola_dit_s_2=128 pola_lm_small=8192")
    gpu_models.add_argument("--dense", action="store_true",
                            help="also the backbones with features_only at 512 and 1024 px, forward+backward")
    gpu_models.add_argument("--dense-only", action="store_true",
                            help="the dense rows alone (implies --dense): no classification, DiT or LM rows")
    gpu_models.add_argument("--dense-batch", type=positive_int, default=2, metavar="N",
                            help="images per dense step (default: %(default)s, as detection trains per GPU)")
    gpu_models.add_argument("--steps", type=positive_int, default=10, help="timed steps per row (default: %(default)s)")
    gpu_models.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    gpu_models.add_argument("--batch-scale", type=float, default=1.0, metavar="F",
                            help="multiply every batch (64 images, DiT 32, LM 8, --dense-batch) by F in (0, 1]")
    gpu_models.add_argument("--time-limit", type=float, metavar="S",
                            help="start no row after S seconds (the CSV keeps every row finished)")
    gpu_models.add_argument("--smoke", action="store_true",
                            help="each row once on the CPU at tiny batch and size (checks the command; no timing)")
    add_overwrite(gpu_models, "a file at --out")
    gpu_models.set_defaults(handler=cmd_bench_family, run_family=_bench_gpu_models, seconds_flags=())

    dense = families.add_parser(
        "dense", help="backbone forward time and peak memory at detection resolutions, Pola vs softmax",
        description="Pola-PVT-T and Pola-Swin-T against their softmax versions, features_only forward, batch 1, "
                    "one subprocess per (model, size) so that every peak memory is its own. See docs/dense.md.",
    )
    dense.add_argument("--sizes", nargs="+", default=["512", "800x1344", "1024", "1536"], metavar="HxW",
                       help="HxW or S (square); multiples of 32 (800x1333 is padded to 800x1344 by the detectors)")
    dense.add_argument("--device", default="cpu")
    dense.add_argument("--min-run-time", type=float, default=1.0, metavar="S",
                       help="seconds of timing per measurement")
    rows_files(dense)
    dense.set_defaults(handler=cmd_bench_family, run_family=_bench_dense, seconds_flags=("--min-run-time",))

    deploy = families.add_parser(
        "deploy", help="inference speed under the CPU deployment options: eager, channels-last, bf16, compile, ONNX",
        description="Every variant of a (model, batch) timed in interleaved rounds, with its one-off cost and its "
                    "max |diff| against eager fp32. Writes DIR/results.json and DIR/table.md. See docs/deployment.md.",
    )
    deploy.add_argument("--out", required=True, metavar="DIR", help="folder for results.json and table.md")
    deploy.add_argument("--models", nargs="+", metavar="NAME", default=["pola_deit_tiny_patch16_224", "pola_pvt_tiny",
                        "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0"])
    deploy.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8], metavar="B")
    deploy.add_argument("--img-size", type=positive_int, default=224)
    deploy.add_argument("--variants", nargs="+", metavar="NAME",
                        help="eager_fp32 eager_channels_last eager_bf16 compile_fp32 onnxruntime_fp32 (default: all)")
    deploy.add_argument("--threads", type=int, default=0,
                        help="torch and onnxruntime intra-op threads (0: torch's default)")
    deploy.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds per row")
    deploy.add_argument("--min-run-time", type=float, default=1.0, metavar="S", help="seconds per variant and round")
    deploy.add_argument("--row-budget", type=float, default=240.0, metavar="S",
                        help="skip a row whose timing rounds are estimated (from the eager batch-1 time) to take "
                             "longer")
    deploy.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's usual cache folder (compile times then depend on earlier runs)")
    add_overwrite(deploy, "results in --out")
    deploy.set_defaults(handler=cmd_bench_family, run_family=_bench_deploy,
                        seconds_flags=("--min-run-time", "--row-budget"), out_files=("results.json", "table.md"))

    onnx = families.add_parser(
        "onnx", help="ours in onnxruntime against the softmax models in onnxruntime and against eager PyTorch (CPU)",
        description="Each family (ours and its softmax counterpart) exported with 'polaformer export' (dynamo "
                    "exporter, verified to 1e-4), run in onnxruntime with default session options and --threads "
                    "intra-op threads, and eagerly, plus ours with int8 linear layers in both; every variant of a "
                    "row timed in interleaved rounds. --accuracy scores a 'polaformer train' checkpoint in the four "
                    "forms of ours. See docs/deployment.md.",
    )
    onnx.add_argument("--families", nargs="+", metavar="NAME",
                      help="our model of each family (default: pola_deit_tiny_patch16_224 pola_pvt_tiny "
                           "pola_pvt_v2_b0 pola_swin_t POLA_b0)")
    onnx.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    onnx.add_argument("--threads", type=positive_int, default=2, help="torch and onnxruntime intra-op threads")
    onnx.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default: %(default)s)")
    onnx.add_argument("--min-time", type=float, default=0.5, metavar="S",
                      help="seconds of back-to-back calls per sample (default: %(default)s)")
    onnx.add_argument("--no-int8", action="store_true", help="skip the int8 variants")
    onnx.add_argument("--img-size", type=positive_int, metavar="S",
                      help="square input size; every model is built and exported for it (default: the models' 224)")
    onnx.add_argument("--accuracy", metavar="CHECKPOINT",
                      help="also score this 'polaformer train' checkpoint on its test split: eager and onnxruntime, "
                           "float32 and int8 (with --families none: only that)")
    onnx.add_argument("--reference", metavar="DIR",
                      help="also compare our whole models, float32 and int8, with the official outputs of the "
                           "reference vectors in DIR (<case>.json + .safetensors)")
    rows_files(onnx, markdown=True)
    onnx.set_defaults(handler=cmd_bench_family, run_family=_bench_onnx, seconds_flags=("--min-time",))

    lra = families.add_parser(
        "lra", help="the paper's Table 6: LRA training throughput and peak memory of every attention, vs softmax",
        description="Also 'polaformer lra bench'. See docs/lra.md.",
    )
    add_lra_bench_arguments(lra)


def add_lra_bench_arguments(parser) -> None:
    """The options of ``polaformer bench lra``, also ``polaformer lra bench``."""
    parser.add_argument("--out", required=True, metavar="DIR", help="writes results.json, table.md, bench_lra.png")
    parser.add_argument("--attentions", nargs="+", metavar="NAME", help="default: all")
    parser.add_argument("--lengths", nargs="+", type=positive_int, metavar="N", help="default: 1024 2048 4096")
    parser.add_argument("--batch-size", type=positive_int, help="fixed batch for every measurement (default: 4)")
    parser.add_argument("--steps", type=positive_int, help="timed training steps per measurement (default: 3)")
    parser.add_argument("--device", default="cpu")
    add_overwrite(parser, "results in --out")
    parser.set_defaults(handler=cmd_bench_family, run_family=_bench_lra, seconds_flags=(),
                        out_files=("results.json", "table.md", "bench_lra.png"))


def _print_line(msg: str) -> None:
    print(msg, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.scaling import (
        DEFAULT_METHODS,
        DEFAULT_MODELS,
        DEFAULT_SIZES,
        DEFAULT_TOKENS,
        OP_METHODS,
        QUICK_SIZES,
        QUICK_TOKENS,
        BenchConfig,
        run_bench,
    )
    from ..engine.output import claim_outputs

    if args.out is None:
        return usage_error("bench", "the following arguments are required: --out")
    if args.head_dim % 2:
        return usage_error("bench", f"--head-dim must be even (Pola splits values in two), got {args.head_dim}")
    min_run_time = args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0)
    if not min_run_time > 0:
        return usage_error("bench", f"--min-run-time must be > 0, got {args.min_run_time}")
    unknown = [m for m in args.methods or () if m not in OP_METHODS]
    if unknown:
        return usage_error("bench", f"unknown --methods {' '.join(unknown)}; known: {' '.join(OP_METHODS)}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return usage_error("bench", f"--out {args.out!r} exists and is not a folder")
    claim_outputs([os.path.join(args.out, name) for name in ("results.json", "bench_ops.png", "bench_models.png")],
                  args.overwrite, "--out")
    config = BenchConfig(
        out=args.out,
        tokens=tuple(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)),
        heads=args.heads, head_dim=args.head_dim, batch=args.batch,
        methods=tuple(dict.fromkeys(args.methods or DEFAULT_METHODS)),
        sizes=tuple(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)),
        models=() if args.no_models else tuple(args.models or DEFAULT_MODELS),
        min_run_time=min_run_time, max_softmax_tokens=args.max_softmax_tokens,
        matmul_size=args.matmul_size or (1024 if args.quick else 4096),
        op_memory=not args.no_op_memory, quick=args.quick,
    )
    results = run_bench(config, log=_print_line)
    exponent = results["op_summary"].get("fused_pola_fwd_bwd_exponent")
    exponent_text = "n/a (needs 2 sizes in 4096..65536)" if exponent is None else f"{exponent:.3f} (N 4096..65536)"
    print(f"fused Pola fwd+bwd time exponent {exponent_text}; wrote results.json, {', '.join(results['plots'])} "
          f"-> {args.out} ({results['wall_time_s']:.0f} s)")
    return 0


def cmd_bench_family(args: argparse.Namespace) -> int:
    """Checks the options every family shares and claims its output files, then runs it; its ValueError/RuntimeError
    is a one-line error."""
    from ..engine.output import claim_outputs

    command = "lra bench" if args.command == "lra" else f"bench {args.bench_family}"
    for flag in args.seconds_flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not value > 0:
            return usage_error(command, f"{flag} must be > 0, got {value}")
    files = [getattr(args, name, None) for name in ("json", "csv", "markdown", "gpu_csv", "gpu_models_csv")]
    files += [os.path.join(args.out, name) for name in getattr(args, "out_files", ())]
    claim_outputs([path for path in files if path], args.overwrite, "--out")  # before any measurement
    try:
        return args.run_family(args)
    except (ValueError, RuntimeError) as e:
        return usage_error(command, str(e))


def _write_bench_rows(args: argparse.Namespace, rows: list, document=None, table: str | None = None) -> None:
    """The files a family's --json/--csv/--markdown ask for: JSON is ``document`` (default: the rows)."""
    from ..bench.harness import write_csv, write_json, write_text

    if getattr(args, "json", None):
        write_json(args.json, rows if document is None else document)
    if getattr(args, "csv", None):
        write_csv(args.csv, rows)
    if getattr(args, "markdown", None) and table is not None:
        write_text(args.markdown, table)


def _bench_official(args: argparse.Namespace) -> int:
    from ..bench.official import markdown_table, run_official

    result = run_official(models=args.models, batches=args.batches, modes=args.modes, threads=args.threads,
                          rounds=args.rounds, min_time=args.min_time, compile=args.compile, floor=args.floor,
                          matmul_floor=args.matmul_floor, log=_print_line)
    if not result["rows"]:
        print("nothing to run", file=sys.stderr)
        return 0
    _write_bench_rows(args, result["rows"], result, markdown_table(result["rows"], result["meta"]))
    return 0


def _bench_native(args: argparse.Namespace) -> int:
    from ..bench.native import run_native

    rows = run_native(models=args.models, batches=args.batches, threads=args.threads, rounds=args.rounds,
                      min_time=args.min_time, model_steps=args.model_steps, log=_print_line)
    _write_bench_rows(args, rows, {"threads": args.threads, "rows": rows})
    return 0


def _bench_pacs(args: argparse.Namespace) -> int:
    from ..bench.pacs import run_pacs, table

    rows = run_pacs(batch=args.batch, threads=args.threads, rounds=args.rounds, min_time=args.min_time)
    print(table(rows), end="")
    _write_bench_rows(args, rows)
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    if args.smoke and not _triton_interprets():
        raise ValueError("--smoke needs Triton's interpreter, which triton reads when torch imports it: run the "
                         "polaformer command (it sets TRITON_INTERPRET=1 first) or set TRITON_INTERPRET=1 before "
                         "Python starts")
    from ..bench.gpu import run_gpu
    from ..bench.harness import write_csv

    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0, got {args.time_limit}")
    rows = run_gpu(batch=args.batch, dtypes=args.dtypes, modes=args.modes, groups=args.models,
                   variants=args.variants, smoke=args.smoke, time_limit=args.time_limit, log=_print_line,
                   on_shape_done=lambda rows: write_csv(args.gpu_csv, rows))
    print(f"{len(rows)} rows -> {args.gpu_csv}")
    return 0


def _sizes(pairs: list[str]) -> dict:
    """``NAME=SIZE`` pairs as a dict (one-line errors for another form)."""
    sizes = {}
    for pair in pairs:
        name, _, size = pair.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"--size takes NAME=SIZE with a whole number, got {pair!r}")
        sizes[name] = int(size)
    return sizes


def _bench_gpu_models(args: argparse.Namespace) -> int:
    from ..bench import gpu_models
    from ..bench.harness import write_csv

    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0, got {args.time_limit}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    rows = gpu_models.run_gpu_models(
        models=args.models or tuple(gpu_models.FAMILIES), impls=args.impls or gpu_models.IMPLS,
        modes=args.modes or gpu_models.MODES, variants=args.variants or gpu_models.DEFAULT_VARIANTS,
        sizes=_sizes(args.size),
        dense=args.dense or args.dense_only, model_rows=not args.dense_only, dense_batch=args.dense_batch,
        steps=args.steps, warmup=args.warmup, batch_scale=args.batch_scale, smoke=args.smoke,
        time_limit=args.time_limit, log=_print_line, on_row=lambda rows: write_csv(args.gpu_models_csv, rows))
    print(f"{len(rows)} rows -> {args.gpu_models_csv}")
    return 0


def _triton_interprets() -> bool:
    """Whether triton was imported in interpreter mode (its own library functions are then interpreted too)."""
    try:
        import triton.language.standard as standard
    except ImportError:
        return True  # no triton: the Triton rows report it themselves
    return type(standard.sum).__name__ == "InterpretedFunction"


def _bench_dense(args: argparse.Namespace) -> int:
    from ..bench.dense import run_dense, table

    rows = run_dense(sizes=args.sizes, device=args.device, min_run_time=args.min_run_time, log=_print_line)
    print(table(rows, args.device), end="")
    _write_bench_rows(args, rows)
    return 0


def _bench_deploy(args: argparse.Namespace) -> int:
    from ..bench.deploy import VARIANTS, run_deploy

    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    result = run_deploy(args.out, models=args.models, batches=args.batches, img_size=args.img_size,
                        variants=args.variants or VARIANTS, threads=args.threads, rounds=args.rounds,
                        min_run_time=args.min_run_time, row_budget=args.row_budget, warm_cache=args.warm_cache,
                        log=_print_line)
    print(result["table"], end="")
    return 0


def _bench_onnx(args: argparse.Namespace) -> int:
    from ..bench.onnx_speed import (
        FAMILIES,
        accuracy_rows,
        accuracy_table,
        reference_rows,
        reference_table,
        run_onnx_speed,
        speed_table,
    )

    families = tuple(FAMILIES) if args.families is None else tuple(f for f in args.families if f != "none")
    result, table = {"rows": []}, ""
    if families:
        result = run_onnx_speed(families=families, batches=args.batches, threads=args.threads, rounds=args.rounds,
                                min_time=args.min_time, int8=not args.no_int8, img_size=args.img_size,
                                log=_print_line)
        table = speed_table(result)
    if args.accuracy:
        result["accuracy"] = accuracy_rows(args.accuracy, threads=args.threads, log=_print_line)
        table += ("\n" if table else "") + accuracy_table(result["accuracy"])
    if args.reference:
        result["reference"] = reference_rows(args.reference, threads=args.threads, log=_print_line)
        table += ("\n" if table else "") + reference_table(result["reference"])
    print(table, end="")
    _write_bench_rows(args, result["rows"] + result.get("accuracy", []) + result.get("reference", []), result, table)
    return 0


def _bench_lra(args: argparse.Namespace) -> int:
    from ..bench.lra import run_lra_bench

    result = run_lra_bench(args.out, attentions=args.attentions, lengths=args.lengths, batch_size=args.batch_size,
                           steps=args.steps, device=args.device, log=_print_line)
    print(f"wrote {', '.join(result['files'])} -> {args.out} ({result['wall_time_s']:.0f} s)")
    return 0
