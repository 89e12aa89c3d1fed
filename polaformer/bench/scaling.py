"""``polaformer bench``: op-level and model-level speed/memory scaling, with a roofline reference.

(a) Op level: fused Pola (:func:`polaformer.ops.pola_linear_attention`) against torch SDPA
    (softmax) and mean-normalised linear attention on the ELU+1 and FLatten focused feature
    maps (and, on request, the official code's two-stream formulation), forward and
    forward+backward, timed side by side with ``torch.utils.benchmark``.
(b) Model level: images/s and peak resident memory of Pola-PVT-T and Pola-Swin-T against the
    same architectures with softmax attention (``attn_type='SSSS'``), one fresh subprocess per
    (model, input size) so every peak is its own.
(c) The machine's large-matmul GFLOP/s, measured in the same run, and each op's achieved
    GFLOP/s (FLOPs counted with ``FlopCounterMode`` on meta tensors) as a fraction of it.

Everything lands in ``results.json`` plus log-log PNG plots in the output folder.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.output import make_folder
from ..ops import (
    elu_feature,
    focused_feature,
    learnable_power,
    linear_attention,
    official_pola_linear_attention,
    pola_linear_attention,
)
from ..runtime import tune_cpu_allocator
from .harness import (
    log_log_axes,
    machine_info,
    markdown_table,
    peak_rss_bytes,
    pyplot,
    release_freed_buffers,
    reset_peak_rss,
    rss_now_bytes,
    run_child,
    save_figure,
    time_call,
    write_json,
)

__all__ = [
    "OP_METHODS",
    "DEFAULT_METHODS",
    "BenchConfig",
    "count_flops",
    "fit_exponent",
    "matmul_gflops",
    "roofline_fraction",
    "apply_roofline_reference",
    "markdown_tables",
    "run_bench",
]

DEFAULT_TOKENS = (196, 1024, 4096, 16384, 65536)
DEFAULT_SIZES = (224, 448, 640, 1024)
QUICK_TOKENS = (196, 1024, 4096)
QUICK_SIZES = (224,)
DEFAULT_MODELS = ("pola_pvt_tiny", "pola_swin_t")
SOFTMAX_ATTN_TYPE = "SSSS"
MODES = ("fwd", "fwd_bwd")
EXPONENT_RANGE = (4096, 65536)


# --------------------------------------------------------------------------- op level

def _fused_pola(q, k, v, w):
    return pola_linear_attention(q, k, v, learnable_power(w, 4.0))


def _sdpa_softmax(q, k, v, w):
    return F.scaled_dot_product_attention(q, k, v)


def _elu_linear(q, k, v, w):
    return linear_attention(elu_feature(q), elu_feature(k), v)


def _focused_linear(q, k, v, w):
    return linear_attention(focused_feature(q), focused_feature(k), v)


def _two_stream_pola(q, k, v, w):
    return official_pola_linear_attention(q, k, v, learnable_power(w, 4.0))


OP_METHODS = {
    "fused_pola": _fused_pola,
    "sdpa_softmax": _sdpa_softmax,
    "elu_linear": _elu_linear,
    "focused_linear": _focused_linear,
    "two_stream_pola": _two_stream_pola,
}
DEFAULT_METHODS = ("fused_pola", "sdpa_softmax", "elu_linear", "focused_linear")
SOFTMAX_METHODS = ("sdpa_softmax",)


def make_op_inputs(tokens: int, heads: int, head_dim: int, batch: int = 1, device="cpu", seed: int = 0):
    """q, k, v (B, H, N, d) and the per-channel power weight, all requiring grad."""
    shape = (batch, heads, tokens, head_dim)
    if torch.device(device).type == "meta":
        q, k, v = (torch.empty(shape, device="meta", requires_grad=True) for _ in range(3))
        return q, k, v, torch.empty(1, heads, 1, head_dim, device="meta", requires_grad=True)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen).to(device).requires_grad_() for _ in range(3))
    w = torch.randn(1, heads, 1, head_dim, generator=gen).to(device).requires_grad_()
    return q, k, v, w


def _op_step(fn, inputs, mode):
    q, k, v, w = inputs
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(q, k, v, w)
        return step
    grad = torch.ones(q.shape[:-1] + (v.shape[-1],), device=q.device)

    def step():
        for t in inputs:
            t.grad = None
        fn(q, k, v, w).backward(grad)
    return step


def count_flops(fn, tokens: int, heads: int, head_dim: int, mode: str, batch: int = 1) -> int:
    """FLOPs of one call (``mode`` 'fwd' or 'fwd_bwd') counted by FlopCounterMode on meta tensors.

    Only matmul-like ops are counted (elementwise work such as the power map is not), which is
    the usual convention for attention FLOPs.
    """
    from torch.utils.flop_counter import FlopCounterMode

    inputs = make_op_inputs(tokens, heads, head_dim, batch, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        _op_step(fn, inputs, mode)()
    return int(counter.get_total_flops())


def matmul_gflops(size: int = 4096, min_run_time: float = 0.5) -> dict:
    """The machine's fp32 large-matmul rate: ``size``² @ ``size``², 2·size³ FLOPs per call (fastest block)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    seconds = time_call(lambda: torch.mm(a, b), max(min_run_time, 1e-3), best=True)
    return {"size": size, "seconds": seconds, "gflops": 2 * size**3 / seconds / 1e9}


