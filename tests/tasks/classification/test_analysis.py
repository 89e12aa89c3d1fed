"""`polaformer analyze`: files written, entropy correctness, row sampling, one-line CLI errors.

Tolerances (tests/README.md, tests/tolerances.py): float64 local matrices against the module at 1e-10, far above
reorder_rtol(n, float64) for its sums; entropies in float32 at pytest.approx's 1e-6, a few units of u for logs and
sums of at most 37 terms."""
import copy
import json
import math

import pytest
import timm
import torch

from polaformer.analysis import attention_maps as am, positive_sequence_entropy, sample_rows
from polaformer.analysis.rank import layer_ranks, local_matrices
from polaformer.cli import main

TINY = ["--model", "pola_deit_digits", "--img-size", "16", "--max-rows", "8"]


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_writes_four_pngs_and_json(tmp_path, capsys):
    code, out, err = run_main(["analyze", *TINY, "--query", "1", "2", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    for name in ("attention_maps.png", "entropy.png", "gates.png", "rank.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
    result = json.loads((tmp_path / "analysis.json").read_text())
    assert result["weights"] == "untrained weights"
    assert result["query"] == [1, 2] and result["model"] == "pola_deit_digits"
    fractions = result["theorem1"]["all_layers"]["pola same-sign vs relu"]
    assert 0 <= fractions["fraction_drop"] <= 1 and fractions["rows"] > 0
    assert -1 <= result["gate_pearson_r"] <= 1
    assert result["switches"] == {"polarity": True, "polarity_coefficients": True, "local": "dwc"}
    assert all(r["with_local_rank"] == r["tokens"] for r in result["rank"])
    assert "untrained weights" in out


def test_analyze_takes_the_table3_switches(tmp_path, capsys):
    """Without Gˢ/Gᵒ there is no gate to plot; without a local branch no rank with it."""
    code, out, err = run_main(["analyze", *TINY, "--model-kwarg", "polarity_coefficients=false",
                               "--model-kwarg", "local=none", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    result = json.loads((tmp_path / "analysis.json").read_text())
    assert result["switches"] == {"polarity": True, "polarity_coefficients": False, "local": "none"}
    assert result["gate_pearson_r"] is None and not (tmp_path / "gates.png").exists() and "no gate" in out
    assert all(r["with_local_rank"] is None and r["attention_rank"] > 0 for r in result["rank"])


def _one_layer_features(**switches):
    torch.manual_seed(0)
    model = timm.create_model("pola_deit_digits", img_size=24, depth=1, **switches)
    if switches.get("local") == "dcn":  # taps moved off the grid, so the DCN is not the plain conv
        torch.nn.init.normal_(model.blocks[0].attn.dcn.offset.weight, std=0.3)
    return am.capture_layer_features(model, torch.randn(1, 1, 24, 24))[0]


@pytest.mark.parametrize("switches", [{}, {"polarity": False, "polarity_coefficients": False}])
def test_rank_of_linear_attention_is_bounded_and_the_dwc_restores_it(switches):
    """144 patch tokens, head width 32: the weights' rank is at most the feature width (64 with polarity,
    32 without), and the DWC's banded matrix makes the token mixing full rank (paper §3.4)."""
    ranks = layer_ranks(_one_layer_features(**switches), max_channels=3)
    assert ranks["tokens"] == 144 and ranks["feature_width"] == (64 if switches == {} else 32)
    assert 0 < ranks["attention_rank"] <= ranks["feature_width"] < ranks["with_local_rank"] == 144


@pytest.mark.parametrize("local", ["dwc", "dcn"])
def test_local_matrices_reproduce_the_local_branch(local):
    """L_c · v_c + bias_c is the branch's own output on the layer's values, in float64 (the DCN with its
    offsets held at those of these values)."""
    feat = _one_layer_features(local=local)
    head, (h, w) = 1, feat.grid
    values = feat.v[0, head, feat.prefix:].double()  # (P, d)
    matrices = local_matrices(feat, head)  # (d, P, P)
    module = copy.deepcopy(feat.local).double()
    grid = values.t().reshape(1, -1, h, w)
    with torch.no_grad():
        expected = module(grid).reshape(values.shape[1], -1)
        bias = module(torch.zeros_like(grid)).reshape(values.shape[1], -1)
    actual = torch.einsum("cij,jc->ci", matrices, values) + bias
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_pse_uniform_is_log_n_and_one_hot_is_zero():
    n = 37
    assert positive_sequence_entropy(torch.full((n,), 0.3)).item() == pytest.approx(math.log(n))
    one_hot = torch.zeros(n)
    one_hot[5] = 2.0
    assert positive_sequence_entropy(one_hot).item() == 0.0
    rows = torch.stack([torch.ones(4), torch.tensor([1.0, 0, 0, 0])])
    assert positive_sequence_entropy(rows).tolist() == pytest.approx([math.log(4), 0.0])
    # scale invariance, and undefined for an all-zero row
    assert positive_sequence_entropy(torch.tensor([1.0, 2, 3])).item() == pytest.approx(
        positive_sequence_entropy(torch.tensor([10.0, 20, 30])).item())
    assert math.isnan(positive_sequence_entropy(torch.zeros(3)).item())


def test_sample_rows():
    assert sample_rows(5, 10).tolist() == [0, 1, 2, 3, 4]
    rows = sample_rows(10_000, 16)
    assert len(rows) == 16 and len(set(rows.tolist())) == 16 and rows.max() < 10_000


def test_large_n_never_builds_the_full_matrix(tmp_path, monkeypatch):
    """1,025 tokens: every weight matrix built has at most max_rows query rows."""
    shapes = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            for w in out if isinstance(out, tuple) else (out,):
                shapes.append(tuple(w.shape))
            return out
        return wrapped

    for name in ("softmax_attention_weights", "linear_attention_weights", "pola_attention_weights",
                 "pacs_attention_weights"):
        monkeypatch.setattr(am, name, spy(getattr(am, name)))
    result = am.analyze(tmp_path, model_name="pola_deit_digits", img_size=64, max_rows=16)
    assert result["theorem1"]["per_layer"]["blocks.0.attn"]["queries"] == 1025
    assert shapes and all(s[-2] <= 16 for s in shapes)
    assert max(s[-1] for s in shapes) == 1025  # all keys, for the sampled rows only


@pytest.mark.parametrize("argv, fragment", [
    (["--query", "99", "0"], "outside the 8x8 query grid"),
    (["--layer", "7"], "--layer must be in 0..3"),
    (["--image", "/nonexistent/photo.png"], "cannot read image"),
    (["--model", "no_such_model"], "unknown model"),
    (["--checkpoint", "/nonexistent/ckpt.pth"], "checkpoint not found"),
    (["--img-size", "0"], "must be a positive integer"),
])
def test_analyze_errors_are_one_line_with_status_2(argv, fragment, tmp_path, capsys):
    code, out, err = run_main(["analyze", *TINY, *argv, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and fragment in err, err
