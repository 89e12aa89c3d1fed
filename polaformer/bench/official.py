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

    polaformer bench official --threads 2 --json out.json --markdown out.md
    polaformer bench official --models pola_pvt_tiny --batches 8 --modes train
    polaformer bench official --compile       # adds torch.compile'd ours
    polaformer bench official --floor         # adds ours without attention cores (the bound)
    polaformer bench official --matmul-floor  # adds ours with linear attention = its products

``python benchmarks/bench_models_vs_official.py`` takes the same options.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import io
import os
import sys
import types
from pathlib import Path
from typing import Callable

import timm
import torch
import torch.nn.functional as F

import polaformer.models  # noqa: F401  (registers our architectures)
from polaformer import accelerate
from polaformer.layers import PolaLinearAttention
from polaformer.models.pvt_v2 import DepthwiseConvMlp
from polaformer.ops import official_pola_linear_attention
from polaformer.ops._common import local_and_gate

from .harness import interleaved, loadavg, machine_info, markdown_table as table, medians

PP_ENV, POLA_ENV = "POLAFORMERPP_OFFICIAL_DIR", "POLAFORMER_OFFICIAL_DIR"
DEFAULT_MODELS = ("pola_pvt_tiny", "pola_swin_t", "POLA_b0", "pola_deit_tiny_patch16_224", "pola_pvt_v2_b0")
MODES = ("infer", "train")


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


def official_polapp(root: Path, variant: str = "b0"):
    """The official ``POLA_<variant>`` (PolaFormer++), stochastic depth off."""
    mod = _load_official_file(root / "polaformer++" / "models" / "pola.py", "official_polapp")
    model = _quiet(getattr(mod, f"POLA_{variant}"))
    for m in model.modules():  # the factory hard-codes drop_path_rate=0.1; timing wants no randomness
        if type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    return model


def official_polapp_b0(root: Path):
    return official_polapp(root, "b0")


def official_dit(root: Path, name: str = "DiT-S/2", input_size: int = 32):
    """The official PolaDiT ``name`` (downstream/dit/models.py of the PolaFormer++ checkout) for latents of
    ``input_size``²; its keys are ours (``pola_dit_*``)."""
    mod = _load_official_file(root / "downstream" / "dit" / "models.py", "official_dit")
    return _quiet(lambda: mod.DiT_models[name](input_size=input_size, num_classes=1000))


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
        out = official_pola_linear_attention(q, k, v, power).transpose(1, 2).reshape(b, n, c)
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
    """The plain model as the official code would write it: the attention above, torch's ``nn.Linear`` and
    timm's ``Mlp`` (MKL's GEMM, GELU as a pass of its own)."""
    baseline = copy.deepcopy(model)
    for module in baseline.modules():
        if type(module) is PolaLinearAttention:
            module.__class__ = OfficialWayPola
        elif type(module) is DepthwiseConvMlp:
            module.__class__ = OfficialWayConvMlp
    return baseline


# --- families ---------------------------------------------------------------------------------

def build_pairs(names, log: Callable[[str], None] = print):
    """[(name, official, ours, what the baseline is)] for the families available here; ``ours`` is the plain
    model (:func:`ours_for` accelerates it as the command line does)."""
    unknown = [n for n in names if n not in DEFAULT_MODELS]
    if unknown:
        raise ValueError(f"no official counterpart for {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(DEFAULT_MODELS)}")
    roots = {env: os.environ.get(env) for env in (POLA_ENV, PP_ENV)}
    pairs = []
    for name in names:
        if name in ("pola_deit_tiny_patch16_224", "pola_pvt_v2_b0"):
            ours = timm.create_model(name, drop_path_rate=0.0)
            pairs.append((name, official_way(ours), ours, "official formulation (OfficialWayPola)"))
            continue
        env, build = {
            "pola_pvt_tiny": (POLA_ENV, official_pvt_tiny),
            "pola_swin_t": (POLA_ENV, official_swin_t),
            "POLA_b0": (PP_ENV, official_polapp_b0),
        }[name]
        if not roots[env]:
            log(f"skipping {name}: set {env} to a checkout of the official code")
            continue
        official = build(Path(roots[env]))
        ours = timm.create_model(name, drop_path_rate=0.0)
        ours.load_state_dict(official.state_dict(), strict=True)
        pairs.append((name, official, ours, "official code"))
    return pairs