def apply_roofline_reference(results: dict) -> float:
    """Use the faster of the matmul rates measured before and after the ops as the roofline.

    A slow first measurement (another process on the cores) would otherwise inflate every
    fraction; recomputes each op row's ``roofline_fraction`` and returns the reference GFLOP/s.
    """
    rates = [m["gflops"] for m in (results.get("matmul"), results.get("matmul_after")) if m]
    ref = max(rates)
    results["roofline_reference_gflops"] = ref
    for row in results["ops"]:
        if not row.get("skipped"):
            row["roofline_fraction"] = row["gflops"] / ref
    return ref


def roofline_fraction(flops: float, seconds: float, peak_gflops: float) -> float:
    """Achieved GFLOP/s (``flops / seconds``) as a fraction of the machine's ``peak_gflops``."""
    if seconds <= 0 or peak_gflops <= 0:
        raise ValueError(f"seconds and peak_gflops must be positive, got {seconds} and {peak_gflops}")
    return flops / seconds / 1e9 / peak_gflops


def fit_exponent(tokens, seconds, lo: int = EXPONENT_RANGE[0], hi: int = EXPONENT_RANGE[1]) -> float | None:
    """Least-squares slope of log(time) against log(N) over ``lo ≤ N ≤ hi`` (None under 2 points)."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(tokens, seconds) if t and lo <= n <= hi]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


# --------------------------------------------------------------------------- subprocess children

def _child_op_memory(spec: dict) -> dict:
    """Peak memory of one fused-Pola forward+backward at N tokens (inputs excluded)."""
    release_freed_buffers()
    torch.set_num_threads(spec["threads"])
    inputs = make_op_inputs(spec["tokens"], spec["heads"], spec["head_dim"])
    step = _op_step(OP_METHODS[spec["method"]], inputs, "fwd_bwd")
    step()  # warm-up: one-off thread-pool and allocator set-up is not the op's memory
    for t in inputs:
        t.grad = None
    reset = reset_peak_rss()
    base = rss_now_bytes()
    step()
    peak = peak_rss_bytes()
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    return {"tokens": spec["tokens"], "method": spec["method"], "peak_rss_mb": peak / 2**20,
            "baseline_rss_mb": base / 2**20, "op_peak_mb": max(0, peak - base) / 2**20,
            "input_mb": input_bytes / 2**20, "peak_source": "VmHWM after reset" if reset else "ru_maxrss"}


def _child_model(spec: dict) -> dict:
    """images/s and peak memory of one model at one input size, forward only, batch 1."""
    import timm

    import polaformer.models  # noqa: F401  (registers the models)
    from polaformer import accelerate

    release_freed_buffers()
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    kwargs = {"img_size": spec["size"]}
    if spec["attn_type"]:
        kwargs["attn_type"] = spec["attn_type"]
    model = accelerate(timm.create_model(spec["model"], **kwargs).eval(), inference=True).to(device)
    x = torch.randn(1, 3, spec["size"], spec["size"], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.no_grad():
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up, then one measured forward for the forward-only peak
    reset_peak_rss()
    base = rss_now_bytes()
    step()
    forward_peak = peak_rss_bytes()
    tune_cpu_allocator()  # buffer reuse for the timing
    seconds = time_call(step, spec["min_run_time"])
    out = {"model": spec["model"], "attention": spec["attention"], "size": spec["size"],
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "seconds": seconds, "images_per_s": 1.0 / seconds}
    if device.type == "cuda":
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["memory_source"] = "torch.cuda.max_memory_allocated"
    else:
        out["peak_memory_mb"] = peak_rss_bytes() / 2**20
        out["forward_peak_mb"] = max(0, forward_peak - base) / 2**20
        out["memory_source"] = ("peak_memory_mb: VmHWM of the whole process (torch, model, input); "
                                "forward_peak_mb: peak RSS of one forward above the RSS before it")
    return out


CHILDREN = {"op_memory": _child_op_memory, "model": _child_model}


# --------------------------------------------------------------------------- driver

@dataclasses.dataclass
class BenchConfig:
    out: str
    tokens: tuple = DEFAULT_TOKENS
    heads: int = 8
    head_dim: int = 64
    batch: int = 1
    sizes: tuple = DEFAULT_SIZES
    models: tuple = DEFAULT_MODELS
    methods: tuple = DEFAULT_METHODS
    min_run_time: float = 1.0
    max_softmax_tokens: int = 16384
    matmul_size: int = 4096
    op_memory: bool = True
    device: str = "cpu"
    quick: bool = False


def _log(msg: str, log) -> None:
    if log is not None:
        log(msg)


def run_ops(cfg: BenchConfig, peak_gflops: float, log=None) -> list[dict]:
    rows = []
    for n in cfg.tokens:
        inputs = make_op_inputs(n, cfg.heads, cfg.head_dim, cfg.batch, device=cfg.device)
        for name in cfg.methods:
            fn = OP_METHODS[name]
            for mode in MODES:
                row = {"tokens": n, "method": name, "mode": mode}
                if name in SOFTMAX_METHODS and n > cfg.max_softmax_tokens:
                    row.update(skipped=True, reason=f"N > --max-softmax-tokens {cfg.max_softmax_tokens}")
                    rows.append(row)
                    continue
                seconds = time_call(_op_step(fn, inputs, mode), cfg.min_run_time)
                flops = count_flops(fn, n, cfg.heads, cfg.head_dim, mode, cfg.batch)
                row.update(skipped=False, seconds=seconds, ms=seconds * 1e3, flops=flops, gflops=flops / seconds / 1e9,
                           roofline_fraction=roofline_fraction(flops, seconds, peak_gflops))
                rows.append(row)
                _log(f"op N={n:>6} {name:<15} {mode:<8} {seconds * 1e3:10.2f} ms "
                     f"{row['gflops']:7.1f} GFLOP/s ({100 * row['roofline_fraction']:.0f}% of matmul)", log)
        del inputs
    return rows


def _op_summary(rows: list[dict], cfg: BenchConfig) -> dict:
    def times(method, mode):
        sel = [r for r in rows if r["method"] == method and r["mode"] == mode and not r["skipped"]]
        return [r["tokens"] for r in sel], [r["seconds"] for r in sel]

    summary = {"exponent_range": list(EXPONENT_RANGE), "exponents": {}, "speedup_vs_sdpa": {}}
    for method in cfg.methods:
        for mode in MODES:
            n, t = times(method, mode)
            summary["exponents"][f"{method}/{mode}"] = fit_exponent(n, t)
    summary["fused_pola_fwd_bwd_exponent"] = summary["exponents"].get("fused_pola/fwd_bwd")
    if "fused_pola" in cfg.methods and "sdpa_softmax" in cfg.methods:
        for mode in MODES:
            fused = dict(zip(*times("fused_pola", mode)))
            sdpa = dict(zip(*times("sdpa_softmax", mode)))
            summary["speedup_vs_sdpa"][mode] = {str(n): sdpa[n] / fused[n] for n in fused if n in sdpa}
    return summary


def run_op_memory(cfg: BenchConfig, log=None) -> dict:
    rows = []
    for n in cfg.tokens:
        spec = {"tokens": n, "heads": cfg.heads, "head_dim": cfg.head_dim, "method": "fused_pola",
                "threads": torch.get_num_threads()}
        row = run_child(__name__, "op_memory", spec)
        row.setdefault("tokens", n)
        rows.append(row)
        if "error" not in row:
            _log(f"op memory N={n:>6} fused_pola fwd_bwd: {row['op_peak_mb']:.1f} MB above inputs' baseline "
                 f"(inputs {row['input_mb']:.1f} MB)", log)
    ok = [r for r in rows if "error" not in r and r["op_peak_mb"] > 0]
    # Small N is dominated by fixed overhead; fit over the same range as the time exponent when it has 2 points.
    big = [r for r in ok if r["tokens"] >= EXPONENT_RANGE[0]]
    sel = big if len(big) >= 2 else ok
    growth = fit_exponent([r["tokens"] for r in sel], [r["op_peak_mb"] for r in sel], lo=0, hi=10**12)
    return {"method": "fused_pola", "mode": "fwd_bwd", "rows": rows, "growth_exponent": growth,
            "growth_range": [sel[0]["tokens"], sel[-1]["tokens"]] if sel else None}


def run_models(cfg: BenchConfig, log=None) -> list[dict]:
    rows = []
    for model in cfg.models:
        for attention, attn_type in (("pola", None), ("softmax", SOFTMAX_ATTN_TYPE)):
            for size in cfg.sizes:
                spec = {"model": model, "attention": attention, "attn_type": attn_type, "size": size,
                        "min_run_time": cfg.min_run_time, "threads": torch.get_num_threads(), "device": cfg.device}
                row = run_child(__name__, "model", spec)
                row.update(model=model, attention=attention, size=size, attn_type=attn_type or "default")
                rows.append(row)
                if "error" in row:
                    _log(f"model {model} ({attention}) {size}px: {row['error']}", log)
                else:
                    _log(f"model {model:<14} {attention:<8} {size:>5}px {row['images_per_s']:8.2f} img/s "
                         f"peak {row['peak_memory_mb']:8.1f} MB", log)
    return rows


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Run everything, write ``results.json`` and the plots into ``cfg.out``; returns the results."""
    out = Path(cfg.out)
    make_folder(out)
    allocator = tune_cpu_allocator()
    started = time.time()
    mm = matmul_gflops(cfg.matmul_size, cfg.min_run_time)
    _log(f"matmul {cfg.matmul_size}x{cfg.matmul_size} fp32: {mm['gflops']:.1f} GFLOP/s", log)
    ops = run_ops(cfg, mm["gflops"], log)
    results = {
        "machine": machine_info(cfg.device, allocator_reuse=allocator),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
        "matmul": mm,
        "ops": ops,
        "op_summary": _op_summary(ops, cfg),
    }
    if cfg.op_memory:
        results["op_memory"] = run_op_memory(cfg, log)
    mm_after = matmul_gflops(cfg.matmul_size, cfg.min_run_time)  # again, to see whether the machine drifted
    results["matmul_after"] = mm_after
    _log(f"matmul {cfg.matmul_size}x{cfg.matmul_size} fp32 after the ops: {mm_after['gflops']:.1f} GFLOP/s", log)
    apply_roofline_reference(results)
    results["models"] = run_models(cfg, log)
    results["wall_time_s"] = time.time() - started
    results["plots"] = write_plots(results, out)
    write_json(out / "results.json", results)
    return results


