"""ONNX export with PyTorch's dynamo exporter, verified against eager PyTorch in onnxruntime.

:func:`export_onnx` writes a model's ONNX file only after onnxruntime, reading the written bytes,
reproduces the eager model on random inputs: at two batch sizes when the batch axis is dynamic,
and at a second input size when the height/width are too. A file whose output differs by more
than the tolerance is deleted (a file already at the destination is left as it was), so no
unverified file is ever left under the requested name. :func:`export_model` builds a registered
model (optionally loading a checkpoint) and exports it; ``polaformer export`` calls it.

What can be symbolic in the exported graph:

- the batch: always, for every family (the graph is traced at batch >= 2, since torch.export
  treats a traced size of 1 as a constant);
- height/width: only where the model's code does not branch on the input size. PolaFormer++
  (``POLA_b*``: RoPE tables computed in the graph, no stored position table) qualifies. DeiT,
  PVT, PVTv2 and Swin do not: the position tables are resampled to the token grid only when the
  grid differs from the trained one, and Swin chooses windows, shifts, padding and masks from the
  grid, so a trace is valid at its own size only. torch.export records that as a guard (e.g.
  ``x.size()[2] // 4 == 56``) which the ONNX file cannot enforce, so such a file would accept
  other sizes and compute nonsense or fail inside onnxruntime. Here those models are refused with
  ``dynamic_size=True``; export one file per input size instead (any size the model accepts).

With ``int8=True`` the verified graph is written with its linear layers (``MatMul``/``Gemm`` with a
constant weight, at least :data:`INT8_MIN_FEATURES` inputs and outputs) quantized dynamically to int8 by
onnxruntime's quantizer (int8 weights, activations quantized per call); :func:`quantize_int8` does the same for
the eager model with ``torch.ao``.
Convolutions and the attention's own products stay float32. An int8 file is compared with the float32
eager model and the difference reported, not held to the float32 tolerance. With ``speed=True`` the
written file is timed in onnxruntime beside the eager model (:class:`SpeedCheck`).

Only the dynamo exporter is used. The TorchScript-based one (``torch.onnx.export(...,
dynamo=False)``) is exact too for every family at the traced input size, but it never checks
that a traced branch holds at other sizes.

Needs the optional ``export`` dependencies: ``pip install 'polaformer[export]'`` (onnx,
onnxruntime, onnxscript).
"""
from __future__ import annotations

import copy
import logging
import math
import os
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import atomic_write
from .limits import check_batch_memory

__all__ = [
    "DEFAULT_ATOL",
    "INT8_MIN_FEATURES",
    "ExportError",
    "ExportResult",
    "ExportVerificationError",
    "OnnxCheck",
    "SpeedCheck",
    "export_model",
    "export_onnx",
    "measure_speed",
    "quantize_int8",
    "verify_onnx",
]

DEFAULT_ATOL = 1e-4  # max |onnxruntime - eager| over the outputs, float32
# int8 pays where the product is wide: quantizing the activations costs a pass over them per call, which a layer
# with few inputs or outputs (PVTv2-b0's 32-channel first stage, a 10-class head) does not win back
INT8_MIN_FEATURES = 64
INPUT_NAME = "images"
OUTPUT_NAME = "output"
_MAX_PROTO_BYTES = 2**31 - 1  # protobuf's limit for a single-file ONNX model


class ExportError(ValueError):
    """The model cannot be exported as asked; the message is a single line."""


class ExportVerificationError(ExportError):
    """The exported file does not reproduce the eager model within the tolerance; it was not kept."""


@dataclass
class OnnxCheck:
    """One onnxruntime run against eager PyTorch."""

    batch: int
    height: int
    width: int
    max_abs_diff: float

    def describe(self) -> str:
        return f"{self.max_abs_diff:.2e} at batch {self.batch} ({self.height}x{self.width})"


