"""PolaFormer++'s PaCS attention: the fused kernel against the plain functional formulation.

"functional" is the op's graph-capture path (``pacs_attention_graph``: features per stream, stacked,
RoPE by ``apply_rope``, autograd backward), which was the eager implementation before the fused
kernel. Shapes are the linear stages of POLA_b0 at 224 px (head_dim 32, RoPE on). Both are timed
interleaved, several rounds, with torch.utils.benchmark; medians in ms.

    polaformer bench pacs --batch 8 --rounds 5
"""
from __future__ import annotations

import torch

from polaformer.ops import rope_2d, rope_angles
from polaformer.ops.pacs.autograd import PacsAttention
from polaformer.ops.pacs.formulation import pacs_attention_graph

from .harness import interleaved, markdown_table, medians

IMPLEMENTATIONS = {"functional": pacs_attention_graph, "fused": PacsAttention.apply}
MODES = ("fwd", "fwd_bwd")
SHAPES = ((1, 56), (2, 28), (4, 14))  # (heads, side) of POLA_b0's linear stages at 224 px
HEAD_DIM = 32


def steps_for(batch, heads, side, head_dim):
    n = side * side
    gen = torch.Generator().manual_seed(0)
    # q, k, v as the layers hand them over: head views of a token-major projection
    q, k, v = (torch.randn(batch, n, heads, head_dim, generator=gen).transpose(1, 2).requires_grad_()
               for _ in range(3))
    s1, s2 = (torch.rand(1, heads, 1, 2 * head_dim, generator=gen).requires_grad_() for _ in range(2))
    sin, cos = rope_2d(rope_angles(2 * head_dim * heads, heads), side, side)
    steps = {}
    for name, fn in IMPLEMENTATIONS.items():
        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v, s1, s2, sin, cos, 1e-6, None, n)

        def forward_backward(fn=fn):
            fn(q, k, v, s1, s2, sin, cos, 1e-6, None, n).sum().backward()

        steps[(name, "fwd")], steps[(name, "fwd_bwd")] = forward, forward_backward
    return steps


def run_pacs(*, batch: int = 8, threads: int = 2, rounds: int = 5, min_time: float = 0.2,
             shapes=SHAPES) -> list[dict]:
    """Functional against fused, forward and forward+backward, at every (heads, side); medians in ms."""
    torch.set_num_threads(threads)
    rows = []
    for heads, side in shapes:
        times = medians(interleaved(steps_for(batch, heads, side, HEAD_DIM), rounds, min_time, threads=threads))
        for mode in MODES:
            plain, fused = (times[(name, mode)] * 1e3 for name in IMPLEMENTATIONS)
            rows.append({"heads": heads, "tokens": side * side, "head_dim": HEAD_DIM, "mode": mode,
                         "functional_ms": plain, "fused_ms": fused, "ratio": plain / fused})
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["heads × N × head_dim", "pass", "functional ms", "fused ms", "functional/fused"],
        [[f"{r['heads']} × {r['tokens']} × {r['head_dim']}", r["mode"], f"{r['functional_ms']:.2f}",
          f"{r['fused_ms']:.2f}", f"{r['ratio']:.2f}"] for r in rows]) + "\n"
