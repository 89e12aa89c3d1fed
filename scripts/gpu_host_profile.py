"""Host cost of one eager attention call on a CUDA GPU: how long issuing a call takes without synchronising (the
bound on eager speed when the kernels are small), and a cProfile of the Python side by own time.

    python scripts/gpu_host_profile.py [--batch 8 --heads 2 --queries 784 --keys 49 --dim 64 --calls 300]

Pola and PaCS on the Triton kernels against SDPA, bf16, forward and forward+backward. docs/gpu.md ("Measured")
gives the figures of the last run.
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

from polaformer.ops import dispatch, learnable_power, pacs_linear_attention, pola_linear_attention


def issue_and_total_us(step, calls: int) -> tuple[float, float]:
    """Microseconds per call to issue ``calls`` calls, and to finish them."""
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 8), ("heads", 2), ("queries", 784), ("keys", 49), ("dim", 64), ("calls", 300)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    b, h, n, m, d = args.batch, args.heads, args.queries, args.keys, args.dim

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    q, k, v = leaf(b, h, n, d), leaf(b, h, m, d), leaf(b, h, m, d)
    power = learnable_power(leaf(1, h, 1, d, dtype=torch.float32), 4.0)
    temperature = torch.sigmoid(leaf(1, h, 1, 2 * d, dtype=torch.float32))
    grad = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    calls = {
        "pola": lambda: pola_linear_attention(q, k, v, power),
        "pacs": lambda: pacs_linear_attention(q, k, v, temperature, temperature),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    }
    dispatch.set_attention_backend("triton")
    steps = {}
    for name, call in calls.items():
        steps[(name, "fwd")] = lambda call=call: torch.no_grad()(call)()
        steps[(name, "fwd+bwd")] = lambda call=call: call().backward(grad, retain_graph=True)
    for (name, mode), step in steps.items():
        issued, total = issue_and_total_us(step, args.calls)
        print(f"{name} {mode}: issued in {issued:.1f} µs/call, finished in {total:.1f} µs/call")
    for (name, mode), step in steps.items():
        if name == "sdpa":
            continue
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            step()
        profile.disable()
        torch.cuda.synchronize()
        print(f"=== {name} {mode}: cProfile of 200 calls, by own time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
