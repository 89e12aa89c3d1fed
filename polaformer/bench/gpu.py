"""The Triton attention kernels on a GPU: time and peak memory at the models' shapes.

Methods, each forward and forward+backward, in bf16 and fp32:

- ``pola_triton``: :func:`~polaformer.ops.pola_linear_attention` on the Triton kernels;
- ``pola_torch``: the same op on its torch formulation (backend ``torch``);
- ``sdpa``: ``F.scaled_dot_product_attention`` (softmax; flash attention where torch picks it, bf16);
- ``fbi_la``: the Pola streams composed from flash-bidirectional-linear-attention's fused linear attention
  (``flash_bla``), when that package imports; keys equal queries only;
- ``pacs_triton`` / ``pacs_torch``: :func:`~polaformer.ops.pacs_linear_attention`, when the Triton backend
  has PaCS kernels.

Shapes: Pola-PVT's stages (head width 64, N = 3136/784/196/49 with spatially reduced keys M = N/64, N/16,
N/4, N), Pola-Swin's 7×7 windows and last global stage (head width 32), and DiT/high-resolution token counts
(4k to 32k, M = N). Times are ``triton.testing.do_bench`` medians in ms; peak memory is the CUDA allocator's
peak above what was allocated before the call.

``--smoke`` runs every method once at one tiny shape on the CPU (the Triton kernels under
``TRITON_INTERPRET=1``), to check the command, not to time anything.

    polaformer bench gpu --out gpu.csv
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polaformer.ops import dispatch, learnable_power, pacs_linear_attention, pola_linear_attention

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "fwd_bwd")


@dataclass(frozen=True)
class Shape:
    model: str
    stage: str
    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int


def model_shapes(batch: int) -> list[Shape]:
    """The attention calls of the models, ``batch`` images (or sequences) each."""
    shapes = []
    for heads, (side, reduction) in zip((1, 2, 5, 8), ((56, 8), (28, 4), (14, 2), (7, 1))):
        n = side * side
        shapes.append(Shape("pola_pvt", f"{side}x{side}/sr{reduction}", batch, heads, n, n // reduction ** 2, 64))
    for heads, windows in zip((3, 6, 12), (64, 16, 4)):
        shapes.append(Shape("pola_swin", f"window7x7x{windows}", batch * windows, heads, 49, 49, 32))
    shapes.append(Shape("pola_swin", "global7x7", batch, 24, 49, 49, 32))
    for n in (4096, 8192, 16384, 32768):
        shapes.append(Shape("dit", f"N{n}", 1, 16, n, n, 64))
    return shapes


SMOKE_SHAPES = [Shape("smoke", "tiny", 1, 2, 24, 6, 16)]


def _flash_bla_linear_attention():
    try:
        from flash_bla.ops.linear_attn.fused import linear_attention
    except ImportError:
        return None
    return linear_attention


def _pacs_kernels_available() -> bool:
    from polaformer.backends import triton as triton_backend

    return triton_backend.available() and hasattr(triton_backend, "pacs_attention")


def _with_backend(name: str, fn):
    def call(*args):
        previous = dispatch.set_attention_backend(name)
        try:
            return fn(*args)
        finally:
            dispatch.set_attention_backend(previous)
    return call


def _pola_two_calls(linear_attention):
    """Pola's streams the way flash_bla composes them: features, the swapped query and two fused calls."""
    def pola(q, k, v, power):
        q_pos, q_neg, k_pos, k_neg = (F.relu(x) ** power for x in (q, -q, k, -k))
        phi_k = torch.cat([k_pos, k_neg], dim=-1)
        v_same, v_opposite = v.chunk(2, dim=-1)
        same = linear_attention(torch.cat([q_pos, q_neg], dim=-1), phi_k, v_same)
        opposite = linear_attention(torch.cat([q_neg, q_pos], dim=-1), phi_k, v_opposite)
        return torch.cat([same, opposite], dim=-1)
    return pola


