"""Whole models on a GPU: a training step and inference, ours against the official code and the softmax model.

For every family (Pola-PVT-T, Pola-PVTv2-b0/b2, Pola-Swin-T, Pola-DeiT-T/S, PolaFormer++ b0/b2, PolaDiT-S/2 on
32×32 latents, ``pola_lm_small`` at 4096 tokens) each row times one step of one model:

- ``impl``: ``ours`` (our timm model), ``official`` (the authors' class, unmodified, loaded from a checkout
  as in :mod:`polaformer.bench.official`, with our weights equal to its own and outputs checked equal first;
  Pola-PVT, Pola-Swin, PolaFormer++ and PolaDiT only) or ``softmax`` (the model a user would pick instead:
  timm's ``pvt_v2_b0/b2``, ``swin_tiny_patch4_window7_224``, ``deit_tiny/small_patch16_224``, PVT-T as our
  ``attn_type="SSSS"``, DiT and the LM with ``attention="softmax"``; built with ``pretrained=False``);
- ``mode``: ``train`` (forward, loss, backward, AdamW step, under bf16 autocast) or ``infer``
  (``inference_mode``, bf16 autocast); dense rows ``fwd_bwd`` (forward and backward of the
  ``features_only`` pyramid, no optimizer);
- ``variant``: ``eager``, ``compile`` (``torch.compile(model)``) or ``reduce-overhead`` (``torch.compile(model,
  mode="reduce-overhead")``: the compiled forward and backward replayed as CUDA graphs; not a default); a compile
  failure is the row's ``error``.

Fields: ``items_per_s`` (images/s, or tokens/s for the LM: ``unit``), ``ms`` (median of ``steps`` timed steps
after warm-up, CUDA events), ``peak_mib`` (``torch.cuda.max_memory_allocated`` over the timed steps: weights,
optimizer state and activations), ``max_abs_diff`` (official rows: ours against the official outputs, fp32,
before timing), ``error`` (one line: out of memory, a failed compile, ...), and the card, driver, torch and
triton of :func:`polaformer.bench.gpu.environment`.

Rows run most valuable first, so that a run stopped by ``time_limit`` keeps them: every classification family
eager (ours, official, softmax side by side per mode), then compiled, then DiT and the LM, then (``dense``)
the backbones at 512² and 1024². ``sizes`` replaces a family's size (Pola-DeiT at 1024² = 4,096 tokens, PolaDiT on
128² latents = 4,096 tokens, the LM at 8,192). ``smoke`` runs each row once on the CPU at tiny batch and size, to
check the command (batch 1); compiled rows are GPU-only there.

    polaformer bench gpu-models --out gpu_models.csv --dense --time-limit 200
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import timm
import torch
import torch.nn.functional as F

import polaformer.models  # noqa: F401  (registers our architectures)

from . import official as off
from .gpu import _one_line, environment

IMPLS = ("ours", "official", "softmax")
MODES = ("train", "infer")
VARIANTS = ("eager", "compile", "reduce-overhead")
DEFAULT_VARIANTS = ("eager", "compile")
COMPILE_OPTIONS = {"compile": {}, "reduce-overhead": {"mode": "reduce-overhead"}}
DENSE_SIZES = (512, 1024)
SMOKE_DENSE_SIZES = (64,)


@dataclass(frozen=True)
class Family:
    name: str  # our timm name
    kind: str  # "image", "dit" or "lm"
    batch: int
    size: int  # image side, latent side (DiT) or tokens (LM)
    smoke_size: int
    softmax: tuple[str, dict] | None = None  # timm name and arguments of the softmax counterpart
    official: tuple[str, Callable] | None = None  # (env variable of the checkout, builder(root, size))
    dense: bool = False  # a pyramid backbone: features_only rows
    fixed_size: tuple[str, ...] = ()  # of ours and the softmax model: the names built for one image size


def _family_list() -> list[Family]:
    pvt1 = ("pola_pvt_tiny", {"attn_type": "SSSS"})
    return [
        Family("pola_pvt_tiny", "image", 64, 224, 224, pvt1,
               (off.POLA_ENV, lambda root, size: off.official_pvt_tiny(root)), dense=True),
        Family("pola_pvt_v2_b0", "image", 64, 224, 64, ("pvt_v2_b0", {}), dense=True),
        Family("pola_pvt_v2_b2", "image", 64, 224, 64, ("pvt_v2_b2", {}), dense=True),
        Family("pola_swin_t", "image", 64, 224, 224, ("swin_tiny_patch4_window7_224", {}),
               (off.POLA_ENV, lambda root, size: off.official_swin_t(root)), dense=True,
               fixed_size=("swin_tiny_patch4_window7_224",)),
        Family("pola_deit_tiny_patch16_224", "image", 64, 224, 64, ("deit_tiny_patch16_224", {}),
               fixed_size=("pola_deit_tiny_patch16_224", "deit_tiny_patch16_224")),
        Family("pola_deit_small_patch16_224", "image", 64, 224, 64, ("deit_small_patch16_224", {}),
               fixed_size=("pola_deit_small_patch16_224", "deit_small_patch16_224")),
        Family("POLA_b0", "image", 64, 224, 224, None, (off.PP_ENV, lambda root, size: off.official_polapp(root, "b0")),
               dense=True),
        Family("POLA_b2", "image", 64, 224, 224, None, (off.PP_ENV, lambda root, size: off.official_polapp(root, "b2")),
               dense=True),
        Family("pola_dit_s_2", "dit", 32, 32, 8, ("pola_dit_s_2", {"attention": "softmax"}),
               (off.PP_ENV, lambda root, size: off.official_dit(root, "DiT-S/2", size))),
        Family("pola_lm_small", "lm", 8, 4096, 64, ("pola_lm_small", {"attention": "softmax"})),
    ]


FAMILIES = {f.name: f for f in _family_list()}


@dataclass
class Plan:
    """What a run does; :func:`run_gpu_models` takes its fields as arguments."""
    models: tuple = tuple(FAMILIES)
    impls: tuple = IMPLS
    modes: tuple = MODES
    variants: tuple = DEFAULT_VARIANTS
    sizes: dict = None  # family name -> size in place of the family's
    dense: bool = False
    model_rows: bool = True  # False: the dense rows alone
    steps: int = 10
    warmup: int = 3
    batch_scale: float = 1.0
    smoke: bool = False
    dense_sizes: tuple = DENSE_SIZES
    dense_batch: int = 2
    compile_on_cpu: bool = False  # tests only: compiled rows are GPU rows


def check_plan(plan: Plan) -> None:
    """ValueError naming the first bad option."""
    for label, given, known in (("--models", plan.models, FAMILIES), ("--impls", plan.impls, IMPLS),
                                ("--modes", plan.modes, MODES), ("--variants", plan.variants, VARIANTS)):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            raise ValueError(f"{label}: unknown {' '.join(unknown)}; known: {' '.join(known)}" if unknown else
                             f"{label}: give at least one of {' '.join(known)}")
    for name, size in (plan.sizes or {}).items():
        if name not in FAMILIES:
            raise ValueError(f"--size: unknown model {name!r}; known: {' '.join(FAMILIES)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"--size {name}: the size must be a positive integer, got {size!r}")
    if not plan.steps >= 1:
        raise ValueError(f"--steps must be >= 1, got {plan.steps}")
    if not 0 < plan.batch_scale <= 1:
        raise ValueError(f"--batch-scale must be in (0, 1], got {plan.batch_scale}")
    if not plan.dense_batch >= 1:
        raise ValueError(f"--dense-batch must be >= 1, got {plan.dense_batch}")
    if not (plan.model_rows or plan.dense):
        raise ValueError("no rows to run: the model rows are off and --dense is not given")
    if not plan.model_rows and not any(FAMILIES[name].dense for name in plan.models):
        backbones = " ".join(name for name, family in FAMILIES.items() if family.dense)
        raise ValueError(f"--dense-only: none of --models is a backbone with dense rows ({backbones})")


# --- models ------------------------------------------------------------------------------------

def _create(name: str, kwargs: dict, family: Family, size: int, **extra) -> torch.nn.Module:
    kwargs = {**kwargs, **extra}
    if family.kind == "dit":
        kwargs["input_size"] = size
    elif family.kind == "lm":
        kwargs["context"] = size
    elif name in family.fixed_size:
        kwargs["img_size"] = size
    if family.kind == "image" and name.startswith(("pola", "POLA")):
        kwargs.setdefault("drop_path_rate", 0.0)  # timing wants no randomness (timm's models default to 0)
    return timm.create_model(name, pretrained=False, **kwargs)


def _inputs(family: Family, batch: int, size: int, device):
    """(model arguments, loss function of the output) with fixed random values."""
    gen = torch.Generator().manual_seed(0)
    if family.kind == "image":
        x = torch.randn(batch, 3, size, size, generator=gen)
        target = torch.randint(0, 1000, (batch,), generator=gen).to(device)
        return (x.to(device),), lambda out: F.cross_entropy(out.float(), target)
    if family.kind == "dit":
        x = torch.randn(batch, 4, size, size, generator=gen)
        t = torch.randint(0, 1000, (batch,), generator=gen)
        y = torch.randint(0, 1000, (batch,), generator=gen)
        return (x.to(device), t.to(device), y.to(device)), lambda out: out.float().square().mean()
    tokens = torch.randint(0, 256, (batch, size), generator=gen).to(device)
    return (tokens,), lambda out: F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten())


def _check_official(family: Family, official, ours, size: int) -> float:
    """Max |ours - official| on the CPU in fp32 (AssertionError past 1e-3 of the output's range)."""
    if family.kind == "image":
        return off.check_same(official, ours, family.name)
    args, _ = _inputs(family, 2, size, "cpu")
    with torch.no_grad():
        a, b = official.eval()(*args), ours.eval()(*args)
    diff = (a - b).abs().max().item()
    if not diff <= 1e-3 * a.abs().max().item():
        raise AssertionError(f"{family.name}: outputs differ by {diff:g}")
    return diff


def _describe_model(name: str, kwargs: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in kwargs.items())


def _build(family: Family, impls, size: int, log) -> list[tuple[str, torch.nn.Module | None, str, dict]]:
    """[(impl, model on the CPU or None, what it is, extra row fields)] for the impls that apply; a model is None
    where building or checking it failed (the reason in the fields' ``error``). With ``official``, ours holds the
    official model's weights and both outputs are checked equal."""
    ours = _create(family.name, {}, family, size)
    built = {"ours": (ours, family.name, {})}
    if "official" in impls and family.official is not None:
        env, build = family.official
        root = os.environ.get(env)
        if not root:
            log(f"{family.name}: no official rows (set {env} to a checkout: scripts/prepare_official.sh)")
        else:
            try:
                official = build(Path(root), size)
                ours.load_state_dict(official.state_dict(), strict=True)  # ours loads the official layout by design
                diff = _check_official(family, official, ours, size)
                built["official"] = (official, f"official code ({env})", {"max_abs_diff": diff})
            except Exception as e:  # a file that does not load or outputs that differ: a row, not the end
                built["official"] = (None, f"official code ({env})", {"error": _one_line(e)})
    if "softmax" in impls and family.softmax is not None:
        name, kwargs = family.softmax
        built["softmax"] = (_create(name, kwargs, family, size), _describe_model(name, kwargs), {})
    return [(impl, *built[impl]) for impl in impls if impl in built]


# --- one row ------------------------------------------------------------------------------------

def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _step(model, mode, args, loss_fn, device):
    if mode == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), _autocast(device):
                model(*args)
        return step, None
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = loss_fn(model(*args))
        loss.backward()
        optimizer.step()
    return step, optimizer


