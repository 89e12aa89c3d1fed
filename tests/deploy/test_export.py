"""ONNX export: the dynamo exporter (ours, verified in onnxruntime), the legacy exporter, `polaformer export`.

Models are the smallest of each family, cut to the fewest blocks that still hold every kind of layer
(linear and softmax attention, shifted windows), at small inputs: export time grows with the
graph, and the full-size variants are covered in docs/export.md.
"""
import numpy as np
import pytest
import timm
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402

import polaformer.models  # noqa: E402,F401
from polaformer.cli import main  # noqa: E402
from polaformer.export import DEFAULT_ATOL, ExportError, ExportVerificationError, export_onnx  # noqa: E402

# (model, kwargs, input size): every family, small; the sizes differ from the built size where the
# model resamples its position tables, so that path is exported too.
FAMILIES = {
    "deit": ("pola_deit_digits", dict(depth=2), (1, 8, 8)),
    # 'LSLS': the official mixed layout, so PVT's softmax SRA layer is exported too.
    "pvt": ("pola_pvt_tiny", dict(depths=(1, 1, 1, 1), attn_type="LSLS"), (3, 64, 64)),
    "pvt_v2": ("pola_pvt_v2_b0", dict(depths=(1, 1, 1, 1)), (3, 64, 64)),
    # Stage 3 keeps two softmax window blocks; at 128 px its 8x8 grid is padded to 14x14 and the second
    # block shifts, so the mask is built in the graph (at 224 the stored one is used).
    "swin": ("pola_swin_t", dict(depths=(1, 1, 2, 1)), (3, 128, 128)),
    # PaCS linear ('l') stages and RoPE softmax ('v') stages.
    "polapp": ("POLA_b0", dict(depths=(1, 1, 1, 1)), (3, 64, 64)),
}


def _model(family):
    name, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs).eval()


def _run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _max_diff(model, path, x):
    with torch.no_grad():
        expected = model(x).numpy()
    return float(np.abs(_run(path, x) - expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"deit"}))  # deit: the CLI test below
def test_dynamo_export_matches_eager(family, tmp_path):
    model = _model(family)
    size = FAMILIES[family][2]
    dynamic_size = family == "polapp"  # the one family whose graph does not depend on the input size
    out = tmp_path / "model.onnx"
    result = export_onnx(model, out, input_size=size, batch_size=1, dynamic_size=dynamic_size)
    second_height = size[1] + 32 if dynamic_size else size[1]
    assert [(c.batch, c.height) for c in result.checks] == [(1, size[1]), (2, second_height)]
    assert result.max_abs_diff <= DEFAULT_ATOL
    assert result.input_shape == ["batch", size[0], *(["height", "width"] if dynamic_size else size[1:])]
    # Independently of the exporter's own check: a third batch size (and size).
    x = torch.randn(3, size[0], size[1] + 64 * dynamic_size, size[2])
    assert _max_diff(model, out, x) <= DEFAULT_ATOL
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_dynamic_size_refused_where_the_graph_depends_on_it(tmp_path):
    # DeiT resamples its position table only when the grid differs from the built one: torch.export
    # pins the size with a guard that ONNX would drop, so the request is refused, not written.
    out = tmp_path / "deit.onnx"
    with pytest.raises(ExportError, match="cannot keep height/width symbolic.*--img-size"):
        export_onnx(_model("deit"), out, input_size=(1, 8, 8), dynamic_size=True)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_wrong_graph_is_not_kept(tmp_path):
    class Diverges(torch.nn.Module):  # eager and exported graphs differ, as a mis-traced model would
        def forward(self, x):
            return x.mean(dim=(2, 3)) + (1e-3 if torch.compiler.is_exporting() else 0.0)

    out = tmp_path / "wrong.onnx"
    out.write_bytes(b"older file")
    with pytest.raises(ExportVerificationError, match=r"differs .* by 1\.00e-03 .*was not written"):
        export_onnx(Diverges(), out, input_size=(3, 8, 8))
    assert out.read_bytes() == b"older file"  # the destination is untouched, no temporary file is left
    assert [p.name for p in tmp_path.iterdir()] == ["wrong.onnx"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_legacy_exporter_is_exact(family, tmp_path):
    # torch.onnx.export(dynamo=False) traces through TorchScript: the fused op takes its functional
    # form there, and PaCS writes expm1/exp2 as exp(x) - 1 and 2**x, which that exporter lacks.
    model = _model(family)
    c, h, w = FAMILIES[family][2]
    out = tmp_path / "legacy.onnx"
    torch.onnx.export(model, (torch.randn(2, c, h, w),), str(out), dynamo=False, input_names=["x"],
                      dynamic_axes={"x": {0: "batch"}})
    for batch in (1, 2):
        assert _max_diff(model, out, torch.randn(batch, c, h, w)) <= DEFAULT_ATOL


def test_legacy_exporter_refuses_what_it_cannot_trace(tmp_path):
    # DeiT resamples its position table (antialiased bicubic, which that exporter lacks) at other sizes.
    out = tmp_path / "legacy.onnx"
    with pytest.raises(RuntimeError, match=r"TorchScript-based ONNX exporter .* cannot resample .* dynamo=True"):
        torch.onnx.export(_model("deit"), (torch.randn(2, 1, 16, 16),), str(out), dynamo=False)
    assert not out.exists()


def test_window_attention_exports_with_grad_enabled(tmp_path):
    # Outside no_grad the fused CPU attention's strides made torch.onnx.export fail ("Cannot view a
    # tensor ..."); the layer copies explicitly under export.
    from polaformer.layers import WindowAttention

    layer = WindowAttention(64, 7, 4).eval()
    x, mask = torch.randn(4, 49, 64), torch.zeros(2, 49, 49)
    mask[1, :20, 20:] = -100.0

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, mask):
            return self.layer(x, mask)

    out = tmp_path / "window.onnx"
    torch.onnx.export(Wrapped(), (x, mask), str(out), dynamo=True, verbose=False)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, dict(zip(names, (x.numpy(), mask.numpy()))))[0]
    with torch.no_grad():
        assert np.abs(got - layer(x, mask).numpy()).max() <= DEFAULT_ATOL