@dataclass
class SpeedCheck:
    """Seconds per call of the written file in onnxruntime and of the eager model, on one batch, interleaved."""

    batch: int
    threads: int
    onnxruntime_s: float
    eager_s: float
    eager: str = "float32"

    def describe(self) -> str:
        return (f"onnxruntime {self.onnxruntime_s * 1e3:.1f} ms vs eager PyTorch ({self.eager}) "
                f"{self.eager_s * 1e3:.1f} ms per batch of {self.batch} on {self.threads} thread(s) "
                f"({self.eager_s / self.onnxruntime_s:.2f}x)")


@dataclass
class ExportResult:
    path: Path
    opset: int
    input_shape: list  # e.g. ['batch', 3, 224, 224]; names are symbolic axes
    checks: list[OnnxCheck]
    atol: float
    export_s: float
    verify_s: float
    size_bytes: int
    weights: str = "random initialisation"
    int8_checks: list[OnnxCheck] | None = None  # the int8 file against the float32 eager model
    speed: SpeedCheck | None = None

    @property
    def max_abs_diff(self) -> float:
        return max(check.max_abs_diff for check in self.checks)

    def summary(self, model: str) -> str:
        shape = "x".join(str(d) for d in self.input_shape)
        checks = ", ".join(check.describe() for check in self.checks)
        text = (
            f"exported {model} ({self.weights}) -> {self.path}: ONNX opset {self.opset}, input {INPUT_NAME} "
            f"{shape}, {self.size_bytes / 1e6:.1f} MB; onnxruntime vs eager max abs diff {checks} "
            f"(tolerance {self.atol:.0e})"
        )
        if self.int8_checks is not None:
            text += ("; linear layers quantized to int8, whose output differs from eager float32 by "
                     + ", ".join(check.describe() for check in self.int8_checks))
        text += f"; export {self.export_s:.1f} s, verification {self.verify_s:.1f} s"
        if self.speed is not None:
            text += f"; speed: {self.speed.describe()}"
        return text


def _require_onnx():
    missing = []
    for module in ("onnx", "onnxscript", "onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ExportError(
            f"ONNX export needs {', '.join(missing)}: pip install 'polaformer[export]' "
            "(or: pip install onnx onnxruntime onnxscript)"
        )


def _one_line(error: BaseException) -> str:
    """The first meaningful line of an exception (and of its cause), without terminal colours."""
    def first(e):
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
        return next((line for line in lines if line), type(e).__name__)

    text = f"{type(error).__name__}: {first(error)}"
    cause = error.__cause__
    if cause is not None:
        text += f" (caused by {type(cause).__name__}: {first(cause)})"
    return text


def _size_step(model: nn.Module) -> int:
    """The total stride: input sizes the model takes are multiples of it (the largest feature reduction)."""
    info = getattr(model, "feature_info", None)
    reductions = [int(i["reduction"]) for i in info if "reduction" in i] if isinstance(info, list) else []
    return max(reductions, default=32)


