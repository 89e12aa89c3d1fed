"""The Triton attention kernels on a GPU: time and peak memory at the models' shapes, eager, compiled and graphed.

Methods, each forward and forward+backward, in bf16 and fp32:

- ``pola_triton``: :func:`~polaformer.ops.pola_linear_attention` on the Triton kernels;
- ``pola_torch``: the same op on its torch formulation (backend ``torch``);
- ``sdpa``: ``F.scaled_dot_product_attention`` (softmax; flash attention where torch picks it, bf16);
- ``fbi_la``: the Pola streams composed from flash-bidirectional-linear-attention's fused linear attention
  (``flash_bla``), when that package imports; bidirectional rows with keys equal to queries only;
- ``fla_chunk``: the causal Pola streams composed from flash-linear-attention's ``chunk_linear_attn``
  (``fla``), when that package imports; causal rows only;
- ``pacs_triton`` / ``pacs_torch``: :func:`~polaformer.ops.pacs_linear_attention`, when the Triton backend
  has PaCS kernels.

Shapes: Pola-PVT's stages (head width 64, N = 3136/784/196/49 with spatially reduced keys M = N/64, N/16,
N/4, N), Pola-Swin's 7×7 windows and last global stage (head width 32), DiT/high-resolution token counts
(4k to 32k, M = N) and the same counts causal (``causal=True`` against causal SDPA); the long rows have batch 1
and 16 heads, which fits SDPA's fp32 backward at 32k on an 80 GB card.

Every row times the eager call (``ms``, with ``peak_mib``, the CUDA allocator's peak above what was allocated
before the call), the call under ``torch.compile(fullgraph=True)`` (``compiled_ms``) and the eager call
captured in a CUDA graph and replayed (``graph_ms``; forward+backward captured whole, with static inputs and
gradients). Times are ``triton.testing.do_bench`` medians in ms. A timing that fails leaves its ``*_ms`` empty
and its one-line reason in ``error`` / ``compiled_error`` / ``graph_error``. Every row names the card, its
driver, torch and triton.

``--smoke`` runs every method once at tiny shapes on the CPU (the Triton kernels under ``TRITON_INTERPRET=1``),
to check the command, not to time anything; compiled and graphed timings are GPU-only there.

    polaformer bench gpu --out gpu.csv
"""
from __future__ import annotations

