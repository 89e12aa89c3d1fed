"""Inference speed of one model per family under the CPU deployment options, side by side in one run.

For each model and batch size, at one input size:

- ``eager_fp32``: the model as built, ``torch.inference_mode()`` (the reference of every ratio);
- ``eager_channels_last``: weights and input in channels-last memory format;
- ``eager_bf16``: ``torch.autocast('cpu', dtype=torch.bfloat16)`` (the Pola/PaCS ops compute in fp32
  inside autocast regions by design; the projections, MLPs and convs run in bf16);
- ``compile_fp32``: ``torch.compile(model, dynamic=False)`` with inductor in its default mode, one
  compilation per batch size (static shapes);
- ``onnxruntime_fp32``: ``torch.onnx.export(model, (x,), f, dynamo=True)`` per batch size, run by
  onnxruntime's CPU provider with as many intra-op threads as torch uses.

All variants of a (model, batch) row are timed with ``torch.utils.benchmark`` in interleaved
rounds (each round times every variant once; the median over rounds is reported), so drifting load
from other processes affects them alike. The row also holds the one-off costs (first call of the
compiled model = compilation, ONNX export + session creation) and every variant's max |diff|
against ``eager_fp32`` on the same input. Inductor's caches are pointed at a fresh folder by
default, so compile times are cold.

    python benchmarks/bench_deploy.py --out docs/figures/deploy
    python benchmarks/bench_deploy.py --out /tmp/deploy --models pola_pvt_v2_b0 --batches 1 --rounds 2

Writes ``results.json`` and ``table.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

DEFAULT_MODELS = ("pola_deit_tiny_patch16_224", "pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0")
VARIANTS = ("eager_fp32", "eager_channels_last", "eager_bf16", "compile_fp32", "onnxruntime_fp32")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for results.json and table.md")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, default=0, help="torch and onnxruntime intra-op threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per variant and round")
    parser.add_argument("--row-budget", type=float, default=240.0,
                        help="skip a row whose timing rounds are estimated (from the eager batch-1 time) to take "
                             "longer than this many seconds")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's usual cache folder (compile times then depend on earlier runs)")
    return parser.parse_args(argv)


ARGS = parse_args()
if not ARGS.warm_cache:  # before torch._inductor is imported
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_deploy_inductor_")

import copy  # noqa: E402
import warnings  # noqa: E402

import timm  # noqa: E402
import torch  # noqa: E402
from torch.utils import benchmark  # noqa: E402

import polaformer.models  # noqa: E402,F401  (registers the models)
from polaformer.runtime import tune_cpu_allocator  # noqa: E402


def load1() -> float:
    return os.getloadavg()[0]


def max_diff(out, ref) -> float:
    return float((torch.as_tensor(out).float() - ref.float()).abs().max())


class Row:
    """One (model, batch): a callable per variant, plus its one-off costs and output difference."""

    def __init__(self, name: str, model: torch.nn.Module, x: torch.Tensor, threads: int, workdir: Path):
        self.name, self.model, self.x, self.threads, self.workdir = name, model, x, threads, workdir
        with torch.inference_mode():
            self.ref = model(x)
        self.calls, self.setup_s, self.diff, self.errors = {}, {}, {}, {}

    def add(self, variant: str):
        try:
            t0 = time.perf_counter()
            fn = getattr(self, f"_{variant}")()
            out = fn()  # first call: compilation for compile_fp32
            self.setup_s[variant] = time.perf_counter() - t0
            self.diff[variant] = max_diff(out, self.ref)
            self.calls[variant] = fn
        except Exception as exc:  # a variant that fails is reported, the others still run
            self.errors[variant] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc()

    def _eager_fp32(self):
        model, x = self.model, self.x

        def run():
            with torch.inference_mode():
                return model(x)
        return run

    def _eager_channels_last(self):
        model = copy.deepcopy(self.model).to(memory_format=torch.channels_last)
        x = self.x.contiguous(memory_format=torch.channels_last)

        def run():
            with torch.inference_mode():
                return model(x)
        return run

    def _eager_bf16(self):
        model, x = self.model, self.x

        def run():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x)
        return run

    def _compile_fp32(self):
        torch._dynamo.reset()
        compiled = torch.compile(self.model, dynamic=False)  # inductor, default mode
        x = self.x

        def run():
            with torch.inference_mode():
                return compiled(x)
        return run

    def _onnxruntime_fp32(self):
        import onnxruntime as ort

        path = self.workdir / f"{self.name}_b{self.x.shape[0]}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(self.model, (self.x,), str(path), dynamo=True, verbose=False)
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: self.x.numpy()}

        def run():
            return torch.from_numpy(session.run(None, feed)[0])
        return run

    def time(self, rounds: int, min_run_time: float) -> dict:
        samples = {v: [] for v in self.calls}
        loads = [load1()]
        for _ in range(rounds):
            for variant, fn in self.calls.items():
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=self.threads)
                samples[variant].append(timer.blocked_autorange(min_run_time=min_run_time).median)
            loads.append(load1())
        return {v: s for v, s in samples.items()}, loads


def main():
    args = ARGS
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    allocator_tuned = tune_cpu_allocator()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_deploy_onnx_"))
    env = {
        "machine": platform.processor() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__, "timm": timm.__version__,
        "python": platform.python_version(), "allocator_reuse": allocator_tuned, "img_size": args.img_size,
        "rounds": args.rounds, "min_run_time": args.min_run_time, "inductor_cache": "warm" if args.warm_cache else "cold",
        "load1_at_start": load1(),
    }
    try:
        import onnxruntime
        env["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)

    rows = []
    started = time.time()
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name).eval()
        eager_b1 = None
        for batch in args.batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, model.default_cfg["input_size"][0], args.img_size, args.img_size, generator=gen)
            record = {"model": name, "batch": batch}
            if eager_b1 is not None:
                # blocked_autorange runs at least min_run_time and at least one timed block after a warm-up call
                estimate = len(args.variants) * args.rounds * max(args.min_run_time, 2 * eager_b1 * batch)
                if estimate > args.row_budget:
                    record["skipped"] = f"estimated {estimate:.0f}s of timing > --row-budget {args.row_budget:.0f}s"
                    rows.append(record)
                    print(json.dumps(record), flush=True)
                    continue
            row = Row(name, model, x, threads, workdir)
            for variant in args.variants:
                row.add(variant)
            samples, loads = row.time(args.rounds, args.min_run_time)
            medians = {v: statistics.median(s) for v, s in samples.items()}
            if batch == 1 and "eager_fp32" in medians:
                eager_b1 = medians["eager_fp32"]
            record.update(
                seconds_per_batch=medians,
                seconds_min_max={v: [min(s), max(s)] for v, s in samples.items()},
                images_per_s={v: batch / t for v, t in medians.items()},
                ratio_to_eager_fp32={v: medians["eager_fp32"] / t for v, t in medians.items()} if "eager_fp32" in medians else {},
                setup_s=row.setup_s, max_abs_diff=row.diff, ref_max_abs=float(row.ref.abs().max()),
                errors=row.errors, load1=loads,
            )
            rows.append(record)
            print(json.dumps(record), flush=True)
            del row
            torch._dynamo.reset()
    env["load1_at_end"] = load1()
    env["wall_s"] = time.time() - started

    (out_dir / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    table = markdown(env, rows, args.variants)
    (out_dir / "table.md").write_text(table)
    print(table)
    shutil.rmtree(workdir, ignore_errors=True)  # the exported .onnx files
    if not args.warm_cache:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def markdown(env: dict, rows: list, variants) -> str:
    lines = [
        f"CPU {env['machine']} ({env['cpu_capability']}), {env['threads']} thread(s) of {env['cpus']} cores, "
        f"torch {env['torch']}, onnxruntime {env.get('onnxruntime', '-')}, {env['img_size']} px, fp32 unless noted; "
        f"median of {env['rounds']} interleaved rounds; load average (1 min) {env['load1_at_start']:.1f} at start, "
        f"{env['load1_at_end']:.1f} at end; inductor cache {env['inductor_cache']}.",
        "",
        "Images/s (× eager fp32); setup = compile (first call) or ONNX export + session; max |diff| vs eager fp32.",
        "",
        "| model | batch | " + " | ".join(variants) + " | compile s | ONNX export s | max abs diff (cl / bf16 / compile / ort) |",
        "|---|---|" + "---|" * len(variants) + "---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join("-" for _ in variants)
                         + f" | - | - | skipped: {r['skipped']} |")
            continue
        cells = []
        for v in variants:
            if v in r["images_per_s"]:
                ratio = r["ratio_to_eager_fp32"].get(v)
                cells.append(f"{r['images_per_s'][v]:.1f}" + (f" ({ratio:.2f}×)" if v != "eager_fp32" else ""))
            else:
                cells.append("failed" if v in r["errors"] else "-")
        setup = r["setup_s"]
        diffs = " / ".join(f"{r['max_abs_diff'][v]:.1e}" if v in r["max_abs_diff"] else "-"
                           for v in ("eager_channels_last", "eager_bf16", "compile_fp32", "onnxruntime_fp32"))
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells)
                     + "".join(f" | {setup[v]:.0f}" if v in setup else " | -" for v in ("compile_fp32", "onnxruntime_fp32"))
                     + f" | {diffs} |")
    errors = [(r["model"], r["batch"], v, e) for r in rows for v, e in r.get("errors", {}).items()]
    if errors:
        lines += ["", "Failed variants:", ""] + [f"- {m} batch {b}, {v}: {e}" for m, b, v, e in errors]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
