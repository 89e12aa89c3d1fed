"""`polaformer analyze`: files written, entropy correctness, row sampling, one-line CLI errors."""
import json
import math

import pytest
import torch

from polaformer.analysis import attention_maps as am
from polaformer.analysis import positive_sequence_entropy, sample_rows
from polaformer.cli import main

TINY = ["--model", "pola_deit_digits", "--img-size", "16", "--max-rows", "8"]


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_writes_three_pngs_and_json(tmp_path, capsys):
    code, out, err = run_main(["analyze", *TINY, "--query", "1", "2", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    for name in ("attention_maps.png", "entropy.png", "gates.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
    result = json.loads((tmp_path / "analysis.json").read_text())
    assert result["weights"] == "untrained weights"
    assert result["query"] == [1, 2] and result["model"] == "pola_deit_digits"
    fractions = result["theorem1"]["all_layers"]["pola same-sign vs relu"]
    assert 0 <= fractions["fraction_drop"] <= 1 and fractions["rows"] > 0
    assert -1 <= result["gate_pearson_r"] <= 1
    assert "untrained weights" in out


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
