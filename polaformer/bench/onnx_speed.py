"""Our models in ONNX Runtime against their softmax counterparts, and against eager PyTorch, on the CPU.

For each family (ours and the softmax model a user would deploy instead) and batch size, side by side in one
process:

- ``eager``: the model as built (``timm.create_model``, seed 0), ``torch.inference_mode()``;
- ``eager_accelerated``: the same with :func:`polaformer.accelerate` (``inference=True``), our fastest eager path
  on the CPU; the ratios against "our eager" take the faster of the two;
- ``onnxruntime``: the file :func:`polaformer.export.export_onnx` writes (the dynamo exporter, dynamic batch,
  verified against eager to 1e-4), in an ``onnxruntime.InferenceSession`` with default options but the
  intra-op thread count, CPU provider;
- ``eager_int8`` / ``onnxruntime_int8`` (ours, with ``int8``): :func:`polaformer.export.quantize_int8` followed by
  :func:`polaformer.accelerate` (``inference=True``), and the ``export_onnx(..., int8=True)`` file (the linear
  layers of at least :data:`polaformer.export.INT8_MIN_FEATURES` inputs and outputs quantized dynamically to int8).

Every variant of a (family, batch) row is timed in interleaved rounds (each round times each variant once,
back-to-back calls filling ``min_time``; medians over rounds), so load from other processes hits them alike.
With ``accuracy``, a checkpoint of ``polaformer train`` is also scored on its test split in all four forms.

    polaformer bench onnx --markdown table.md --csv benchmarks/results/onnx_speed_zen.csv
    polaformer bench onnx --families pola_pvt_v2_b0 --batches 1 --rounds 2
"""
from __future__ import annotations

import copy
import logging
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import timm
import torch
from torch import nn

import polaformer.models  # noqa: F401  (registers the models)
from polaformer.acceleration import accelerate
from polaformer.export import DEFAULT_ATOL, export_onnx, quantize_int8
from polaformer.limits import check_batch_memory
from polaformer.runtime import tune_cpu_allocator

from .harness import interleaved, loadavg, machine_info, markdown_table, medians

__all__ = ["FAMILIES", "Family", "accuracy_rows", "accuracy_table", "reference_rows", "reference_table",
           "run_onnx_speed", "speed_table"]


@dataclass(frozen=True)
class Family:
    ours: str
    softmax: str  # the timm model a user would pick instead (or ours with softmax attention where timm has none)
    softmax_kwargs: tuple = ()
    softmax_sized: bool = True  # False: the softmax model has no size argument (it takes any input size)

    def build(self, softmax: bool, img_size: int | None = None) -> nn.Module:
        """The model for ``img_size``² inputs (None: its own size)."""
        torch.manual_seed(0)
        name, kwargs = (self.softmax, dict(self.softmax_kwargs)) if softmax else (self.ours, {})
        if img_size is not None and (self.softmax_sized or not softmax):
            kwargs["img_size"] = img_size
        return timm.create_model(name, **kwargs).eval()

    def softmax_label(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.softmax_kwargs)
        return f"{self.softmax}({kwargs})" if kwargs else self.softmax


FAMILIES = {f.ours: f for f in (
    Family("pola_deit_tiny_patch16_224", "deit_tiny_patch16_224"),
    # timm has no PVT v1: the same model with spatial-reduction softmax attention in every stage
    Family("pola_pvt_tiny", "pola_pvt_tiny", (("attn_type", "SSSS"),)),
    Family("pola_pvt_v2_b0", "pvt_v2_b0", softmax_sized=False),
    Family("pola_swin_t", "swin_tiny_patch4_window7_224"),
    # PolaFormer++ without a timm counterpart: RoPE softmax blocks in every stage
    Family("POLA_b0", "POLA_b0", (("block_types", ("v", "v", "v", "v")),)),
)}
# "eager" is the model as built; "eager_accelerated" the same with polaformer.accelerate(inference=True), our
# fastest eager path on the CPU
VARIANTS = ("eager", "eager_accelerated", "onnxruntime", "softmax_eager", "softmax_onnxruntime", "eager_int8",
            "onnxruntime_int8")


