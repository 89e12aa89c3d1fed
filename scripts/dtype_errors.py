"""The error of the Triton layer ops against float64, per input dtype: the table of docs/gpu.md ("Precision").

Runs ``pola_layer_attention`` (a Pola layer's call: raw scale and exponent weights, key positions, a class token,
local branch and gate) and ``pacs_layer_attention`` (RoPE, local branch and gate) with fp32, bf16 and fp16
projections (the parameters fp32, as under autocast) on the same values rounded to each dtype, and prints
RMS(result − float64 result) / RMS(float64 result) of the output and of every gradient. In Triton's interpreter
on the CPU (``TRITON_INTERPRET=1``, set here), which rounds bf16 operands as a GPU does and runs TF32 as fp32:
the bf16 and fp16 rows are a card's, the fp32 row is ``torch.get_float32_matmul_precision() == "highest"``'s.

    python scripts/dtype_errors.py [--tokens 100] [--width 32]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from polaformer.ops import (  # noqa: E402
    naive_pacs_layer_attention,
    naive_pola_layer_attention,
    pacs_layer_attention,
    pola_layer_attention,
    rope_2d,
    rope_angles,
)
from polaformer.ops.dispatch import set_attention_backend  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAMETERS = ("scale", "power", "key_positions", "same", "opposite")


def relative_rms(actual, expected) -> float:
    expected = expected.double()
    return ((actual.double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def errors(op, reference, shapes: dict, dtype, options: dict) -> dict:
    generator = torch.Generator().manual_seed(0)
    values = {name: torch.randn(shape, generator=generator, dtype=torch.float64) for name, shape in shapes.items()}
    values["scale"] = values.get("scale", torch.zeros(1)) * 0.3  # near the layers' initial softplus(0)
    leaves = {name: value.to(torch.float32 if name in PARAMETERS else dtype).requires_grad_()
              for name, value in values.items() if name in shapes}
    exact = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    out = op(**leaves, **options)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, list(leaves.values()), grad.to(out.dtype))
    expected = reference(**exact, **options)
    expected_grads = torch.autograd.grad(expected, list(exact.values()), grad)
    return {"out": relative_rms(out, expected),
            **{f"d{name}": relative_rms(g, e) for name, g, e in zip(leaves, grads, expected_grads)}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100, help="grid tokens per image (a square)")
    parser.add_argument("--width", type=int, default=32, help="head width")
    args = parser.parse_args(argv)
    set_attention_backend("triton")
    n, d, side = args.tokens, args.width, int(args.tokens ** 0.5)
    pola = dict(q=(2, 2, n + 1, d), k=(2, 2, n + 1, d), v=(2, 2, n + 1, d), scale=(1, 2, 1, d), power=(1, 2, 1, d),
                key_positions=(1, 2, n + 1, d), local=(2, 2, n, d), gate=(2, 2, n + 1, d))
    pacs = dict(q=(2, 2, n, d), k=(2, 2, n, d), v=(2, 2, n, d), same=(1, 2, 1, 2 * d), opposite=(1, 2, 1, 2 * d),
                local=(2, 2, n, d), gate=(2, 2, n, d))
    sin, cos = rope_2d(rope_angles(2 * d, 1), side, n // side)
    for label, op, reference, shapes, options in (
            ("pola_layer_attention", pola_layer_attention, naive_pola_layer_attention, pola, dict(alpha=4.0)),
            ("pacs_layer_attention", pacs_layer_attention, naive_pacs_layer_attention, pacs,
             dict(sin=sin.double(), cos=cos.double()))):
        print(f"{label}: 2 images, 2 heads of {d} channels, {n} tokens")
        rows = {name: errors(op, reference, shapes, dtype, options) for name, dtype in DTYPES.items()}
        columns = list(next(iter(rows.values())))
        print("| inputs | " + " | ".join(columns) + " |")
        print("|---" * (len(columns) + 1) + "|")
        for name, row in rows.items():
            print(f"| {name} | " + " | ".join(f"{row[c]:.1e}" for c in columns) + " |")


if __name__ == "__main__":
    main()