def ours_for(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Our model as ``polaformer`` runs it: accelerated, and for inference with its BatchNorms folded."""
    if mode == "infer":
        return accelerate(copy.deepcopy(model).eval(), inference=True)
    return accelerate(copy.deepcopy(model))


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


def _layer_op(core):
    """A layer attention op (:func:`polaformer.ops.pola_layer_attention`, ``pacs_layer_attention``) whose core is
    ``core(q, k, v)``: the scale, power and temperatures dropped with it, the local branch and gate kept."""
    def attention(q, k, v, *args, local=None, gate=None, **kwargs):
        return local_and_gate(core(q, k, v), local, gate)
    return attention


@contextlib.contextmanager
def cores_replaced(linear, softmax=None):
    """Our models with the Pola and PaCS cores replaced by ``linear`` (called as ``linear(q, k, v)``) and, if
    given, the softmax cores (SDPA and the explicit softmax op of Swin's windows and PolaFormer++'s softmax
    blocks) by ``softmax``."""
    import polaformer.layers.pacs_attention as polapp_layer
    import polaformer.layers.pola_attention as pola_layer
    import polaformer.layers.window_attention as window_layer

    saved = (pola_layer.pola_layer_attention, polapp_layer.pacs_layer_attention, F.scaled_dot_product_attention,
             window_layer.window_softmax_attention, polapp_layer.window_softmax_attention)
    pola_layer.pola_layer_attention = polapp_layer.pacs_layer_attention = _layer_op(linear)
    if softmax is not None:
        F.scaled_dot_product_attention = softmax
        window_layer.window_softmax_attention = polapp_layer.window_softmax_attention = softmax
    try:
        yield
    finally:
        (pola_layer.pola_layer_attention, polapp_layer.pacs_layer_attention, F.scaled_dot_product_attention,
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


# (row key, log label, ratio key) of the optional steps: compiled ours, the no-attention floor, products only
EXTRAS = (("compiled_ms", "compiled", "ratio_compiled"), ("floor_ms", "no-attention floor", "ratio_bound"),
          ("products_ms", "products only", "ratio_products"))


def run_official(*, models=DEFAULT_MODELS, batches=(1, 8), modes=MODES, threads: int = 2, rounds: int = 15,
                 min_time: float = 0.05, compile: bool = False, floor: bool = False, matmul_floor: bool = False,
                 log: Callable[[str], None] = print) -> dict:
    """Time every available (model, batch, mode) against its official counterpart; ``{"meta", "rows"}``.

    Steps are timed interleaved (:func:`polaformer.bench.harness.interleaved`), a sample being as many
    back-to-back steps as fill ``min_time``. Raises ValueError for a model without a counterpart.
    """
    pairs = build_pairs(models, log)
    torch.set_num_threads(threads)
    rows = []
    load_start = loadavg()
    for name, official, plain, baseline in pairs:
        diff = check_same(official, ours_for(plain, "infer"), name)
        # static shapes: one graph per batch size, as a training run with a fixed batch gets; compile sees the
        # plain model (accelerate's kernels are eager-only)
        compiled = torch.compile(plain, dynamic=False) if compile else None
        accelerated = {mode: ours_for(plain, mode) for mode in modes}
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, 3, 224, 224, generator=gen)
            target = torch.randint(0, 1000, (batch,), generator=gen)
            for mode in modes:
                ours = accelerated[mode]
                steps = {"official": make_step(official, mode, x, target), "ours": make_step(ours, mode, x, target)}
                if compiled is not None:
                    steps["compiled"] = make_step(compiled, mode, x, target)
                if floor:
                    steps["floor"] = with_cores(make_step(ours, mode, x, target), _passthrough, _passthrough)
                if matmul_floor:
                    steps["products"] = with_cores(make_step(ours, mode, x, target), _products_only)
                samples = interleaved(steps, rounds, min_time, calls="auto", threads=threads)
                median = medians(samples)
                row = dict(model=name, baseline=baseline, batch=batch, mode=mode, max_abs_diff=diff,
                           official_ms=median["official"] * 1e3, ours_ms=median["ours"] * 1e3,
                           ratio=median["official"] / median["ours"],
                           samples_ms={k: [s * 1e3 for s in v] for k, v in samples.items()})
                extra = ""
                for key, label, ratio_key in EXTRAS:
                    step = key[:-3]
                    if step in median:
                        row[key] = median[step] * 1e3
                        row[ratio_key] = median["official"] / median[step]
                        extra += f"  {label} {row[key]:.1f} ms ({row[ratio_key]:.2f}x)"
                rows.append(row)
                log(f"{name:28s} b{batch} {mode:5s} official {row['official_ms']:8.1f} ms  "
                    f"ours {row['ours_ms']:8.1f} ms  ratio {row['ratio']:.2f}{extra}")
    meta = dict(machine_info(), rounds=rounds, min_time=min_time, loadavg_start=load_start, loadavg_end=loadavg())
    return {"meta": meta, "rows": rows}


EXTRA_HEADS = {"compiled_ms": ["compiled ms", "official/compiled"],
               "floor_ms": ["no-attention floor ms", "bound official/floor"],
               "products_ms": ["products-only ms", "bound official/products"]}


def markdown_table(rows, meta) -> str:
    extras = [(key, ratio) for key, _, ratio in EXTRAS if any(key in r for r in rows)]
    header = ["model", "baseline", "batch", "mode", "official ms", "ours ms", "official/ours"]
    header += [h for key, _ in extras for h in EXTRA_HEADS[key]]
    cells = []
    for r in rows:
        line = [r["model"], r["baseline"], r["batch"], r["mode"], f"{r['official_ms']:.1f}", f"{r['ours_ms']:.1f}",
                f"{r['ratio']:.2f}"]
        for key, ratio in extras:
            line += [f"{r[key]:.1f}", f"{r[ratio]:.2f}"] if key in r else ["", ""]
        cells.append(line)
    load = " ".join(f"{meta[k]:.2f} at {k.split('_')[1]}," for k in ("loadavg_start", "loadavg_end")
                    if meta.get(k) is not None).rstrip(",")
    return (table(header, cells) + f"\n\ntorch {meta['torch']}, {meta['threads']} threads, medians of "
            f"{meta['rounds']} interleaved rounds" + (f"; load average {load}" if load else "") + ".\n")