# --- the command ------------------------------------------------------------------------------

def test_cli_exports_a_checkpoint_and_verifies_it(tmp_path, capsys):
    from safetensors.torch import save_file

    model = _model("deit")
    with torch.no_grad():
        model.head.bias.add_(3.0)  # weights a fresh model cannot have
    save_file(model.state_dict(), tmp_path / "weights.safetensors")
    out = tmp_path / "digits.onnx"
    code = main(["export", "--model", "pola_deit_digits", "--model-kwarg", "depth=2",
                 "--checkpoint", str(tmp_path / "weights.safetensors"), "--format", "onnx", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "max abs diff" in stdout and "batch 1 (8x8)" in stdout and "batch 2 (8x8)" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.onnx", "weights.safetensors"]
    for batch in (1, 5):
        assert _max_diff(model, out, torch.randn(batch, 1, 8, 8)) <= DEFAULT_ATOL


def _cli_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_cli_unknown_model(tmp_path, capsys):
    code, err = _cli_error(capsys, ["export", "--model", "no_such_model", "--out", str(tmp_path / "x.onnx")])
    assert code == 2 and err.count("\n") == 1 and "unknown model 'no_such_model'" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["export", "--model", "pola_pvt_v2_b0", "--img-size", "100000"],
                                  ["bench", "onnx", "--families", "pola_pvt_v2_b0", "--img-size", "100000"]])
def test_cli_refuses_inputs_larger_than_memory(tmp_path, capsys, argv):
    """A 100000² batch is refused before anything that size is built (it used to end in the allocator's error)."""
    out = tmp_path / "x.onnx"
    code, err = _cli_error(capsys, argv + (["--out", str(out)] if argv[0] == "export" else []))
    last = err.strip().splitlines()[-1]  # torch may log a line of its own on first importing its C++ extensions
    assert code == 2 and "Traceback" not in err and "x 100000 x 100000) needs" in last and "memory available" in last
    assert not list(tmp_path.iterdir())


def test_cli_missing_checkpoint(tmp_path, capsys):
    argv = ["export", "--model", "pola_deit_digits", "--checkpoint", str(tmp_path / "missing.pth"),
            "--out", str(tmp_path / "x.onnx")]
    code, err = _cli_error(capsys, argv)
    assert code == 2 and err.count("\n") == 1 and "checkpoint not found" in err
    assert not list(tmp_path.iterdir())


def test_cli_tolerance_exceeded_leaves_no_file(tmp_path, capsys):
    # onnxruntime's float32 kernels add in another order than torch's: they differ by about u = 6e-8 of the
    # outputs, never within 1e-12 unless every sum of the model were added alike
    out = tmp_path / "digits.onnx"
    argv = ["export", "--model", "pola_deit_digits", "--model-kwarg", "depth=1", "--atol", "1e-12", "--out", str(out)]
    code, err = _cli_error(capsys, argv)
    assert code == 1 and err.count("\n") == 1
    assert "above the tolerance 1e-12" in err and "was not written" in err
    assert not list(tmp_path.iterdir())


def test_cli_refuses_a_size_the_model_rejects(tmp_path, capsys):
    argv = ["export", "--model", "pola_deit_digits", "--img-size", "9", "--out", str(tmp_path / "x.onnx")]
    code, err = _cli_error(capsys, argv)
    assert code == 2 and err.count("\n") == 1 and "not divisible" in err
    assert not list(tmp_path.iterdir())
