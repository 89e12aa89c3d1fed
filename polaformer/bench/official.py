"""Whole-model speed against the official code: inference and training step, same weights, one process.

The official models are built from a local checkout of the authors' code (nothing is fetched):

    POLAFORMER_OFFICIAL_DIR     root of a ZacharyMeng/PolaFormer checkout (models/pola_pvt.py, models/pola_swin.py)
    POLAFORMERPP_OFFICIAL_DIR   root of a ZacharyMeng/PolaFormerPP checkout (polaformer++/models/pola.py)

A family whose checkout is not given is skipped with a message. Pola-DeiT and Pola-PVTv2 have no
official class: their baseline is our model with each attention layer running the official
formulation (``OfficialWayPola`` below: four power calls, the swapped query concatenated, two kᵀv
products, ``contiguous`` head splits), so the comparison isolates what the fused path buys.

Every pair gets the same weights (the official state_dict loaded strictly into ours) and is checked
for equal outputs before timing. Official and ours are timed interleaved, several rounds, with
torch.utils.benchmark; the tables give medians and the ratio official/ours (> 1: ours faster).

    python benchmarks/bench_models_vs_official.py --threads 2 --json out.json --markdown out.md
    python benchmarks/bench_models_vs_official.py --models pola_pvt_tiny --batches 8 --modes train
    python benchmarks/bench_models_vs_official.py --compile     # adds torch.compile'd ours
    python benchmarks/bench_models_vs_official.py --floor       # adds ours without attention cores (the bound)
    python benchmarks/bench_models_vs_official.py --matmul-floor  # adds ours with linear attention = its products
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import os
import platform
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import polaformer.models  # noqa: F401  (registers our architectures)
import timm
from polaformer.layers import Linear, Mlp, PolaLinearAttention
from polaformer.models.pvt_v2 import DepthwiseConvMlp
from polaformer.runtime import tune_cpu_allocator

PP_ENV, POLA_ENV = "POLAFORMERPP_OFFICIAL_DIR", "POLAFORMER_OFFICIAL_DIR"


# --- official code, loaded from a checkout -----------------------------------------------------

def _stub_unused_imports() -> None:
    """The official files import einops and fvcore without using them; stand in for them if absent."""
    for name, attrs in (("einops", {"rearrange": None}), ("einops.layers", {}),
                        ("einops.layers.torch", {"Rearrange": None}),
                        ("fvcore", {}), ("fvcore.nn", {"FlopCountAnalysis": None, "flop_count_table": None})):
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module


def _load_official_file(path: Path, name: str) -> types.ModuleType:
    """Import one official model file without letting its @register_model replace ours in timm."""
    import timm.models.registry as shim

    _stub_unused_imports()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = shim.register_model
    shim.register_model = lambda fn: fn
    try:
        spec.loader.exec_module(module)
    finally:
        shim.register_model = saved
    return module


def _quiet(build):
    with contextlib.redirect_stdout(io.StringIO()):  # the official constructors print per layer
        return build()


def official_pvt_tiny(root: Path):
    mod = _load_official_file(root / "models" / "pola_pvt.py", "official_pola_pvt")
    return _quiet(lambda: mod.pola_pvt_tiny(
        drop_path_rate=0.0, alpha=4, kernel_size=5, attn_type="LLLL", la_sr_ratios="1111"))  # as the official build)


def official_swin_t(root: Path):
    mod = _load_official_file(root / "models" / "pola_swin.py", "official_pola_swin")
    return _quiet(lambda: mod.PolaSwinTransformer(
        img_size=224, patch_size=4, in_chans=3, num_classes=1000, embed_dim=96, depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24], window_size=56, mlp_ratio=4.0, qkv_bias=True, qk_scale=None, drop_rate=0.0,
        drop_path_rate=0.0, ape=False, patch_norm=True, use_checkpoint=False, alpha=4, kernel_size=5,
        attn_type="LLSS"))


def official_polapp_b0(root: Path):
    mod = _load_official_file(root / "polaformer++" / "models" / "pola.py", "official_polapp")
    model = _quiet(mod.POLA_b0)
    for m in model.modules():  # the factory hard-codes drop_path_rate=0.1; timing wants no randomness
        if type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    return model


# --- "official way" attention for the families without official code ---------------------------

class OfficialWayPola(PolaLinearAttention):
    """Our layer's parameters, the official PolaFormer forward: unfused two-stream attention."""

    def forward(self, x, height, width):
        b, n, c = x.shape
        q, k, v, g = self._project(x, height, width)
        m = k.shape[1]
        if self.positional_encoding is not None:
            k = k + self._key_positions((height // self.sr_ratio, width // self.sr_ratio))
        scale = F.softplus(self.scale)
        power = 1 + self.alpha * torch.sigmoid(self.power)
        q, k = q / scale, k / scale
        q = q.reshape(b, n, self.num_heads, -1).permute(0, 2, 1, 3).contiguous()
        k = k.reshape(b, m, self.num_heads, -1).permute(0, 2, 1, 3).contiguous()
        v = v.reshape(b, m, self.num_heads, -1).permute(0, 2, 1, 3).contiguous()
        q_pos, q_neg = F.relu(q) ** power, F.relu(-q) ** power
        k_pos, k_neg = F.relu(k) ** power, F.relu(-k) ** power
        q_sim, q_opp = torch.cat([q_pos, q_neg], -1), torch.cat([q_neg, q_pos], -1)
        k = torch.cat([k_pos, k_neg], -1)
        v1, v2 = torch.chunk(v, 2, dim=-1)
        k_mean = k.mean(dim=-2, keepdim=True).transpose(-2, -1)
        kt = k.transpose(-2, -1) * m ** -0.5
        x_sim = q_sim @ (kt @ (v1 * m ** -0.5)) * (1 / (q_sim @ k_mean + 1e-6))
        x_opp = q_opp @ (kt @ (v2 * m ** -0.5)) * (1 / (q_opp @ k_mean + 1e-6))
        out = torch.cat([x_sim, x_opp], -1).transpose(1, 2).reshape(b, n, c)
        if m != n:
            v = F.interpolate(v.transpose(-2, -1).reshape(b * self.num_heads, -1, m), size=n, mode="linear")
            v = v.reshape(b, self.num_heads, -1, n).transpose(-2, -1)
        p = self.num_prefix_tokens
        grid = v[:, :, p:].reshape(b * self.num_heads, height, width, -1).permute(0, 3, 1, 2)
        local = self.dwc(grid).reshape(b, c, height * width).permute(0, 2, 1)
        out = torch.cat([out[:, :p], out[:, p:] + local], 1) if p else out + local
        return self.proj_drop(self.proj(out * g))


class OfficialWayConvMlp(DepthwiseConvMlp):
    """PVTv2's MLP as FLatten Transformer (and timm) write it: the hidden tokens transposed and viewed."""

    def forward(self, x, height, width):
        hidden = self.fc1(x)
        b, n, c = hidden.shape
        hidden = self.dwconv(hidden.transpose(1, 2).view(b, c, height, width))
        return self.fc2(F.gelu(hidden.flatten(2).transpose(1, 2)))


def official_way(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the official code would write it: the attention above, and torch's ``nn.Linear`` and
    timm's ``Mlp`` (MKL's GEMM, GELU as a pass of its own) where ours run on oneDNN."""
    baseline = copy.deepcopy(model)
    for module in baseline.modules():
        if type(module) is PolaLinearAttention:
            module.__class__ = OfficialWayPola
        elif type(module) is DepthwiseConvMlp:
            module.__class__ = OfficialWayConvMlp
        elif type(module) is Linear:
            module.__class__ = torch.nn.Linear
        elif type(module) is Mlp:
            module.__class__ = timm.layers.Mlp
    return baseline


# --- families ---------------------------------------------------------------------------------

def build_pairs(names):
    """[(name, official, ours, what the baseline is)] for the families available here."""
    roots = {env: os.environ.get(env) for env in (POLA_ENV, PP_ENV)}
    pairs = []
    for name in names:
        if name in ("pola_deit_tiny_patch16_224", "pola_pvt_v2_b0"):
            ours = timm.create_model(name, drop_path_rate=0.0)
            pairs.append((name, official_way(ours), ours, "official formulation (in this file)"))
            continue
        env, build = {
            "pola_pvt_tiny": (POLA_ENV, official_pvt_tiny),
            "pola_swin_t": (POLA_ENV, official_swin_t),
            "POLA_b0": (PP_ENV, official_polapp_b0),
        }[name]
        if not roots[env]:
            print(f"skipping {name}: set {env} to a checkout of the official code", file=sys.stderr)
            continue
        official = build(Path(roots[env]))
        ours = timm.create_model(name, drop_path_rate=0.0)
        ours.load_state_dict(official.state_dict(), strict=True)
        pairs.append((name, official, ours, "official code"))
    return pairs


def check_same(official, ours, name) -> float:
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = official.eval()(x), ours.eval()(x)
    diff = (a - b).abs().max().item()
    if not diff <= 1e-3 * a.abs().max().item():
        raise AssertionError(f"{name}: outputs differ by {diff:g}")
    return diff


# --- timing -----------------------------------------------------------------------------------

def _passthrough(q, k, v, *args, **kwargs):
    """An attention core that costs nothing: returns ``v``."""
    return v


_READY_FEATURES: dict = {}


def _products_only(q, k, v, *args, **kwargs):
    """The matrix products of a linear-attention core and nothing else: ``φq · (φkᵀ · v)`` with 2d-wide features.

    Same shapes and FLOPs as the Pola/PaCS products (one ``φkᵀv`` product, one query product with dv
    columns), no normalisation. With gradients the features are ``[q | q]`` and ``[k | k]``, one copy each: a
    training step has to write its features for the backward. Without gradients they are ready-made buffers
    (made once per shape), so only the two products are timed: official/that bounds every implementation
    that runs its products with torch's matmul."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return torch.matmul(torch.cat([q, q], -1), torch.matmul(torch.cat([k, k], -1).transpose(-2, -1), v))
    key = (q.shape, k.shape, q.dtype)
    if key not in _READY_FEATURES:
        _READY_FEATURES[key] = (q.new_ones(*q.shape[:-1], 2 * q.shape[-1]), k.new_ones(*k.shape[:-1], 2 * k.shape[-1]))
    phi_q, phi_k = _READY_FEATURES[key]
    return torch.matmul(phi_q, torch.matmul(phi_k.transpose(-2, -1), v))


@contextlib.contextmanager
def cores_replaced(linear, softmax=None):
    """Our models with the Pola and PaCS cores replaced by ``linear`` and, if given, the softmax cores (SDPA
    and the explicit softmax op of Swin's windows and PolaFormer++'s softmax blocks) by ``softmax``."""
    import polaformer.layers.pola_attention as pola_layer
    import polaformer.layers.polapp_attention as polapp_layer
    import polaformer.layers.window_attention as window_layer

    saved = (pola_layer.pola_linear_attention, polapp_layer.pacs_linear_attention, F.scaled_dot_product_attention,
             window_layer.window_softmax_attention, polapp_layer.window_softmax_attention)
    pola_layer.pola_linear_attention = polapp_layer.pacs_linear_attention = linear
    if softmax is not None:
        F.scaled_dot_product_attention = softmax
        window_layer.window_softmax_attention = polapp_layer.window_softmax_attention = softmax
    try:
        yield
    finally:
        (pola_layer.pola_linear_attention, polapp_layer.pacs_linear_attention, F.scaled_dot_product_attention,
         window_layer.window_softmax_attention, polapp_layer.window_softmax_attention) = saved


def with_cores(step, linear, softmax=None):
    """``step`` run under :func:`cores_replaced`. Two uses:

    - every core (Pola, PaCS, SDPA) a passthrough: what is left is the time no attention implementation can
      remove, so official/that is the largest reachable ratio;
    - the linear cores reduced to their products (softmax attention kept): official/that is the largest ratio
      an implementation with a perfectly fused feature map and normalisation could reach with torch's matrix
      products on this machine.
    """
    def run():
        with cores_replaced(linear, softmax):
            step()
    return run


def make_step(model, mode, x, target):
    if mode == "infer":
        model.eval()

        def step():
            with torch.inference_mode():
                model(x)
    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), target).backward()
    return step


