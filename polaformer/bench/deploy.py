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

    polaformer bench deploy --out docs/figures/deploy
    polaformer bench deploy --out /tmp/deploy --models pola_pvt_v2_b0 --batches 1 --rounds 2

Writes ``results.json`` and ``table.md`` into ``--out``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import timm
import torch

import polaformer.models  # noqa: F401  (registers the models)
from polaformer.engine.output import make_folder
from polaformer.runtime import tune_cpu_allocator

from .harness import interleaved, loadavg, machine_info, medians, write_json, write_text

DEFAULT_MODELS = ("pola_deit_tiny_patch16_224", "pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0")
VARIANTS = ("eager_fp32", "eager_channels_last", "eager_bf16", "compile_fp32", "onnxruntime_fp32")

logger = logging.getLogger(__name__)


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
            logger.warning("%s batch %d: %s failed", self.name, self.x.shape[0], variant, exc_info=True)

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


@contextlib.contextmanager
def _inductor_cache(warm: bool):
    """A fresh inductor cache folder for the run (cold compile times), unless ``warm``."""
    if warm:
        yield "warm"
        return
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = tempfile.mkdtemp(prefix="bench_deploy_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        yield "cold"
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(folder, ignore_errors=True)


def run_deploy(out, *, models=DEFAULT_MODELS, batches=(1, 8), img_size: int = 224, variants=VARIANTS,
               threads: int = 0, rounds: int = 3, min_run_time: float = 1.0, row_budget: float = 240.0,
               warm_cache: bool = False, log: Callable[[str], None] = print) -> dict:
    """Time every (model, batch) under every variant; writes ``results.json`` and ``table.md`` into ``out``.

    ``threads`` 0 keeps torch's default. A row whose timing is estimated (from the eager batch-1 time)
    to take longer than ``row_budget`` seconds is skipped; a variant that fails is reported, the others
    still run. Raises ValueError for an unknown variant.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(map(repr, unknown))}; known: {', '.join(VARIANTS)}")
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    out_dir = Path(out)
    make_folder(out_dir)
    with _inductor_cache(warm_cache) as cache, tempfile.TemporaryDirectory(prefix="bench_deploy_onnx_") as workdir:
        env = {**machine_info(allocator_reuse=tune_cpu_allocator()), "timm": timm.__version__, "img_size": img_size,
               "rounds": rounds, "min_run_time": min_run_time, "inductor_cache": cache, "load1_at_start": loadavg()}
        try:
            import onnxruntime
            env["onnxruntime"] = onnxruntime.__version__
        except ImportError:
            pass
        rows = []
        started = time.time()
        for name in models:
            torch.manual_seed(0)
            model = timm.create_model(name).eval()
            eager_b1 = None
            for batch in batches:
                gen = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, model.default_cfg["input_size"][0], img_size, img_size, generator=gen)
                record = {"model": name, "batch": batch}
                if eager_b1 is not None:
                    # blocked_autorange runs at least min_run_time and at least one timed block after a warm-up call
                    estimate = len(variants) * rounds * max(min_run_time, 2 * eager_b1 * batch)
                    if estimate > row_budget:
                        record["skipped"] = f"estimated {estimate:.0f}s of timing > --row-budget {row_budget:.0f}s"
                        rows.append(record)
                        log(f"{name} batch {batch}: skipped ({record['skipped']})")
                        continue
                row = Row(name, model, x, threads, Path(workdir))
                for variant in variants:
                    row.add(variant)
                loads = [loadavg()]
                samples = interleaved(row.calls, rounds, min_run_time, threads=threads)
                loads.append(loadavg())
                median = medians(samples)
                if batch == 1 and "eager_fp32" in median:
                    eager_b1 = median["eager_fp32"]
                record.update(
                    seconds_per_batch=median,
                    seconds_min_max={v: [min(s), max(s)] for v, s in samples.items()},
                    images_per_s={v: batch / t for v, t in median.items()},
                    ratio_to_eager_fp32={v: median["eager_fp32"] / t for v, t in median.items()}
                    if "eager_fp32" in median else {},
                    setup_s=row.setup_s, max_abs_diff=row.diff, ref_max_abs=float(row.ref.abs().max()),
                    errors=row.errors, load1=loads,
                )
                rows.append(record)
                log(f"{name} batch {batch}: " + ", ".join(f"{v} {ips:.1f} img/s"
                                                          for v, ips in record["images_per_s"].items()))
                del row
                torch._dynamo.reset()
        env["load1_at_end"] = loadavg()
        env["wall_s"] = time.time() - started
    write_json(out_dir / "results.json", {"environment": env, "rows": rows})
    table = markdown(env, rows, variants)
    write_text(out_dir / "table.md", table)
    return {"environment": env, "rows": rows, "table": table}


def markdown(env: dict, rows: list, variants) -> str:
    lines = [
        f"CPU {env['cpu_model']} ({env['cpu_capability']}), {env['threads']} thread(s) of {env['cpu_count']} cores, "
        f"torch {env['torch']}, onnxruntime {env.get('onnxruntime', '-')}, {env['img_size']} px, fp32 unless noted; "
        f"median of {env['rounds']} interleaved rounds; load average (1 min) {_load(env['load1_at_start'])} at start, "
        f"{_load(env['load1_at_end'])} at end; inductor cache {env['inductor_cache']}.",
        "",
        "Images/s (× eager fp32); setup = compile (first call) or ONNX export + session; max |diff| vs eager fp32.",
        "",
        "| model | batch | " + " | ".join(variants)
        + " | compile s | ONNX export s | max abs diff (cl / bf16 / compile / ort) |",
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
        setup_cells = "".join(f" | {setup[v]:.0f}" if v in setup else " | -"
                              for v in ("compile_fp32", "onnxruntime_fp32"))
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + setup_cells + f" | {diffs} |")
    errors = [(r["model"], r["batch"], v, e) for r in rows for v, e in r.get("errors", {}).items()]
    if errors:
        lines += ["", "Failed variants:", ""] + [f"- {m} batch {b}, {v}: {e}" for m, b, v, e in errors]
    return "\n".join(lines) + "\n"



def _load(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
