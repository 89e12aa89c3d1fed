"""What deployment in onnxruntime gets: the attention ops' exported graphs in onnxruntime's cheap operators,
int8 linear layers (eager and exported) within their rounding bound, `polaformer export --int8` and its speed
line, and `polaformer bench onnx`."""
import numpy as np
import onnx
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402

import polaformer.export as export_module  # noqa: E402
import polaformer.models  # noqa: E402,F401
from polaformer.cli import main  # noqa: E402
from polaformer.export import export_onnx, quantize_int8  # noqa: E402
from polaformer.ops import (  # noqa: E402
    learnable_power,
    pacs_linear_attention,
    pacs_temperature,
    pola_linear_attention,
    rope_2d,
    rope_angles,
)

SLOW_ORT_OPS = {"Where", "Pow", "Sign", "Softplus"}  # scalar loops in onnxruntime's CPU provider


class _Ops(nn.Module):
    """Both bidirectional ops on (B, 2 heads, 3x4 tokens, 8) inputs, PaCS with RoPE."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 2, 1, 8))
        self.s = nn.Parameter(torch.randn(2, 1, 2, 1, 16))
        self.register_buffer("sin", rope_2d(rope_angles(32, 2), 3, 4)[0])
        self.register_buffer("cos", rope_2d(rope_angles(32, 2), 3, 4)[1])

    def forward(self, q, k, v):
        temps = pacs_temperature(self.s)
        return (pola_linear_attention(q, k, v, learnable_power(self.w, 4.0)),
                pacs_linear_attention(q, k, v, temps[0], temps[1], self.sin, self.cos))


def test_exported_attention_uses_one_log_per_element_and_no_scalar_loop_operators(tmp_path):
    torch.manual_seed(0)
    model, inputs = _Ops().eval(), tuple(torch.randn(2, 2, 12, 8) for _ in range(3))
    path = tmp_path / "ops.onnx"
    torch.onnx.export(model, inputs, str(path), dynamo=True, verbose=False)
    ops = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert not SLOW_ORT_OPS & set(ops), sorted(SLOW_ORT_OPS & set(ops))
    assert ops.count("Log") == 2  # ln|q| and ln|k| of the power map; PaCS needs none
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})
    with torch.no_grad():
        for a, b in zip(got, model(*inputs)):
            assert np.abs(a - b.numpy()).max() <= 1e-5


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x.flatten(1))


def _int8_bound(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Per output, the most that rounding the activations (per tensor, at least 7 bits: torch's x86 kernels use 7,
    onnxruntime 8) and the weights (per tensor, symmetric int8) to their grids can move ``x @ W.T``:
    ``Σ_j |W_ij|·s_x/2 + |x_j|·s_w/2 + s_x·s_w/4``, plus float32 rounding."""
    w = layer.weight.detach().double()
    x = x.double().flatten(1)
    s_x = (x.max().clamp_min(0) - x.min().clamp_max(0)) / 127
    s_w = w.abs().max() / 127
    bound = w.abs().sum(1) * s_x / 2 + x.abs() @ torch.ones_like(w.T) * s_w / 2 + w.shape[1] * s_x * s_w / 4
    return bound * (1 + 1e-5) + 1e-6


def test_int8_linear_layers_stay_within_their_rounding_bound(tmp_path):
    torch.manual_seed(0)
    model, x = _Linear().eval(), torch.randn(4, 3, 2, 2)
    with torch.no_grad():
        ref, bound = model(x), _int8_bound(model.fc, x)
        assert isinstance(quantize_int8(model).fc, nn.Linear)  # 12 -> 5: too narrow for int8 to pay by default
        eager = quantize_int8(model, min_features=1)
        assert type(eager.fc).__module__.startswith("torch.ao.nn.quantized")
        assert isinstance(model.fc, nn.Linear)  # the model itself is left as it was
        assert ((eager(x) - ref).abs() <= bound).all()
    path = tmp_path / "int8.onnx"
    result = export_onnx(model, path, input_size=(3, 2, 2), batch_size=4, int8=True, int8_min_features=1)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert ops & {"DynamicQuantizeMatMul", "MatMulInteger"}, ops
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"images": x.numpy()})[0]
    assert (torch.from_numpy(got).double() - ref.double()).abs().le(bound).all()
    assert [c.batch for c in result.int8_checks] == [4, 1] and all(c.max_abs_diff > 0 for c in result.int8_checks)
    assert result.checks[0].max_abs_diff <= 1e-4  # the float32 graph was verified before quantizing