def methods(shape: Shape, smoke: bool) -> dict:
    """name → callable(q, k, v, extra) for the methods that apply to ``shape`` here."""
    pola = lambda q, k, v, extra: pola_linear_attention(q, k, v, extra["power"])  # noqa: E731
    pacs = lambda q, k, v, extra: pacs_linear_attention(q, k, v, extra["temp_same"], extra["temp_opposite"])  # noqa: E731
    table = {
        "pola_triton": _with_backend("triton", pola),
        "pola_torch": _with_backend("torch", pola),
        "sdpa": lambda q, k, v, extra: F.scaled_dot_product_attention(q, k, v),
    }
    linear_attention = None if smoke else _flash_bla_linear_attention()
    if linear_attention is not None and shape.keys == shape.queries:
        composed = _pola_two_calls(linear_attention)
        table["fbi_la"] = lambda q, k, v, extra: composed(q, k, v, extra["power"])
    if _pacs_kernels_available():
        table["pacs_triton"] = _with_backend("triton", pacs)
        table["pacs_torch"] = _with_backend("torch", pacs)
    return table


def _inputs(shape: Shape, dtype, device, grad: bool):
    gen = torch.Generator().manual_seed(0)

    def tensor(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_(grad)

    b, h, d = shape.batch, shape.heads, shape.head_dim
    q, k, v = tensor(b, h, shape.queries, d, scale=0.5), tensor(b, h, shape.keys, d, scale=0.5), tensor(b, h, shape.keys, d)
    weights = torch.zeros(1, h, 1, d, device=device, requires_grad=grad)
    extra = {
        "power": learnable_power(weights, 4.0),
        "temp_same": torch.sigmoid(torch.zeros(1, h, 1, 2 * d, device=device, requires_grad=grad)),
        "temp_opposite": torch.sigmoid(torch.ones(1, h, 1, 2 * d, device=device, requires_grad=grad)),
    }
    return q, k, v, extra


def _step(fn, shape, dtype, device, mode):
    q, k, v, extra = _inputs(shape, dtype, device, grad=mode == "fwd_bwd")
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v, extra)
    else:
        grad_out = torch.randn(shape.batch, shape.heads, shape.queries, shape.head_dim, device=device, dtype=dtype)

        def step():
            fn(q, k, v, extra).backward(grad_out, retain_graph=True)
    return step


def _measure_gpu(step) -> tuple[float, float]:
    import triton.testing

    step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, return_mode="median")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def _measure_once(step) -> tuple[float, None]:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3, None


def run_gpu(*, batch: int = 8, dtypes=("bf16", "fp32"), modes=MODES, smoke: bool = False, log=print,
            on_shape_done=None) -> list[dict]:
    """One row per (shape, dtype, mode, method): ms and peak MiB (None in ``--smoke``). ``on_shape_done(rows)``
    is called with the rows so far after each shape, so that a run stopped early keeps what it measured."""
    if smoke:
        device, measure, shapes = torch.device("cpu"), _measure_once, SMOKE_SHAPES
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("bench gpu needs a CUDA device (or --smoke, which runs on the CPU)")
        device, measure, shapes = torch.device("cuda"), _measure_gpu, model_shapes(batch)
    rows = []
    for shape in shapes:
        for dtype_name in dtypes:
            for mode in modes:
                for name, fn in methods(shape, smoke).items():
                    try:
                        ms, peak = measure(_step(fn, shape, DTYPES[dtype_name], device, mode))
                        error = None
                    except (RuntimeError, ValueError) as e:  # e.g. out of memory, an unsupported dtype
                        ms, peak, error = None, None, str(e).splitlines()[0]
                    rows.append({"model": shape.model, "stage": shape.stage, "batch": shape.batch,
                                 "heads": shape.heads, "queries": shape.queries, "keys": shape.keys,
                                 "head_dim": shape.head_dim, "dtype": dtype_name, "mode": mode, "method": name,
                                 "ms": ms, "peak_mib": peak, "error": error})
                    log(f"{shape.model} {shape.stage} {dtype_name} {mode} {name}: "
                        + (f"{ms:.3f} ms" if ms is not None else f"failed ({error})"))
        if on_shape_done is not None:
            on_shape_done(rows)
    return rows
