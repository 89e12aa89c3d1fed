"""Forward+backward timing of the fused Pola op against two baselines.

(a) the straightforward two-stream formulation of the official code: four
    power calls, the swapped query concatenated explicitly, two kᵀv products;
(b) torch's scaled_dot_product_attention (softmax, O(N²)).

All three are timed side by side in one run with torch.utils.benchmark.

    python benchmarks/bench_attention.py                 # N = 196, 3136, 12544
    python benchmarks/bench_attention.py --tokens 3136 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from polaformer.ops import learnable_power, pola_linear_attention
from polaformer.runtime import tune_cpu_allocator


def two_stream_pola(q, k, v, power, eps=1e-6):
    """The official PolaFormer computation, written the straightforward way."""
    m = k.shape[-2]
    q_pos, q_neg = F.relu(q) ** power, F.relu(-q) ** power
    k_pos, k_neg = F.relu(k) ** power, F.relu(-k) ** power
    q_same = torch.cat([q_pos, q_neg], dim=-1)
    q_opp = torch.cat([q_neg, q_pos], dim=-1)
    phi_k = torch.cat([k_pos, k_neg], dim=-1)
    v_same, v_opp = v.chunk(2, dim=-1)
    k_mean = phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1)
    out_same = q_same @ (phi_k.transpose(-2, -1) @ v_same / m) / (q_same @ k_mean + eps)
    out_opp = q_opp @ (phi_k.transpose(-2, -1) @ v_opp / m) / (q_opp @ k_mean + eps)
    return torch.cat([out_same, out_opp], dim=-1)


def softmax_sdpa(q, k, v, power=None):
    return F.scaled_dot_product_attention(q, k, v)


METHODS = {
    "fused_pola": pola_linear_attention,
    "two_stream_pola": two_stream_pola,
    "sdpa_softmax": softmax_sdpa,
}


def make_inputs(batch, heads, tokens, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, tokens, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    weight = torch.randn(1, heads, 1, head_dim, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v, weight


def time_fwd_bwd(fn, q, k, v, weight, min_run_time):
    grad = torch.randn(q.shape[:-1] + (v.shape[-1],))

    def step():
        for t in (q, k, v, weight):
            t.grad = None
        out = fn(q, k, v, learnable_power(weight, 4.0))
        out.backward(grad)

    step()  # warm-up
    timer = benchmark.Timer(stmt="step()", globals={"step": step})
    return timer.blocked_autorange(min_run_time=min_run_time).median


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[196, 3136, 12544])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's default mmap thresholds (fresh large buffers page-fault)")
    args = parser.parse_args(argv)
    allocator_tuned = not args.default_malloc and tune_cpu_allocator()

    rows = []
    for n in args.tokens:
        q, k, v, weight = make_inputs(args.batch, args.heads, n, args.head_dim)
        times = {name: time_fwd_bwd(METHODS[name], q, k, v, weight, args.min_run_time) for name in args.methods}
        rows.append({"tokens": n, **{f"{name}_ms": t * 1e3 for name, t in times.items()}})

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, B={args.batch} H={args.heads} d={args.head_dim}, forward+backward, "
          f"allocator reuse {'on' if allocator_tuned else 'off'}")
    header = ["N"] + [f"{m} (ms)" for m in args.methods]
    if "fused_pola" in args.methods:
        header += [f"{m}/fused" for m in args.methods if m != "fused_pola"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [str(row["tokens"])] + [f"{row[f'{m}_ms']:.2f}" for m in args.methods]
        if "fused_pola" in args.methods:
            cells += [f"{row[f'{m}_ms'] / row['fused_pola_ms']:.2f}x" for m in args.methods if m != "fused_pola"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