def _dense_step(model, args, device):
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = sum(f.float().mean() for f in model(*args))
        loss.backward()
    return step


def _time(step, steps: int, warmup: int, device) -> tuple[float, float | None]:
    """(median ms per step, peak MiB over the timed steps or None on the CPU)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), torch.cuda.max_memory_allocated() / 2 ** 20


def _release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(model, *, family, mode, variant, batch, size, device, plan, dense=False) -> dict:
    """The timing fields of one row; any failure (out of memory, a failed compile) is its ``error``."""
    fields = {"items_per_s": None, "ms": None, "peak_mib": None, "error": None}
    if variant != "eager" and device.type != "cuda" and not plan.compile_on_cpu:
        fields["error"] = "CUDA only"
        return fields
    optimizer = step = None
    try:
        if dense:
            args = (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device),)
        else:
            args, loss_fn = _inputs(family, batch, size, device)
        runnable = torch.compile(model, **COMPILE_OPTIONS[variant]) if variant != "eager" else model
        step = _dense_step(runnable, args, device) if dense else None
        if step is None:
            step, optimizer = _step(runnable, mode, args, loss_fn, device)
        ms, peak = _time(step, plan.steps, plan.warmup, device)
        items = batch * (size if family.kind == "lm" and not dense else 1)
        fields.update(ms=ms, peak_mib=peak, items_per_s=items / ms * 1e3)
    except Exception as e:  # a result here, not a reason to stop the run
        fields["error"] = _one_line(e)
    finally:
        del optimizer, step
        model.zero_grad(set_to_none=True)
        if variant != "eager":
            torch._dynamo.reset()
        _release(device)
    return fields


def _describe(row: dict) -> str:
    what = (f"{row['model']} {row['impl']} {row['mode']} {row['variant']} b{row['batch']} "
            f"{row['resolution'] or row['tokens']}")
    if row["error"]:
        return f"{what}: {row['error']}"
    peak = f", {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
    return f"{what}: {row['ms']:.2f} ms, {row['items_per_s']:.1f} {row['unit']}{peak}"


# --- the run ------------------------------------------------------------------------------------

def _tasks(plan: Plan):
    """(phase, family, variant) in the order rows run: classification eager, compiled, DiT/LM, dense."""
    chosen = [FAMILIES[name] for name in plan.models]
    images = [f for f in chosen if f.kind == "image"]
    others = [f for f in chosen if f.kind != "image"]
    if plan.model_rows:
        for variant in plan.variants:
            for family in images:
                yield "model", family, variant
        for family in others:
            for variant in plan.variants:
                yield "model", family, variant
    if plan.dense:
        for variant in plan.variants:
            for family in (f for f in chosen if f.dense):
                yield "dense", family, variant


def run_gpu_models(*, models=tuple(FAMILIES), impls=IMPLS, modes=MODES, variants=DEFAULT_VARIANTS,
                   sizes: dict | None = None, dense: bool = False, model_rows: bool = True, dense_batch: int = 2,
                   steps: int = 10, warmup: int = 3,
                   batch_scale: float = 1.0, smoke: bool = False, time_limit: float | None = None, log=print,
                   on_row=None) -> list[dict]:
    """One row per (family, impl, mode, variant) (unless ``model_rows`` is False) and, with ``dense``, per
    (backbone, impl, size, variant) at ``dense_batch`` images; see the module docstring. ``on_row(rows)`` is called
    after every row (a run stopped early keeps what it measured); past ``time_limit`` seconds no further row
    starts."""
    plan = Plan(models=tuple(models), impls=tuple(impls), modes=tuple(modes), variants=tuple(variants),
                sizes=dict(sizes or {}), dense=dense,
                model_rows=model_rows, steps=1 if smoke else steps, warmup=0 if smoke else warmup,
                batch_scale=batch_scale, smoke=smoke, dense_sizes=SMOKE_DENSE_SIZES if smoke else DENSE_SIZES,
                dense_batch=dense_batch)
    check_plan(plan)
    if smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("bench gpu-models needs a CUDA device (or --smoke, which runs on the CPU)")
        device = torch.device("cuda")
    env = environment(device)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    rows: list[dict] = []
    limits = contextlib.nullcontext()
    if any(variant != "eager" for variant in plan.variants) and device.type == "cuda":
        from torch import _dynamo

        limits = _dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536)

    def emit(row):
        row.update(env)
        rows.append(row)
        log(_describe(row))
        if on_row is not None:
            on_row(rows)

    with limits:
        for phase, family, variant in _tasks(plan):
            if deadline is not None and time.monotonic() > deadline:
                log(f"time limit of {time_limit:g} s reached: {len(rows)} rows")
                break
            if phase == "model":
                _run_family(family, variant, plan, device, emit, log, deadline)
            else:
                _run_dense(family, variant, plan, device, emit, log, deadline)
    if on_row is not None:
        on_row(rows)
    return rows


def _scaled(batch: int, plan: Plan) -> int:
    return 1 if plan.smoke else max(1, round(batch * plan.batch_scale))


def _late(deadline) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _run_family(family, variant, plan, device, emit, log, deadline) -> None:
    size = family.smoke_size if plan.smoke else (plan.sizes or {}).get(family.name, family.size)
    batch = _scaled(family.batch, plan)
    built = _build(family, plan.impls, size, log)
    try:
        for mode in plan.modes:
            for impl, model, what, extra in built:
                if _late(deadline):
                    return
                base = {"model": family.name, "impl": impl, "counterpart": what, "mode": mode, "variant": variant,
                        "batch": batch, "resolution": None if family.kind == "lm" else size,
                        "tokens": size if family.kind == "lm" else (size // 2) ** 2 if family.kind == "dit" else None,
                        "unit": "tokens/s" if family.kind == "lm" else "images/s"}
                if model is None:
                    fields = {"items_per_s": None, "ms": None, "peak_mib": None, "error": extra["error"]}
                else:  # only the measured model on the card: its peak is its own
                    fields = _measure(model.to(device), family=family, mode=mode, variant=variant, batch=batch,
                                      size=size, device=device, plan=plan)
                    model.to("cpu")
                emit({**base, **fields, "max_abs_diff": extra.get("max_abs_diff")})
    finally:
        del built
        _release(device)


def _run_dense(family, variant, plan, device, emit, log, deadline) -> None:
    batch = _scaled(plan.dense_batch, plan)
    for size in plan.dense_sizes:
        for impl in (i for i in plan.impls if i != "official"):
            if _late(deadline):
                return
            if impl == "softmax" and family.softmax is None:
                continue
            name, kwargs = (family.name, {}) if impl == "ours" else family.softmax
            what = _describe_model(name, kwargs)
            base = {"model": family.name, "impl": impl, "counterpart": what, "mode": "fwd_bwd", "variant": variant,
                    "batch": batch, "resolution": size, "tokens": None, "unit": "images/s"}
            model = None
            try:
                model = _create(name, kwargs, family, size, features_only=True).to(device)
                fields = _measure(model, family=family, mode="fwd_bwd", variant=variant, batch=batch, size=size,
                                  device=device, plan=plan, dense=True)
            except Exception as e:
                fields = {"items_per_s": None, "ms": None, "peak_mib": None, "error": _one_line(e)}
            del model
            _release(device)
            emit({**base, **fields, "max_abs_diff": None})
