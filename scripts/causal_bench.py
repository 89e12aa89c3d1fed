"""Measure the causal attentions for docs/causal.md and print the tables as markdown.

    python scripts/causal_bench.py quality     # validation bits/byte of pola, pacs, elu, softmax LMs
    python scripts/causal_bench.py generate    # generation tokens/s and cache memory against context length
    python scripts/causal_bench.py train-step  # chunked causal op vs causal SDPA, forward + backward time
    python scripts/causal_bench.py all --threads 2 --plot docs/figures/causal_cpu.png

Times are the fastest of several repeats (the least disturbed by other work on the machine); memory is the
bytes the cache holds (state or keys and values), which does not depend on the machine.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import timm
import torch
import torch.nn.functional as F

import polaformer.models  # noqa: F401  (registers pola_lm_*)
from polaformer.ops import causal_pola_linear_attention
from polaformer.tasks.lm import lm_config, train_lm

ATTENTIONS = ("pola", "pacs", "elu", "softmax")


def _fastest(fn, repeats):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def quality(steps: int, context: int, model: str) -> None:
    print(f"| attention | parameters | valid bits/byte ({model}, {steps} steps, context {context}) | unigram |")
    print("| --- | ---: | ---: | ---: |")
    for attention in ATTENTIONS:
        cfg = lm_config(opts=["model.name", model, "model.attention", attention, "model.context", str(context),
                              "train.steps", str(steps), "train.eval_every", str(steps)])
        with tempfile.TemporaryDirectory() as out:
            summary = train_lm(cfg, out, overwrite=True, show_progress=False)
        print(f"| {attention} | {summary['parameters']:,} | {summary['best_valid_bpb']:.3f} | "
              f"{summary['unigram_valid_bpb']:.3f} |", flush=True)


def _cache_bytes(caches) -> int:
    def walk(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (tuple, list)):
            return sum(walk(y) for y in x)
        return 0
    return walk(caches)


@torch.no_grad()
def generate(lengths, model_name: str, new_tokens: int, repeats: int) -> list[dict]:
    rows = []
    print("| context | attention | tokens/s | cache memory |")
    print("| ---: | --- | ---: | ---: |")
    for length in lengths:
        for attention in ("pola", "softmax"):
            model = timm.create_model(model_name, attention=attention, context=length + new_tokens).eval()
            prompt = torch.randint(0, 256, (1, length))
            _, caches = model.step(prompt)  # the prefix, in parallel

            def decode():
                state, token = caches, prompt[:, -1:]
                for i in range(new_tokens):
                    logits, state = model.step(token, state, length + i)
                    token = logits[:, -1].argmax(dim=-1, keepdim=True)
                return state

            seconds = _fastest(decode, repeats)
            memory = _cache_bytes(caches)
            rows.append({"context": length, "attention": attention, "tokens_per_s": new_tokens / seconds,
                         "cache_mib": memory / 2**20})
            print(f"| {length:,} | {attention} | {new_tokens / seconds:,.0f} | {memory / 2**20:.2f} MiB |",
                  flush=True)
    return rows


def train_step(lengths, heads: int, head_dim: int, chunk_size: int, repeats: int) -> list[dict]:
    rows = []
    print("| tokens | chunked causal Pola (ms) | causal SDPA (ms) | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    power = torch.full((1, heads, 1, head_dim), 3.0)
    for n in lengths:
        q, k, v = (torch.randn(1, heads, n, head_dim, requires_grad=True) for _ in range(3))
        pola = _fastest(lambda: causal_pola_linear_attention(q, k, v, power, chunk_size=chunk_size).sum().backward(),
                        repeats)
        sdpa = _fastest(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), repeats)
        rows.append({"tokens": n, "pola_ms": pola * 1e3, "sdpa_ms": sdpa * 1e3})
        print(f"| {n:,} | {pola * 1e3:.1f} | {sdpa * 1e3:.1f} | {sdpa / pola:.2f} |", flush=True)
    return rows


def plot(generation: list[dict], steps: list[dict], path: str) -> None:
    """Tokens/s and cache memory against context (generation), step time against length (training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p, rows in (("speed", generation), ("memory", generation), ("train", steps)) if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "train":
            for key, label in (("pola_ms", "chunked causal Pola"), ("sdpa_ms", "causal SDPA")):
                ax.plot([r["tokens"] for r in steps], [r[key] for r in steps], "o-", label=label)
            ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="forward + backward (ms)",
                   title="training step (op alone)")
        else:
            key, ylabel = ("tokens_per_s", "tokens/s") if panel == "speed" else ("cache_mib", "cache (MiB)")
            for attention, label in (("pola", "Pola, recurrent state"), ("softmax", "softmax, KV cache")):
                rows = [r for r in generation if r["attention"] == attention]
                ax.plot([r["context"] for r in rows], [r[key] for r in rows], "o-", label=label)
            ax.set(xscale="log", xlabel="context length", ylabel=ylabel,
                   title="generation speed" if panel == "speed" else "generation cache",
                   yscale="log" if panel == "memory" else "linear")
        lengths = [r["tokens"] for r in steps] if panel == "train" else sorted({r["context"] for r in generation})
        ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths], minor=False)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("quality", "generate", "train-step", "all"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="pola_lm_tiny")
    parser.add_argument("--steps", type=int, default=300, help="training steps per model (quality)")
    parser.add_argument("--context", type=int, default=128, help="training context (quality)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768],
                        help="context lengths (generate)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens timed per context length (generate)")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192],
                        help="sequence lengths (train-step)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="PNG of the generation and training-step measurements")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.table in ("quality", "all"):
        quality(args.steps, args.context, args.model)
    generation = steps = []
    if args.table in ("generate", "all"):
        generation = generate(args.lengths, args.model, args.new_tokens, args.repeats)
    if args.table in ("train-step", "all"):
        steps = train_step(args.seq_lengths, 4, 32, 64, args.repeats)
    if args.plot and (generation or steps):
        plot(generation, steps, args.plot)


if __name__ == "__main__":
    main()