class _Session(nn.Module):
    """An onnxruntime session called like the model it was exported from (float32 CPU batches)."""

    def __init__(self, path: Path, threads: int):
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input: x.float().numpy()})[0])


def _input_size(model: nn.Module, img_size: int | None) -> tuple[int, int, int]:
    channels, height, width = model.pretrained_cfg["input_size"]
    return (channels, height, width) if img_size is None else (channels, img_size, img_size)


def _export(model: nn.Module, path: Path, img_size: int | None, int8: bool = False) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(model, path, input_size=_input_size(model, img_size), int8=int8)


def _eager_int8(model: nn.Module) -> nn.Module:
    """Our fastest int8 eager path: int8 linear layers, the rest fused as :func:`accelerate` does for float32."""
    return accelerate(quantize_int8(model), inference=True)


def _forms(family: Family, folder: Path, threads: int, int8: bool, img_size: int | None) -> dict[str, nn.Module]:
    """Every variant of a family, each a callable model."""
    ours, softmax = family.build(False, img_size), family.build(True, img_size)
    files = {"onnxruntime": (ours, False), "softmax_onnxruntime": (softmax, False)}
    if int8:
        files["onnxruntime_int8"] = (ours, True)
    for name, (model, quantized) in files.items():
        _export(model, folder / f"{name}.onnx", img_size, quantized)
    forms = {"eager": ours, "eager_accelerated": accelerate(copy.deepcopy(ours), inference=True),
             "onnxruntime": _Session(folder / "onnxruntime.onnx", threads),
             "softmax_eager": softmax, "softmax_onnxruntime": _Session(folder / "softmax_onnxruntime.onnx", threads)}
    if int8:
        forms["eager_int8"] = _eager_int8(ours)
        forms["onnxruntime_int8"] = _Session(folder / "onnxruntime_int8.onnx", threads)
    return forms


