"""`polaformer ablate`: the Table 3 ablation files and a tiny end-to-end run."""
import csv
from pathlib import Path

import pytest

from polaformer.cli import main
from polaformer.engine import ConfigError
from polaformer.tasks.classification.ablation import load_ablation

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ablations"


@pytest.mark.parametrize("name", ["digits.yaml", "deit_tiny_imagenet.yaml"])
def test_ablation_files_hold_the_papers_rows(name):
    cfg, rows, seeds, reference = load_ablation(CONFIGS / name)
    assert [(r.name, r.paper) for r in rows] == [("dcn", 61.9), ("no_polarity", 68.1), ("no_coefficients", 72.8),
                                                 ("full", 74.6)]
    assert rows[-1].switches == {"polarity": True, "polarity_coefficients": True, "local": "dwc"}
    assert len(seeds) >= 2 and "Table 3" in reference
    if name == "deit_tiny_imagenet.yaml":  # the paper's recipe, pulled in with BASE
        assert cfg.MODEL.NAME == "pola_deit_tiny_patch16_224" and cfg.TRAIN.EPOCHS == 300


def test_bad_rows_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ABLATION:\n  ROWS:\n    - {NAME: a, SWITCHES: {gate: false}}\n")
    with pytest.raises(ConfigError, match="SWITCHES takes only"):
        load_ablation(bad)


def test_ablate_end_to_end_one_row_one_seed(tmp_path, capsys):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        f"BASE: [{CONFIGS / 'digits.yaml'}]\n"
        "MODEL: {KWARGS: {depth: 1, embed_dim: 16}}\n"
        "ABLATION:\n  SEEDS: [0]\n  ROWS:\n"
        "    - {NAME: no_gate, LABEL: no gate, SWITCHES: {polarity_coefficients: false, local: none}, PAPER: 72.8}\n"
    )
    out = tmp_path / "out"
    argv = ["ablate", "--config", str(tiny), "--epochs", "1", "--output", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[1/1] no_gate seed 0: training 1 epochs" in err
    with open(out / "ablation.csv", newline="", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["row"] == "no_gate" and row["polarity_coefficients"] == "False" and row["local"] == "none"
    assert 0.0 <= float(row["top1_mean"]) <= 100.0 and float(row["paper_top1"]) == 72.8
    assert "| no gate | ✓ | – | none |" in (out / "ablation.md").read_text(encoding="utf-8")
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    # a finished run is read back, not trained again
    assert main(argv) == 0
    assert "seed 0 read back" in capsys.readouterr().err


def test_unknown_row_is_a_one_line_error(capsys):
    assert main(["ablate", "--config", str(CONFIGS / "digits.yaml"), "--rows", "nope"]) == 2
    assert "unknown rows nope" in capsys.readouterr().err
