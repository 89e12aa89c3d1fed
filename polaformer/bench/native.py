"""The fused native CPU kernels against the torch-op versions of the same stages, in one process.

Each case runs twice per round, once with ``polaformer/csrc`` kernels and once with the torch ops
(the attention module's kernel lookup switched off), interleaved for several rounds; the table gives
medians and the ratio torch ops / native (> 1: the kernels are faster). Cases: the Pola and PaCS ops
at the shapes of the models' stages (inference and forward+backward), and optionally whole models.

    polaformer bench native
    polaformer bench native --models pola_pvt_tiny POLA_b0 --batches 1 8 --rounds 5 --json out.json
"""
from __future__ import annotations

from typing import Callable

import torch

import polaformer.backends.cpu.native as native_module
from polaformer.backends.cpu.native import native_kernels
from polaformer.ops import learnable_power, pacs_linear_attention, pola_linear_attention, rope_2d, rope_angles

from .harness import interleaved, medians

# (batch, heads, tokens, head_dim): PVT-T stage 1 and 3, Swin-T stage 1 windows, DeiT-T, PolaFormer++ B0 stage 1
POLA_SHAPES = [(1, 1, 3136, 64), (8, 1, 3136, 64), (8, 5, 196, 64), (64, 3, 49, 32), (8, 3, 197, 64)]
PACS_SHAPES = [(1, 1, 56, 32), (8, 1, 56, 32), (8, 2, 28, 32)]  # (batch, heads, side, head_dim), with RoPE


def pola_case(shape, train):
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_(train) for _ in range(3))
    w = torch.zeros(1, h, 1, d, requires_grad=train)

    def step():
        out = pola_linear_attention(q, k, v, learnable_power(w, 4.0))
        if train:
            out.sum().backward()
    return step


def pacs_case(shape, train):
    b, h, side, d = shape
    n = side * side
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_(train) for _ in range(3))
    temps = [torch.rand(1, h, 1, 2 * d, generator=gen).requires_grad_(train) for _ in range(2)]
    sin, cos = rope_2d(rope_angles(2 * d * h, h), side, side)

    def step():
        out = pacs_linear_attention(q, k, v, *temps, sin, cos)
        if train:
            out.sum().backward()
    return step


def model_case(name, batch, train):
    import timm

    import polaformer.models  # noqa: F401  (registers the models)
    from polaformer import accelerate

    model = timm.create_model(name, num_classes=1000).train(train)
    model = accelerate(model) if train else accelerate(model, inference=True)
    x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))

    def step():
        if train:
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        else:
            with torch.inference_mode():
                model(x)
    return step


def time_ab(step, rounds, threads, min_time, steps=None):
    """Medians over ``rounds`` of each variant's sample: ``steps`` calls per sample if given (whole models,
    whose single steps are noisy), else torch.utils.benchmark's blocked autorange of ``min_time`` seconds."""
    native = native_kernels()
    original = native_module.native_kernels

    def with_lookup(lookup):
        def run():
            native_module.native_kernels = lookup  # what ops.dispatch asks for the kernels
            step()
        return run

    variants = {"torch ops": with_lookup(lambda: None), "native": with_lookup(lambda: native)}
    try:
        return medians(interleaved(variants, rounds, min_time, calls=steps, threads=threads))
    finally:
        native_module.native_kernels = original


def run_native(*, models=(), batches=(1, 8), threads: int = 2, rounds: int = 3, min_time: float = 0.3,
               model_steps: int = 6, pola_shapes=None, pacs_shapes=None,
               log: Callable[[str], None] = print) -> list[dict]:
    """The op cases (and ``models`` at each batch), inference and training: torch ops against native.

    ``pola_shapes``/``pacs_shapes`` default to the models' stage shapes. Raises RuntimeError where the
    native kernels cannot be built.
    """
    torch.set_num_threads(threads)
    if native_kernels() is None:
        raise RuntimeError("the native kernels are not available here (see the log); nothing to compare")
    cases = [(f"pola {s}", pola_case, s, None) for s in (POLA_SHAPES if pola_shapes is None else pola_shapes)]
    cases += [(f"pacs+rope {s}", pacs_case, s, None) for s in (PACS_SHAPES if pacs_shapes is None else pacs_shapes)]
    cases += [(f"{m} b{b}", lambda spec, train: model_case(*spec, train), (m, b), model_steps)
              for m in models for b in batches]
    rows = []
    for label, make, spec, steps in cases:
        for train in (False, True):
            with torch.set_grad_enabled(train):
                result = time_ab(make(spec, train), rounds, threads, min_time, steps)
            ratio = result["torch ops"] / result["native"]
            mode = "train" if train else "infer"
            rows.append({"case": label, "mode": mode, **{k: v * 1e3 for k, v in result.items()},
                         "ratio": ratio})
            log(f"{label:32s} {mode}  torch ops {result['torch ops'] * 1e3:9.2f} ms  native "
                f"{result['native'] * 1e3:9.2f} ms  torch ops/native {ratio:.2f}")
    return rows