def run_onnx_speed(*, families=tuple(FAMILIES), batches=(1, 8), threads: int = 2, rounds: int = 5,
                   min_time: float = 0.5, int8: bool = True, img_size: int | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """Time every variant of every family (keys of :data:`FAMILIES`) at each batch (float32 inputs of the models'
    own size, 224², or ``img_size``², the models built for it).

    Returns ``{"meta": ..., "rows": [...]}``, a row per (family, batch) with milliseconds per batch,
    images/s and the ratios the targets name. Raises ValueError for an unknown family or a batch that cannot fit
    in memory.
    """
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {', '.join(map(repr, unknown))}; known: {', '.join(FAMILIES)}")
    if img_size is not None:  # before building models whose tables grow with the size: every family takes RGB
        check_batch_memory(max(batches), 3, img_size, img_size, "cpu")
    import onnxruntime

    torch.set_num_threads(threads)
    meta = {**machine_info(allocator_reuse=tune_cpu_allocator()), "onnxruntime": onnxruntime.__version__,
            "timm": timm.__version__, "rounds": rounds, "min_time": min_time, "load1_at_start": loadavg()}
    rows = []
    previous = logging.root.manager.disable
    for name in families:
        family = FAMILIES[name]
        with tempfile.TemporaryDirectory(prefix="bench_onnx_") as folder:
            logging.disable(logging.WARNING)  # the exporter's and quantizer's progress messages
            try:
                forms = _forms(family, Path(folder), threads, int8, img_size)
                input_size = _input_size(forms["eager"], img_size)
            finally:
                logging.disable(previous)
            for batch in batches:
                x = torch.randn(batch, *input_size, generator=torch.Generator().manual_seed(batch))
                with torch.inference_mode():
                    ref = forms["eager"](x)
                    steps = {key: (lambda form=form: form(x)) for key, form in forms.items()}
                    loads = [loadavg()]
                    seconds = medians(interleaved(steps, rounds, min_time, calls="auto", threads=threads))
                    loads.append(loadavg())
                    diffs = {key: float((form(x) - ref).abs().max()) for key, form in forms.items()
                             if not key.startswith("softmax")}
                best_eager = min(seconds["eager"], seconds["eager_accelerated"])
                row = {"family": name, "softmax": family.softmax_label(), "batch": batch, "threads": threads,
                       "height": input_size[1], "width": input_size[2],
                       **{f"{key}_ms": s * 1e3 for key, s in seconds.items()},
                       **{f"{key}_images_per_s": batch / s for key, s in seconds.items()},
                       "onnxruntime_vs_softmax_onnxruntime": seconds["softmax_onnxruntime"] / seconds["onnxruntime"],
                       "onnxruntime_vs_eager": seconds["eager"] / seconds["onnxruntime"],
                       "onnxruntime_vs_best_eager": best_eager / seconds["onnxruntime"],
                       "softmax_onnxruntime_vs_softmax_eager":
                           seconds["softmax_eager"] / seconds["softmax_onnxruntime"],
                       **{f"{key}_max_abs_diff": d for key, d in diffs.items() if key != "eager"},
                       "ref_max_abs": float(ref.abs().max()), "load1_start": loads[0], "load1_end": loads[1]}
                if int8:
                    best_int8 = min(seconds["eager_int8"], seconds["onnxruntime_int8"])
                    row["int8_vs_eager"] = seconds["eager"] / best_int8
                    row["int8_vs_best_eager"] = best_eager / best_int8
                rows.append(row)
                log(f"{name} batch {batch}: " + ", ".join(f"{k} {batch / s:.1f} img/s" for k, s in seconds.items()))
    meta["load1_at_end"] = loadavg()
    return {"meta": meta, "rows": rows}


def speed_table(result: dict) -> str:
    """The Markdown table of :func:`run_onnx_speed` (images/s and the targets' ratios)."""
    meta, rows = result["meta"], result["rows"]
    int8 = any("eager_int8_ms" in r for r in rows)
    header = ["ours", "softmax model", "batch", "ours eager", "ours eager, accelerate", "ours ORT", "softmax eager",
              "softmax ORT", "ours ORT / softmax ORT", "ours ORT / ours best eager"]
    if int8:
        header += ["ours int8 eager", "ours int8 ORT", "best int8 / ours eager fp32",
                   "best int8 / ours best eager fp32"]
    lines = []
    for r in rows:
        cells = [f"`{r['family']}`", f"`{r['softmax']}`", r["batch"],
                 *(f"{r[f'{v}_images_per_s']:.1f}" for v in VARIANTS[:5]),
                 f"{r['onnxruntime_vs_softmax_onnxruntime']:.2f}x", f"{r['onnxruntime_vs_best_eager']:.2f}x"]
        if int8:
            cells += [f"{r['eager_int8_images_per_s']:.1f}", f"{r['onnxruntime_int8_images_per_s']:.1f}",
                      f"{r['int8_vs_eager']:.2f}x", f"{r['int8_vs_best_eager']:.2f}x"]
        lines.append(cells)
    loads = [r[k] for r in rows for k in ("load1_start", "load1_end") if r[k] is not None]
    sizes = ", ".join(sorted({f"{r.get('height', 224)}x{r.get('width', 224)}" for r in rows})) or "224x224"
    caption = (f"CPU {meta['cpu_model']} ({meta['cpu_capability']}), {rows[0]['threads'] if rows else '-'} thread(s), "
               f"{meta['cpu_count']} cores; torch {meta['torch']}, onnxruntime {meta['onnxruntime']}, timm "
               f"{meta['timm']}; {sizes} float32 inputs, images/s (median of {meta['rounds']} interleaved rounds); "
               f"load average (1 min) {min(loads, default=0):.1f}-{max(loads, default=0):.1f} during the rows.")
    return caption + "\n\n" + markdown_table(header, lines) + "\n"


def accuracy_rows(checkpoint: str, *, threads: int = 2, log: Callable[[str], None] = print) -> list[dict]:
    """A ``polaformer train`` checkpoint scored on its test split as eager float32, eager int8, and the exported
    float32 and int8 files in onnxruntime: top-1 and the largest logit change from eager float32."""
    from polaformer.data import get_data_spec
    from polaformer.engine.checkpoint import read_run_checkpoint
    from polaformer.engine.factory import create_model_from_checkpoint
    from polaformer.tasks.classification.train import evaluate, make_test_loader, trained_on

    torch.set_num_threads(threads)
    stored = read_run_checkpoint(checkpoint)
    model = create_model_from_checkpoint(stored, checkpoint).eval()
    _, test_set = get_data_spec(trained_on(stored.get("config"))).build(augment=False)
    loader = make_test_loader(test_set)
    images = torch.cat([batch[0] for batch in loader])
    input_size = tuple(images.shape[1:])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_onnx_accuracy_") as folder:
        forms = {"eager": model, "eager_int8": _eager_int8(model)}
        for name, int8 in (("onnxruntime", False), ("onnxruntime_int8", True)):
            path = Path(folder) / f"{name}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export_onnx(model, path, input_size=input_size, int8=int8)
            forms[name] = _Session(path, threads)
        with torch.inference_mode():
            ref = model(images)
            for name, form in forms.items():
                metrics = evaluate(form, loader, torch.device("cpu"))
                change = float((form(images) - ref).abs().max())
                rows.append({"form": name, "arch": stored["arch"], "images": metrics["images"],
                             "top1": metrics["top1"], "max_logit_change": change,
                             "ref_max_abs": float(ref.abs().max())})
                log(f"{name}: top-1 {metrics['top1']:.2f}% on {metrics['images']} images, logits changed by "
                    f"at most {change:.2e}")
    return rows


def accuracy_table(rows: list[dict]) -> str:
    base = rows[0]["top1"]
    return markdown_table(
        ["form", "test top-1", "change", "max logit change (largest logit)"],
        [[r["form"], f"{r['top1']:.2f}%", f"{r['top1'] - base:+.2f}",
          f"{r['max_logit_change']:.2e} ({r['ref_max_abs']:.1f})"] for r in rows],
    ) + "\n"


def reference_rows(folder: str, *, threads: int = 2, log: Callable[[str], None] = print) -> list[dict]:
    """The whole-model reference vectors in ``folder`` (the official code's outputs, ``<case>.json`` +
    ``.safetensors``): our float32 model, its int8 copy and the exported int8 file against the stored output,
    the largest difference relative to the output's largest magnitude."""
    import json

    from safetensors.torch import load_file

    from polaformer.compat import from_official

    torch.set_num_threads(threads)
    rows = []
    for record_path in sorted(Path(folder).glob("*.json")):
        record = json.loads(record_path.read_text())
        if record.get("forward_args"):  # attention layers (their inputs are tokens and a grid): whole models only
            continue
        tensors = load_file(record_path.with_suffix(".safetensors"))
        model = from_official(record).eval()
        model.load_state_dict({k[len("state_dict."):]: v for k, v in tensors.items() if k.startswith("state_dict.")})
        x, expected, scale = tensors["input"].float(), tensors["output"], record["output_abs_max"]
        row = {"case": record["case"], "output_abs_max": scale}
        with tempfile.TemporaryDirectory(prefix="bench_onnx_reference_") as tmp:
            path = Path(tmp) / "int8.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # outputs up to several hundred: float32 rounding alone moves them by more than the default 1e-4
                export_onnx(model, path, input_size=tuple(x.shape[1:]), batch_size=x.shape[0], int8=True,
                            atol=DEFAULT_ATOL * max(1.0, scale))
            forms = {"float32": model, "eager_int8": _eager_int8(model), "onnxruntime_int8": _Session(path, threads)}
            with torch.inference_mode():
                for name, form in forms.items():
                    row[name] = float((form(x).double() - expected).abs().max()) / scale
        rows.append(row)
        log(f"{record['case']}: " + ", ".join(f"{k} {row[k]:.2e}" for k in forms))
    return rows


def reference_table(rows: list[dict]) -> str:
    return markdown_table(
        ["reference case", "float32", "eager int8", "onnxruntime int8"],
        [[f"`{r['case']}`", *(f"{r[k]:.1e}" for k in ("float32", "eager_int8", "onnxruntime_int8"))] for r in rows],
    ) + "\n"