# --------------------------------------------------------------------------- plots

def write_plots(results: dict, out: Path, dpi: int = 80) -> list[str]:
    plt = pyplot()
    written = []
    ops = results["ops"]
    methods = list(dict.fromkeys(r["method"] for r in ops))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, mode in zip(axes, MODES):
        anchor = None
        for method in methods:
            sel = [r for r in ops if r["method"] == method and r["mode"] == mode and not r["skipped"]]
            if not sel:
                continue
            n = [r["tokens"] for r in sel]
            ms = [r["ms"] for r in sel]
            ax.plot(n, ms, "o-", label=method)
            if method == "fused_pola" or anchor is None:
                anchor = (n[0], ms[0], max(n))
        if anchor:
            n0, t0, n1 = anchor
            for power, style in ((1, ":"), (2, "--")):
                ax.plot([n0, n1], [t0, t0 * (n1 / n0) ** power], "k" + style, lw=1, alpha=0.6,
                        label=f"∝ N{'²' if power == 2 else ''}")
        log_log_axes(ax, "tokens N", "ms per call", {"fwd": "forward", "fwd_bwd": "forward + backward"}[mode])
        ax.legend(fontsize=8)
    cfg = results["config"]
    peak = results.get("roofline_reference_gflops", results["matmul"]["gflops"])
    fig.suptitle(f"attention op, B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']}, "
                 f"{results['machine']['threads']} threads ({peak:.0f} GFLOP/s matmul)")
    path = out / "bench_ops.png"
    save_figure(fig, path, dpi)
    written.append(path.name)

    models = [r for r in results.get("models", []) if "error" not in r]
    if models:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        for key in dict.fromkeys((r["model"], r["attention"]) for r in models):
            sel = sorted((r for r in models if (r["model"], r["attention"]) == key), key=lambda r: r["size"])
            sizes = [r["size"] for r in sel]
            style = "o-" if key[1] == "pola" else "s--"
            axes[0].plot(sizes, [r["images_per_s"] for r in sel], style, label=f"{key[0]} ({key[1]})")
            mem_key = "forward_peak_mb" if all(r.get("forward_peak_mb") for r in sel) else "peak_memory_mb"
            axes[1].plot(sizes, [r[mem_key] for r in sel], style, label=f"{key[0]} ({key[1]})")
        mem_label = ("forward peak memory above baseline (MB)" if all(r.get("forward_peak_mb") for r in models)
                     else "peak memory (MB)")
        for ax, ylabel in zip(axes, ("images / s (batch 1, forward)", mem_label)):
            log_log_axes(ax, "input size (px)", ylabel)
            ax.legend(fontsize=8)
        fig.suptitle("models: Pola vs softmax attention")
        path = out / "bench_models.png"
        save_figure(fig, path, dpi)
        written.append(path.name)
    return written