def measure(steps, rounds, min_time):
    """Interleaved: every round times each step once (in turn), so load from other processes hits all
    alike; a sample is ``number`` back-to-back steps, enough for ``min_time``. Returns per-step medians
    (seconds) and all samples."""
    timers, numbers = {}, {}
    for key, fn in steps.items():
        fn()  # warm-up (allocator, oneDNN primitive caches)
        timers[key] = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        numbers[key] = max(1, round(min_time / timers[key].timeit(1).mean))
    samples = {key: [] for key in steps}
    for _ in range(rounds):
        for key, timer in timers.items():
            samples[key].append(timer.timeit(numbers[key]).mean)
    return {key: statistics.median(v) for key, v in samples.items()}, samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[
        "pola_pvt_tiny", "pola_swin_t", "POLA_b0", "pola_deit_tiny_patch16_224", "pola_pvt_v2_b0"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timing sample (at least one step)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    parser.add_argument("--floor", action="store_true",
                        help="also time ours with the attention cores removed (bounds the reachable ratio)")
    parser.add_argument("--matmul-floor", action="store_true",
                        help="also time ours with the linear-attention cores reduced to their matrix products")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    pairs = build_pairs(args.models)
    if not pairs:
        print("nothing to run", file=sys.stderr)
        return 0
    rows = []
    load_start = os.getloadavg()
    for name, official, ours, baseline in pairs:
        diff = check_same(official, ours, name)
        # static shapes: one graph per batch size, as a training run with a fixed batch gets
        compiled = torch.compile(ours, dynamic=False) if args.compile else None
        for batch in args.batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 3, 224, 224, generator=gen)
            target = torch.randint(0, 1000, (batch,), generator=gen)
            for mode in args.modes:
                steps = {"official": make_step(official, mode, x, target), "ours": make_step(ours, mode, x, target)}
                if compiled is not None:
                    steps["compiled"] = make_step(compiled, mode, x, target)
                if args.floor:
                    steps["floor"] = with_cores(make_step(ours, mode, x, target), _passthrough, _passthrough)
                if args.matmul_floor:
                    steps["products"] = with_cores(make_step(ours, mode, x, target), _products_only)
                medians, samples = measure(steps, args.rounds, args.min_time)
                row = dict(model=name, baseline=baseline, batch=batch, mode=mode, max_abs_diff=diff,
                           official_ms=medians["official"] * 1e3, ours_ms=medians["ours"] * 1e3,
                           ratio=medians["official"] / medians["ours"],
                           samples_ms={k: [s * 1e3 for s in v] for k, v in samples.items()})
                extra = ""
                if compiled is not None:
                    row["compiled_ms"] = medians["compiled"] * 1e3
                    row["ratio_compiled"] = medians["official"] / medians["compiled"]
                    extra += f"  compiled {row['compiled_ms']:.1f} ms ({row['ratio_compiled']:.2f}x)"
                if args.floor:
                    row["floor_ms"] = medians["floor"] * 1e3
                    row["ratio_bound"] = medians["official"] / medians["floor"]
                    extra += f"  no-attention floor {row['floor_ms']:.1f} ms (bound {row['ratio_bound']:.2f}x)"
                if args.matmul_floor:
                    row["products_ms"] = medians["products"] * 1e3
                    row["ratio_products"] = medians["official"] / medians["products"]
                    extra += f"  products only {row['products_ms']:.1f} ms (bound {row['ratio_products']:.2f}x)"
                rows.append(row)
                print(f"{name:28s} b{batch} {mode:5s} official {row['official_ms']:8.1f} ms  "
                      f"ours {row['ours_ms']:8.1f} ms  ratio {row['ratio']:.2f}{extra}", flush=True)
    meta = dict(torch=torch.__version__, threads=args.threads, machine=platform.processor() or platform.machine(),
                loadavg_start=load_start, loadavg_end=os.getloadavg(), rounds=args.rounds, min_time=args.min_time)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows, meta))
    return 0


