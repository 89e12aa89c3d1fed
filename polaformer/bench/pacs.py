"""PolaFormer++'s PaCS attention: the fused kernel against the plain functional formulation.

"functional" is the op's graph-capture path (``_pacs_attention_graph``: features per stream, stacked,
RoPE by ``apply_rope``, autograd backward), which was the eager implementation before the fused
kernel. Shapes are the linear stages of POLA_b0 at 224 px (head_dim 32, RoPE on). Both are timed
interleaved, several rounds, with torch.utils.benchmark; medians in ms.

    python benchmarks/bench_pacs.py --batch 8 --rounds 5
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils import benchmark

from polaformer.ops import rope_2d, rope_angles
from polaformer.ops.pola_attention import _pacs_attention_graph, _PacsAttention
from polaformer.runtime import tune_cpu_allocator

IMPLEMENTATIONS = {"functional": _pacs_attention_graph, "fused": _PacsAttention.apply}


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    print("| heads × N × head_dim | pass | functional ms | fused ms | functional/fused |")
    print("|---|---|---|---|---|")
    for heads, side in ((1, 56), (2, 28), (4, 14)):
        steps = steps_for(args.batch, heads, side, 32)
        for fn in steps.values():
            fn()
        samples = {key: [] for key in steps}
        for _ in range(args.rounds):
            for key, fn in steps.items():
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=args.threads)
                samples[key].append(timer.blocked_autorange(min_run_time=args.min_time).median * 1e3)
        for mode in ("fwd", "fwd_bwd"):
            plain, fused = (statistics.median(samples[(name, mode)]) for name in IMPLEMENTATIONS)
            print(f"| {heads} × {side * side} × 32 | {mode} | {plain:.2f} | {fused:.2f} | {plain / fused:.2f} |")


if __name__ == "__main__":
    main()