import platform
import subprocess
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from polaformer.ops import dispatch, learnable_power, pacs_linear_attention, pola_linear_attention

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "fwd_bwd")
VARIANTS = ("compiled", "graph")  # timed besides the eager call
GROUPS = ("pola_pvt", "pola_swin", "dit", "causal")
LONG_TOKENS = (4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class Shape:
    model: str
    stage: str
    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int
    causal: bool = False


@dataclass(frozen=True)
class Method:
    fn: Callable  # (q, k, v, extra) -> output
    backend: str | None = None  # the attention backend set while it runs
    layout: str = "bhnd"  # "bnhd": fla's (B, N, H, D); its inputs are made so, outside the timing


def model_shapes(batch: int, groups=GROUPS) -> list[Shape]:
    """The attention calls of the models in ``groups``, in that order (a run with a time limit does the first
    ones); ``batch`` images each, the long rows one sequence."""
    shapes = []
    for heads, (side, reduction) in zip((1, 2, 5, 8), ((56, 8), (28, 4), (14, 2), (7, 1))):
        n = side * side
        shapes.append(Shape("pola_pvt", f"{side}x{side}/sr{reduction}", batch, heads, n, n // reduction ** 2, 64))
    for heads, windows in zip((3, 6, 12), (64, 16, 4)):
        shapes.append(Shape("pola_swin", f"window7x7x{windows}", batch * windows, heads, 49, 49, 32))
    shapes.append(Shape("pola_swin", "global7x7", batch, 24, 49, 49, 32))
    for n in LONG_TOKENS:
        shapes.append(Shape("dit", f"N{n}", 1, 16, n, n, 64))
    for n in LONG_TOKENS:
        shapes.append(Shape("causal", f"N{n}", 1, 16, n, n, 64, causal=True))
    return [shape for group in groups for shape in shapes if shape.model == group]


SMOKE_SHAPES = [Shape("smoke", "tiny", 1, 2, 24, 6, 16), Shape("smoke", "tiny_causal", 1, 2, 24, 24, 16, causal=True)]


def environment(device: torch.device) -> dict:
    """What every row names: the card (or CPU), its driver, torch and triton."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if device.type != "cuda":
        return {"device": f"cpu ({platform.machine()})", "driver": "", "torch": torch.__version__,
                "triton": triton_version}
    return {"device": torch.cuda.get_device_name(device), "driver": _driver_version(), "torch": torch.__version__,
            "triton": triton_version}


def _driver_version() -> str:
    """The NVIDIA driver as nvidia-smi reports it; empty where it cannot be asked."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = result.stdout.split()
    return lines[0] if result.returncode == 0 and lines else ""


def _flash_bla_linear_attention():
    try:
        from flash_bla.ops.linear_attn.fused import linear_attention
    except ImportError:
        return None
    return linear_attention


def _fla_chunk_linear_attn():
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    return chunk_linear_attn


def _pacs_kernels_available() -> bool:
    from polaformer.backends import triton as triton_backend

    return triton_backend.available()


def _pola_streams(attend, q, k, v, power):
    """Pola's two streams the way flash_bla and fla compose them: features, the swapped query and two calls of
    ``attend(phi_q, phi_k, v_half)`` (normalised linear attention)."""
    # the fp32 exponent would promote the features: the peers' kernels take one dtype for every operand
    q_pos, q_neg, k_pos, k_neg = ((F.relu(x) ** power).to(x.dtype) for x in (q, -q, k, -k))
    phi_k = torch.cat([k_pos, k_neg], dim=-1)
    v_same, v_opposite = v.chunk(2, dim=-1)
    same = attend(torch.cat([q_pos, q_neg], dim=-1), phi_k, v_same)
    opposite = attend(torch.cat([q_neg, q_pos], dim=-1), phi_k, v_opposite)
    return torch.cat([same, opposite], dim=-1)


def methods(shape: Shape, smoke: bool) -> dict[str, Method]:
    """name → :class:`Method` for the methods that apply to ``shape`` here."""
    causal = shape.causal
    pola = lambda q, k, v, extra: pola_linear_attention(q, k, v, extra["power"], causal=causal)  # noqa: E731
    pacs = lambda q, k, v, extra: pacs_linear_attention(  # noqa: E731
        q, k, v, extra["temp_same"], extra["temp_opposite"], causal=causal)
    table = {
        "pola_triton": Method(pola, "triton"),
        "pola_torch": Method(pola, "torch"),
        "sdpa": Method(lambda q, k, v, extra: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
    }
    linear_attention = None if smoke or causal else _flash_bla_linear_attention()
    if linear_attention is not None and shape.keys == shape.queries:
        table["fbi_la"] = Method(lambda q, k, v, extra: _pola_streams(linear_attention, q, k, v, extra["power"]))
    chunk_linear_attn = _fla_chunk_linear_attn() if causal and not smoke else None
    if chunk_linear_attn is not None:
        attend = lambda phi_q, phi_k, v: chunk_linear_attn(phi_q, phi_k, v, scale=1.0)[0]  # noqa: E731  (normalised)
        table["fla_chunk"] = Method(  # the power (1, H, 1, D) as (1, 1, H, D) for fla's layout
            lambda q, k, v, extra: _pola_streams(attend, q, k, v, extra["power"].transpose(1, 2)), layout="bnhd")
    if _pacs_kernels_available():
        table["pacs_triton"] = Method(pacs, "triton")
        table["pacs_torch"] = Method(pacs, "torch")
    return table


def _inputs(shape: Shape, dtype, device, grad: bool, layout: str):
    """q, k, v, a function of the learned leaves giving the extra tensors (power, temperatures), and the output
    gradient: the same values for every method, in ``layout``."""
    gen = torch.Generator().manual_seed(0)
    b, h, d = shape.batch, shape.heads, shape.head_dim

    def tensor(n, scale=1.0, requires_grad=grad):
        x = (torch.randn(b, h, n, d, generator=gen) * scale).to(device=device, dtype=dtype)
        if layout == "bnhd":
            x = x.transpose(1, 2).contiguous()
        return x.requires_grad_(requires_grad)

    q, k, v = tensor(shape.queries, 0.5), tensor(shape.keys, 0.5), tensor(shape.keys)
    grad_out = tensor(shape.queries, requires_grad=False)
    weights = torch.zeros(1, h, 1, d, device=device, requires_grad=grad)
    same, opposite = (torch.full((1, h, 1, 2 * d), value, device=device, requires_grad=grad) for value in (0.0, 1.0))

    def extra():  # from the learned leaves in every step, as a model's forward computes them
        return {"power": learnable_power(weights, 4.0), "temp_same": torch.sigmoid(same),
                "temp_opposite": torch.sigmoid(opposite)}
    return q, k, v, extra, grad_out


def _step(fn, inputs, mode):
    q, k, v, extra, grad_out = inputs
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v, extra())
    else:
        def step():  # the extra tensors' graph is built inside the step, so a CUDA graph captures it whole
            fn(q, k, v, extra()).backward(grad_out)
    return step


def _graphed(step):
    """``step`` captured in a CUDA graph, after warm-up on a side stream as torch's documentation does; returns
    the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _time_gpu(step) -> float:
    import triton.testing

    step()  # compiles, tunes
    torch.cuda.synchronize()
    return triton.testing.do_bench(step, return_mode="median")


def _peak_mib(step) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def _time_once(step) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _one_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _run_method(method: Method, shape: Shape, dtype, device, mode: str, variants) -> dict:
    """The fields of one row: eager time and peak, then each asked variant's time, or each one's reason."""
    fields = {"ms": None, "peak_mib": None, "error": None}
    for variant in VARIANTS:
        fields[f"{variant}_ms"] = None
        fields[f"{variant}_error"] = ("CUDA only" if device.type != "cuda" else
                                      None if variant in variants else "not asked for")
    previous = dispatch.set_attention_backend(method.backend) if method.backend else None
    try:
        inputs = _inputs(shape, dtype, device, grad=mode == "fwd_bwd", layout=method.layout)
        step = _step(method.fn, inputs, mode)
        # Any failure is a result here (out of memory, an unsupported dtype, a kernel that does not compile,
        # a call that cannot be captured): the row records it and the run goes on.
        try:
            if device.type == "cuda":
                fields["ms"], fields["peak_mib"] = _time_gpu(step), _peak_mib(step)
            else:
                fields["ms"] = _time_once(step)
        except Exception as e:
            fields["error"] = _one_line(e)
        for variant in (v for v in VARIANTS if fields[f"{v}_error"] is None):
            try:
                if variant == "compiled":
                    timed = _step(torch.compile(method.fn, fullgraph=True), inputs, mode)
                else:
                    timed = _graphed(step)
                fields[f"{variant}_ms"] = _time_gpu(timed)
            except Exception as e:
                fields[f"{variant}_error"] = _one_line(e)
    finally:
        if method.backend:
            dispatch.set_attention_backend(previous)
    return fields


def _describe(fields: dict) -> str:
    parts = []
    for label, key in (("eager", "ms"), ("compiled", "compiled_ms"), ("graph", "graph_ms")):
        error = fields["error" if key == "ms" else key.replace("_ms", "_error")]
        parts.append(f"{label} {fields[key]:.3f} ms" if fields[key] is not None else f"{label}: {error}")
    return ", ".join(parts)


def run_gpu(*, batch: int = 8, dtypes=("bf16", "fp32"), modes=MODES, groups=GROUPS, variants=VARIANTS,
            smoke: bool = False, time_limit: float | None = None, log=print, on_shape_done=None) -> list[dict]:
    """One row per (shape, dtype, mode, method); see the module docstring for the fields. ``on_shape_done(rows)``
    is called with the rows so far after each shape, so that a run stopped early keeps what it measured; past
    ``time_limit`` seconds no further row is started."""
    if smoke:
        device, shapes = torch.device("cpu"), SMOKE_SHAPES
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("bench gpu needs a CUDA device (or --smoke, which runs on the CPU)")
        device, shapes = torch.device("cuda"), model_shapes(batch, groups)
    env = environment(device)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    rows = []
    # Every shape and mode recompiles the compiled calls: torch's default limit (8 per function) would
    # silently fall back to eager for the later rows.
    limits = nullcontext()
    if "compiled" in variants and device.type == "cuda":
        from torch import _dynamo

        limits = _dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536)
    with limits:
        for shape in shapes:
            for dtype_name in dtypes:
                for mode in modes:
                    for name, method in methods(shape, smoke).items():
                        if deadline is not None and time.monotonic() > deadline:
                            log(f"time limit of {time_limit:g} s reached: {len(rows)} rows")
                            if on_shape_done is not None:
                                on_shape_done(rows)
                            return rows
                        fields = _run_method(method, shape, DTYPES[dtype_name], device, mode, variants)
                        rows.append({"model": shape.model, "stage": shape.stage, "batch": shape.batch,
                                     "heads": shape.heads, "queries": shape.queries, "keys": shape.keys,
                                     "head_dim": shape.head_dim, "causal": shape.causal, "dtype": dtype_name,
                                     "mode": mode, "method": name, **fields, **env})
                        log(f"{shape.model} {shape.stage} {dtype_name} {mode} {name}: {_describe(fields)}")
            if on_shape_done is not None:
                on_shape_done(rows)
    return rows