@pytest.mark.parametrize("bad", [0, -1, 2.5, float("nan"), True, "64"])
def test_int8_width_must_be_a_positive_integer(tmp_path, bad):
    model = _Linear().eval()
    with pytest.raises(ValueError, match="narrowest linear layer to quantize must be a positive integer"):
        quantize_int8(model, min_features=bad)
    with pytest.raises(export_module.ExportError, match="narrowest linear layer"):
        export_onnx(model, tmp_path / "x.onnx", input_size=(3, 2, 2), int8=True, int8_min_features=bad)
    assert not list(tmp_path.iterdir())


def test_export_int8_quantizes_only_the_linear_layers_and_reports_speed(tmp_path, capsys):
    out = tmp_path / "digits_int8.onnx"
    assert main(["export", "--model", "pola_deit_digits", "--model-kwarg", "depth=1", "--int8", "--batch-size", "2",
                 "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert "linear layers quantized to int8" in line and "speed: onnxruntime" in line and "(int8)" in line
    ops = [node.op_type for node in onnx.load(str(out)).graph.node]
    assert "ConvInteger" not in ops and "Conv" in ops  # the patch embedding and depthwise conv stay float32
    # q and gate, k and v, output projection, two MLP layers (64 wide and more); the 10-class head and the
    # attention's own products stay float32
    assert ops.count("DynamicQuantizeMatMul") + ops.count("MatMulInteger") == 5
    x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert np.isfinite(session.run(None, {"images": x})[0]).all()


def test_export_int8_failure_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    def broken(source, target, min_features):
        raise RuntimeError("no quantizer here\nsecond line")

    monkeypatch.setattr(export_module, "_quantize_onnx", broken)
    out = tmp_path / "digits_int8.onnx"
    assert main(["export", "--model", "pola_deit_digits", "--model-kwarg", "depth=1", "--int8", "--no-speed",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "int8 quantization failed: RuntimeError: no quantizer here" in err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_bench_onnx_times_every_form_and_scores_a_trained_checkpoint(tmp_path, capsys, monkeypatch):
    from polaformer.bench import onnx_speed

    tiny = onnx_speed.Family("pola_deit_digits", "pola_deit_digits", (("depth", 1),))
    monkeypatch.setattr(onnx_speed, "FAMILIES", {tiny.ours: tiny})
    run = tmp_path / "run"
    assert main(["train", "--model", "vit_tiny_patch16_224", "--model-kwarg", "patch_size=2", "--model-kwarg",
                 "embed_dim=16", "--model-kwarg", "depth=1", "--model-kwarg", "num_heads=1", "--epochs", "1",
                 "--output", str(run)]) == 0
    checkpoint = next(run.glob("*.pt*"))
    files = {kind: tmp_path / f"onnx.{kind}" for kind in ("json", "md")}
    assert main(["bench", "onnx", "--batches", "2", "--threads", "1", "--rounds", "1", "--min-time", "0.001",
                 "--no-int8", "--img-size", "12", "--accuracy", str(checkpoint), "--json", str(files["json"]),
                 "--markdown", str(files["md"])]) == 0
    result = __import__("json").loads(files["json"].read_text())
    (row,) = result["rows"]
    assert row["family"] == "pola_deit_digits" and row["softmax"] == "pola_deit_digits(depth=1)"
    assert (row["height"], row["width"]) == (12, 12)  # the models built and exported for --img-size
    assert row["onnxruntime_vs_eager"] == pytest.approx(row["eager_ms"] / row["onnxruntime_ms"])
    assert row["onnxruntime_max_abs_diff"] <= 1e-4 and "eager_int8_ms" not in row
    assert row["eager_accelerated_max_abs_diff"] <= 1e-4  # the fused CPU modules compute the same model
    best = min(row["eager_ms"], row["eager_accelerated_ms"])
    assert row["onnxruntime_vs_best_eager"] == pytest.approx(best / row["onnxruntime_ms"])
    forms = {r["form"]: r for r in result["accuracy"]}
    assert list(forms) == ["eager", "eager_int8", "onnxruntime", "onnxruntime_int8"]
    assert forms["onnxruntime"]["max_logit_change"] <= 1e-4 and forms["eager"]["max_logit_change"] == 0
    assert forms["onnxruntime"]["top1"] == forms["eager"]["top1"] and forms["eager"]["images"] > 0
    table = files["md"].read_text()
    assert "| `pola_deit_digits` | `pola_deit_digits(depth=1)` | 2 |" in table and "| onnxruntime_int8 |" in table
    assert "12x12 float32 inputs" in table