def _random_inputs(shapes, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def verify_onnx(path: str | os.PathLike, model: nn.Module, inputs: list[torch.Tensor]) -> list[OnnxCheck]:
    """Run the ONNX file in onnxruntime (CPU) on each input and compare with ``model`` in eval mode."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    checks = []
    for x in inputs:
        with torch.no_grad():
            expected = model(x).float().numpy()
        got = session.run(None, {name: x.numpy()})[0]
        if got.shape != expected.shape:
            diff = math.inf
        else:
            diff = float(np.max(np.abs(got.astype(np.float64) - expected))) if expected.size else 0.0
            if math.isnan(diff):
                diff = math.inf
        checks.append(OnnxCheck(x.shape[0], x.shape[2], x.shape[3], diff))
    return checks


def _check_min_features(min_features, error: type[Exception] = ValueError) -> None:
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1:
        raise error(f"the narrowest linear layer to quantize must be a positive integer, got {min_features!r}")


def _int8_worthy(in_features: int, out_features: int, min_features: int) -> bool:
    return min(in_features, out_features) >= min_features


def quantize_int8(model: nn.Module, *, min_features: int = INT8_MIN_FEATURES) -> nn.Module:
    """A copy of ``model`` in eval mode with its ``nn.Linear`` layers of at least ``min_features`` inputs and
    outputs quantized dynamically to int8 (``torch.ao.quantization.quantize_dynamic``: int8 weights, activations
    quantized per call; CPU only). Narrower layers stay float32 (see :data:`INT8_MIN_FEATURES`).

    Convolutions, norms and the attention's own products stay float32. The copy runs inference only;
    ``polaformer.accelerate(copy, inference=True)`` fuses the rest of it as for a float32 model.
    """
    _check_min_features(min_features)
    quantized = copy.deepcopy(model).eval()
    names = set()
    for name, m in quantized.named_modules():
        if not isinstance(m, nn.Linear) or isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear):
            continue
        if type(m) is not nn.Linear:  # torch's quantizer would leave it float32 without a word
            raise ValueError(f"quantize_int8 takes plain nn.Linear layers, and {name} is a {type(m).__name__}: "
                             "quantize before polaformer.accelerate")
        if _int8_worthy(m.in_features, m.out_features, min_features):
            names.add(name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(deprecated|torch\.ao\.quantization).*")
        return torch.ao.quantization.quantize_dynamic(quantized, names, dtype=torch.qint8)


def _narrow_products(path: Path, min_features: int) -> list[str]:
    """The ``MatMul``/``Gemm`` nodes whose constant 2-D weight has fewer than ``min_features`` rows or columns."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {w.name: tuple(w.dims) for w in graph.initializer}
    return [node.name for node in graph.node
            if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and len(weights.get(node.input[1], ())) == 2
            and not _int8_worthy(*weights[node.input[1]], min_features)]


def _quantize_onnx(source: Path, target: Path, min_features: int = INT8_MIN_FEATURES) -> None:
    """onnxruntime's dynamic quantizer on the linear layers only: ``MatMul``/``Gemm`` with a constant weight of at
    least ``min_features`` rows and columns."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # it logs an advice to pre-process the model through the root logger
    try:
        quantize_dynamic(source, target, op_types_to_quantize=["MatMul", "Gemm"], weight_type=QuantType.QInt8,
                         nodes_to_exclude=_narrow_products(source, min_features),
                         extra_options={"MatMulConstBOnly": True})
    finally:
        logging.disable(previous)


def measure_speed(path: str | os.PathLike, model: nn.Module, x: torch.Tensor, *, threads: int | None = None,
                  rounds: int = 5, eager: str = "float32") -> SpeedCheck:
    """Seconds per call of the ONNX file at ``path`` in onnxruntime (CPU, default session options but
    ``threads`` intra-op threads, default torch's) and of ``model`` on the batch ``x``: one warm-up call each,
    then ``rounds`` calls taken in turn, medians."""
    import onnxruntime as ort

    threads = threads or torch.get_num_threads()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = {"onnxruntime": [], "eager": []}
    calls = {"onnxruntime": lambda: session.run(None, feed), "eager": lambda: model(x)}
    try:
        with torch.inference_mode():
            for call in calls.values():
                call()
            for _ in range(rounds):
                for key, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return SpeedCheck(x.shape[0], threads, statistics.median(times["onnxruntime"]), statistics.median(times["eager"]),
                      eager)


def _check_shapes(input_size, batch_size: int, dynamic_batch: bool, dynamic_size: bool, step: int):
    """(traced shape, verification shapes)."""
    c, h, w = input_size
    trace_batch = max(batch_size, 2) if dynamic_batch else batch_size
    shapes = [(batch_size, c, h, w)]
    if dynamic_batch or dynamic_size:
        b2 = (1 if batch_size > 1 else 2) if dynamic_batch else batch_size
        h2, w2 = (h + step, w + 2 * step) if dynamic_size else (h, w)
        shapes.append((b2, c, h2, w2))
    return (trace_batch, c, h, w), shapes


def _export_program(model, example, dynamic_batch: bool, dynamic_size: bool, step: int, checks_shapes, seed: int):
    """torch.export.export with honest guards: a size the trace specialises on is an error, not a silent constant.

    (``torch.onnx.export(model, ...)`` would trace with size-oblivious shapes and turn such guards into
    runtime assertions that the ONNX file drops.)
    """
    from torch.export import Dim

    dims = {}
    if dynamic_batch:
        dims[0] = Dim("batch")
    if dynamic_size:
        dims[2] = step * Dim("height_blocks")
        dims[3] = step * Dim("width_blocks")
    dynamic_shapes = ({i: d for i, d in dims.items()},) if dims else None
    try:
        with torch.no_grad():
            program = torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes, strict=False)
    except torch._dynamo.exc.UserError as e:  # constraint violations: a dynamic axis the code pins
        lines = [line.strip(" -") for line in str(e).splitlines() if "Not all values" in line]
        what = "height/width" if dynamic_size else "the batch"
        raise ExportError(
            f"cannot keep {what} symbolic: {lines[0] if lines else _one_line(e)}"
            + ("; export one file per --img-size (without --dynamic-size)" if dynamic_size else "")
        ) from e
    except Exception as e:
        raise ExportError(f"torch.export failed: {_one_line(e)}") from e
    if dynamic_size:
        # Guards that pin the size survive in the program but not in ONNX: call the program at the other size.
        module = program.module()
        for x in _random_inputs([s for s in checks_shapes if s[2:] != tuple(example.shape[2:])], seed + 1):
            try:
                with torch.no_grad():
                    module(x)
            except Exception as e:
                guard = re.search(r"Guard failed: (.*)", str(e))
                reason = f"guard {guard.group(1).strip()}" if guard else _one_line(e)
                raise ExportError(
                    f"cannot keep height/width symbolic: the traced graph holds only for "
                    f"{example.shape[2]}x{example.shape[3]} ({reason}; the model branches on the input size, "
                    "e.g. to resample position tables or choose windows); export one file per --img-size "
                    "(without --dynamic-size)"
                ) from e
    return program


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    input_size: tuple[int, int, int],
    batch_size: int = 1,
    dynamic_batch: bool = True,
    dynamic_size: bool = False,
    opset: int | None = None,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    int8: bool = False,
    int8_min_features: int = INT8_MIN_FEATURES,
    speed: bool = False,
) -> ExportResult:
    """Export ``model`` (put in eval mode) to ONNX at ``path``, verified in onnxruntime first.

    Args:
        input_size: (channels, height, width) of the traced input; a static height/width are these.
        batch_size: batch of the first verification (and of the input when the batch is static).
        dynamic_batch: symbolic batch axis; verified at ``batch_size`` and at one other batch.
        dynamic_size: symbolic height and width (multiples of the model's total stride); refused with
            :class:`ExportError` for models whose code depends on the size (see the module docstring).
        opset: ONNX opset (default: the exporter's).
        atol: largest allowed ``max |onnxruntime - eager|``.
        int8: write the verified graph with its linear layers quantized to int8 (the module docstring);
            its difference from the float32 eager model is reported in ``int8_checks``.
        int8_min_features: with ``int8``, the narrowest linear layer quantized (:data:`INT8_MIN_FEATURES`).
        speed: time the written file in onnxruntime beside the eager model (``int8``: beside
            :func:`quantize_int8`'s model) on the first verification batch (:func:`measure_speed`).

    Raises :class:`ExportError` (one line) when the model cannot be exported as asked, and
    :class:`ExportVerificationError` when the file does not reproduce the model; in both cases
    nothing is written at ``path`` (an existing file there is left untouched).
    """
    _require_onnx()
    if batch_size < 1:
        raise ExportError(f"batch size must be >= 1, got {batch_size}")
    if opset is not None:
        import onnx.defs

        newest = onnx.defs.onnx_opset_version()  # before exporting: onnx's converter fails with a traceback
        if isinstance(opset, bool) or not isinstance(opset, int) or not 1 <= opset <= newest:
            raise ExportError(f"opset must be in 1..{newest} (the installed onnx's), got {opset!r}")
    if not atol >= 0:
        raise ExportError(f"tolerance must be >= 0, got {atol}")
    if int8:
        _check_min_features(int8_min_features, ExportError)
    path = Path(path)
    if path.is_dir():
        raise ExportError(f"{path} is a folder; give the ONNX file to write")
    model.eval()
    c, h, w = input_size
    step = _size_step(model)
    if dynamic_size and (h % step or w % step):
        raise ExportError(f"with a dynamic size, the image size {h}x{w} must be a multiple of {step}")
    trace_shape, check_shapes = _check_shapes(input_size, batch_size, dynamic_batch, dynamic_size, step)
    for shape in (trace_shape, *check_shapes):
        check_batch_memory(*shape, "cpu", ExportError)
    example = _random_inputs([trace_shape], seed)[0]
    try:
        with torch.no_grad():
            model(example)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ExportError(f"the model rejects input {tuple(example.shape)}: {_one_line(e)}") from e

    start = time.perf_counter()
    program = _export_program(model, example, dynamic_batch, dynamic_size, step, check_shapes, seed)
    try:
        onnx_program = torch.onnx.export(
            program, (example,), dynamo=True, opset_version=opset, input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME], verbose=False,
        )
    except Exception as e:
        raise ExportError(f"ONNX conversion failed: {_one_line(e)}") from e
    export_s = time.perf_counter() - start

    axes = dict(zip((0, 2, 3), ("batch", "height", "width")))
    shape = onnx_program.model.graph.inputs[0].shape
    onnx_program.rename_axes({shape[i]: name for i, name in axes.items() if not isinstance(shape[i], int)})
    proto = onnx_program.model_proto
    input_shape = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    symbolic = [isinstance(d, str) for d in input_shape]
    if symbolic != [dynamic_batch, False, dynamic_size, dynamic_size]:
        raise ExportError(f"the exported input has shape {input_shape}, not the requested dynamic axes")
    if proto.ByteSize() > _MAX_PROTO_BYTES:
        raise ExportError(f"the model is {proto.ByteSize() / 1e9:.1f} GB, over ONNX's 2 GB single-file limit")
    data = proto.SerializeToString()
    opset_used = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset_used != opset:  # the exporter falls back to its own opset with a log message
        raise ExportError(f"the exporter cannot write this model in opset {opset} (it wrote opset {opset_used})")
    del onnx_program, proto, program

    inputs = _random_inputs(check_shapes, seed + 1)
    timing = {}

    def verify(file: str, eager: nn.Module, limit: float) -> list[OnnxCheck]:
        t0 = time.perf_counter()
        try:
            checks = verify_onnx(file, eager, inputs)  # the bytes on disk, read back
        except Exception as e:  # onnxruntime refuses the file or fails running it
            raise ExportVerificationError(
                f"onnxruntime cannot run the exported file: {_one_line(e)}; the file was deleted ({path} was not "
                "written)"
            ) from e
        timing["verify_s"] = timing.get("verify_s", 0.0) + time.perf_counter() - t0
        worst = max(checks, key=lambda check: check.max_abs_diff)
        if not worst.max_abs_diff <= limit:
            raise ExportVerificationError(
                f"onnxruntime output differs from eager PyTorch by {worst.describe()}, above the tolerance "
                f"{limit:.0e}; the file was deleted ({path} was not written)"
            )
        return checks

    def write_and_verify(f):
        f.write(data)
        f.flush()
        timing["checks"] = verify(f.name, model, atol)

    if int8:
        with tempfile.TemporaryDirectory(prefix="polaformer_export_") as folder:
            fp32, quantized = Path(folder) / "float32.onnx", Path(folder) / "int8.onnx"
            fp32.write_bytes(data)
            timing["checks"] = verify(str(fp32), model, atol)
            try:
                _quantize_onnx(fp32, quantized, int8_min_features)
            except Exception as e:
                raise ExportError(f"int8 quantization failed: {_one_line(e)}") from e
            timing["int8_checks"] = verify(str(quantized), model, math.inf)
            data = quantized.read_bytes()
        atomic_write(path, lambda f: f.write(data))
    else:
        atomic_write(path, write_and_verify)
    speed_check = None
    if speed:
        eager = quantize_int8(model, min_features=int8_min_features) if int8 else model
        speed_check = measure_speed(path, eager, inputs[0], eager="int8" if int8 else "float32")
    return ExportResult(
        path=path, opset=opset_used, input_shape=input_shape, checks=timing["checks"], atol=atol,
        export_s=export_s, verify_s=timing["verify_s"], size_bytes=len(data), int8_checks=timing.get("int8_checks"),
        speed=speed_check,
    )


def export_model(
    name: str,
    path: str | os.PathLike,
    *,
    checkpoint: str | os.PathLike | None = None,
    weights: str = "auto",
    model_kwargs: dict | None = None,
    img_size: int | None = None,
    **kwargs,
) -> ExportResult:
    """Build the registered model ``name`` (with ``checkpoint``'s weights if given) and :func:`export_onnx` it.

    The checkpoint is anything :func:`polaformer.load_checkpoint` reads (the authors' files, ours,
    timm's, safetensors), loaded strictly. A file of our training engine must hold ``name``; its
    model arguments are used, and the classifier is sized from the file's weights. The input
    is square, ``img_size`` (default: the model's own size).
    """
    _require_onnx()
    from .checkpoint import (
        ArchitectureMismatchError,
        load_checkpoint,
        read_checkpoint,
        select_weights,
        strip_wrapper_prefixes,
    )
    from .engine.factory import create_model  # registers our models with timm

    kwargs_ = dict(model_kwargs or {})
    num_classes = kwargs_.pop("num_classes", None)
    shapes = {}
    if checkpoint is not None:
        stored = read_checkpoint(checkpoint)
        _, state_dict = select_weights(stored, weights, checkpoint)
        shapes = {key: tuple(v.shape) for key, v in strip_wrapper_prefixes(state_dict).items()}
        arch = stored.get("arch") if isinstance(stored, dict) else None
        if isinstance(arch, str):
            if arch != name:
                raise ArchitectureMismatchError(
                    f"checkpoint {checkpoint} holds architecture {arch!r}, not the requested {name!r}"
                )
            stored_kwargs = stored.get("model_kwargs")
            kwargs_ = {**(stored_kwargs if isinstance(stored_kwargs, dict) else {}), **kwargs_}
            kwargs_.pop("num_classes", None)
            if num_classes is None and isinstance(stored.get("num_classes"), int):
                num_classes = stored["num_classes"]
        del stored, state_dict
    if num_classes is None:
        import timm

        try:
            num_classes = timm.get_pretrained_cfg_value(name, "num_classes") if timm.is_model(name) else None
        except RuntimeError:  # deprecated aliases (pola_b0 for POLA_b0) have no configuration of their own
            num_classes = None
        num_classes = num_classes or 1000
    model = create_model(name, num_classes, **kwargs_)
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    head_name = next((n for n, m in model.named_modules() if m is head and n), None) if head is not None else None
    file_classes = shapes.get(f"{head_name}.weight", (None,))[0] if head_name else None
    if file_classes is not None and file_classes != num_classes:  # e.g. a model fine-tuned on other classes
        num_classes = file_classes
        model = create_model(name, num_classes, **kwargs_)
    description = "random initialisation"
    if checkpoint is not None:
        loaded = load_checkpoint(model, checkpoint, weights=weights)
        description = f"{loaded.entry!r} weights of {checkpoint}" if loaded.entry else f"weights of {checkpoint}"

    cfg = getattr(model, "pretrained_cfg", None) or {}
    channels = int(kwargs_.get("in_chans", cfg.get("input_size", (3,))[0]))
    if img_size is None:
        size = kwargs_.get("img_size", cfg.get("input_size", (3, 224, 224))[-1])
        img_size = int(size if isinstance(size, int) else size[-1])
    result = export_onnx(model, path, input_size=(channels, img_size, img_size), **kwargs)
    result.weights = description
    return result