def markdown_tables(results: dict) -> str:
    """The op, op-memory and model tables of a results dict, as Markdown."""
    lines = []
    ops = results["ops"]
    methods = list(dict.fromkeys(r["method"] for r in ops))
    tokens = list(dict.fromkeys(r["tokens"] for r in ops))
    by = {(r["tokens"], r["method"], r["mode"]): r for r in ops}

    def measured(n, method, mode):
        r = by.get((n, method, mode))
        return None if r is None or r["skipped"] else r

    for mode in MODES:
        rows = [[n] + ["skipped" if (r := measured(n, m, mode)) is None
                       else f"{r['ms']:.2f} ({100 * r['roofline_fraction']:.0f}%)" for m in methods]
                for n in tokens]
        lines += [markdown_table([f"N ({mode})"] + [f"{m} ms (roofline)" for m in methods], rows), ""]
    if "fused_pola" in methods:
        for other in (m for m in methods if m != "fused_pola"):
            for mode in MODES:
                ratios = [f"N={n}: {a['seconds'] / b['seconds']:.1f}x" for n in tokens
                          if (a := measured(n, other, mode)) and (b := measured(n, "fused_pola", mode))]
                if ratios:
                    lines.append(f"{other} / fused_pola ({mode}): " + ", ".join(ratios))
        lines.append("")
    summary = results["op_summary"]
    lines.append("Time exponents over N in 4096..65536: " + ", ".join(
        f"{k} {v:.3f}" for k, v in summary["exponents"].items() if v is not None))
    mem = results.get("op_memory")
    if mem:
        rows = [[r["tokens"], r.get("error") or f"{r['op_peak_mb']:.1f}",
                 "" if "error" in r else f"{r['input_mb']:.1f}"] for r in mem["rows"]]
        lines += ["", markdown_table(["N", "fused Pola fwd+bwd peak above baseline (MB)", "inputs (MB)"], rows)]
        if mem.get("growth_exponent") is not None:
            lines.append(f"\nMemory growth exponent over N in {mem['growth_range']}: {mem['growth_exponent']:.3f}")
    if results.get("models"):
        rows = [[r["model"], r["attention"], r["size"], f"error: {r['error']}", "", ""] if "error" in r else
                [r["model"], r["attention"], r["size"], f"{r['images_per_s']:.2f}",
                 f"{r.get('forward_peak_mb', float('nan')):.1f}", f"{r['peak_memory_mb']:.0f}"]
                for r in results["models"]]
        lines += ["", markdown_table(["model", "attention", "size", "images/s", "forward peak above baseline (MB)",
                                      "process peak (MB)"], rows)]
    return "\n".join(lines) + "\n"