def markdown_table(rows, meta) -> str:
    extras = [(key, head) for key, head in (("compiled_ms", "compiled ms | official/compiled"),
                                             ("floor_ms", "no-attention floor ms | bound official/floor"),
                                             ("products_ms", "products-only ms | bound official/products"))
              if any(key in r for r in rows)]
    head = "| model | baseline | batch | mode | official ms | ours ms | official/ours |"
    for _, h in extras:
        head += f" {h} |"
    lines = [head, "|" + "---|" * (7 + 2 * len(extras))]
    for r in rows:
        line = (f"| {r['model']} | {r['baseline']} | {r['batch']} | {r['mode']} | {r['official_ms']:.1f} "
                f"| {r['ours_ms']:.1f} | {r['ratio']:.2f} |")
        for key, _ in extras:
            ratio = {"compiled_ms": "ratio_compiled", "floor_ms": "ratio_bound", "products_ms": "ratio_products"}[key]
            line += f" {r[key]:.1f} | {r[ratio]:.2f} |" if key in r else " | |"
        lines.append(line)
    lines.append("")
    lines.append(f"torch {meta['torch']}, {meta['threads']} threads, medians of {meta['rounds']} interleaved "
                 f"rounds; load average {meta['loadavg_start'][0]:.2f} at start, {meta['loadavg_end'][0]:.2f} at end.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
