"""Configuration: the official key tree, YAML files (official cfgs included), overrides, errors."""

import pytest
import timm

from conftest import REPO
from polaformer.cli import main
from polaformer.engine import ConfigError
from polaformer.engine.config import Config
from polaformer.tasks.classification import default_config, load_config, make_config
from polaformer.tasks.classification.ablation import load_ablation
from polaformer.tasks.classification.config import (
    OFFICIAL_MODEL_NAMES,
    check_config,
    config_from_train_config,
    resolve_model_name,
)

# The keys of the official PolaFormer cfgs/pola_pvt_t.yaml (written out here, not copied).
OFFICIAL_PVT_T = """\
DATA:
  IMG_SIZE: 224
  BATCH_SIZE: 128

TRAIN:
  WEIGHT_DECAY: 0.05
  EPOCHS: 300
  WARMUP_EPOCHS: 5
  COOLDOWN_EPOCHS: 10
  BASE_LR: 5e-4
  WARMUP_LR: 1e-6
  MIN_LR: 1e-5
  CLIP_GRAD: None

MODEL:
  TYPE: pola_pvt_tiny
  NAME: pola_pvt_tiny
  DROP_PATH_RATE: 0.1
  LA:
    ATTN_TYPE: LLLL
"""

# The keys of the official cfgs/pola_swin_b_384.yaml (fine-tuning recipe).
OFFICIAL_SWIN_B_384 = """\
DATA:
  IMG_SIZE: 384
  BATCH_SIZE: 32
MODEL:
  TYPE: pola_swin
  NAME: pola_swin_base_patch4_384_finetune
  DROP_PATH_RATE: 0.5
  SWIN:
    EMBED_DIM: 128
    DEPTHS: [ 2, 2, 18, 2 ]
    NUM_HEADS: [ 4, 8, 16, 32 ]
    WINDOW_SIZE: 96
  LA:
    ATTN_TYPE: LLSS
TRAIN:
  EPOCHS: 30
  WARMUP_EPOCHS: 5
  WEIGHT_DECAY: 1e-8
  BASE_LR: 2e-05
  WARMUP_LR: 2e-08
  MIN_LR: 2e-07
TEST:
  CROP: False"""

# The keys of PolaFormer++'s polaformer++/cfgs/pola_b0.yaml, its whitespace-only line (\x20\x20) included.
OFFICIAL_POLAPP_B0 = """\
MODEL:
  TYPE: polab0
  NAME: pola_b0_patch4_224
\x20\x20
DATA:
  BATCH_SIZE: 256
TRAIN:
  EPOCHS: 300
  MIN_LR: 1.0e-7"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_the_official_tree():
    cfg = default_config()
    assert set(cfg.keys()) >= {"DATA", "MODEL", "TRAIN", "AUG", "TEST", "AMP", "SEED", "OUTPUT", "SAVE_FREQ",
                               "PRINT_FREQ"}
    assert (cfg.TRAIN.BASE_LR, cfg.TRAIN.WARMUP_LR, cfg.TRAIN.MIN_LR) == (5e-4, 5e-7, 5e-6)
    train = cfg.TRAIN
    assert (train.EPOCHS, train.WARMUP_EPOCHS, train.CLIP_GRAD, train.WEIGHT_DECAY) == (300, 20, 5.0, 0.05)
    assert cfg.TRAIN.OPTIMIZER.BETAS == (0.9, 0.999) and cfg.TRAIN.LR_SCHEDULER.NAME == "cosine"
    aug = cfg.AUG
    assert (aug.MIXUP, aug.CUTMIX, aug.REPROB, aug.AUTO_AUGMENT) == (0.8, 1.0, 0.25, "rand-m9-mstd0.5-inc1")
    assert (cfg.DATA.INTERPOLATION, cfg.MODEL.LABEL_SMOOTHING, cfg.TEST.CROP) == ("bicubic", 0.1, True)
    assert cfg.MODEL.LA.ALPHA == 4 and cfg.MODEL.LA.FOCUSING_FACTOR == 3  # PolaFormer and PolaFormer++
    assert cfg["TRAIN"]["EMA"]["ENABLE"] is False
    as_dict = cfg.to_dict()
    assert as_dict["TRAIN"]["OPTIMIZER"]["BETAS"] == [0.9, 0.999] and Config(as_dict) == cfg


def test_official_pvt_cfg(tmp_path):
    cfg = load_config(write(tmp_path, "pola_pvt_t.yaml", OFFICIAL_PVT_T))
    # YAML reads 5e-4 as a string and None as a string: both are decoded as yacs does.
    assert cfg.TRAIN.BASE_LR == 5e-4 and isinstance(cfg.TRAIN.BASE_LR, float)
    assert (cfg.TRAIN.WARMUP_LR, cfg.TRAIN.MIN_LR, cfg.TRAIN.CLIP_GRAD) == (1e-6, 1e-5, None)
    assert (cfg.TRAIN.EPOCHS, cfg.TRAIN.WARMUP_EPOCHS, cfg.TRAIN.COOLDOWN_EPOCHS) == (300, 5, 10)
    assert (cfg.DATA.BATCH_SIZE, cfg.MODEL.DROP_PATH_RATE, cfg.MODEL.LA.ATTN_TYPE) == (128, 0.1, "LLLL")
    assert cfg.AUG.MIXUP == 0.8  # untouched defaults stay
    assert resolve_model_name(cfg) == "pola_pvt_tiny"
    check_config(cfg)


def test_official_swin_finetune_cfg(tmp_path):
    cfg = load_config(write(tmp_path, "pola_swin_b_384.yaml", OFFICIAL_SWIN_B_384))
    assert cfg.MODEL.SWIN.DEPTHS == [2, 2, 18, 2] and cfg.MODEL.SWIN.WINDOW_SIZE == 96
    assert (cfg.TRAIN.WEIGHT_DECAY, cfg.TRAIN.BASE_LR, cfg.TEST.CROP, cfg.DATA.IMG_SIZE) == (1e-8, 2e-5, False, 384)
    assert resolve_model_name(cfg) == "pola_swin_b_384"


def test_official_polaformer_pp_cfg(tmp_path):
    cfg = load_config(write(tmp_path, "pola_b0.yaml", OFFICIAL_POLAPP_B0))
    assert (cfg.DATA.BATCH_SIZE, cfg.TRAIN.MIN_LR) == (256, 1e-7)
    assert resolve_model_name(cfg) == "POLA_b0"


def test_every_official_name_is_a_model():
    for official, ours in OFFICIAL_MODEL_NAMES.items():
        assert timm.is_model(ours), (official, ours)


# configs/lra and configs/dense are other tasks' recipes (tests/tasks/); table3_rows.yaml is the fragment the
# ablation files include.
@pytest.mark.parametrize(
    "path", sorted(p for p in (REPO / "configs").rglob("*.yaml")
                   if p.parent.name not in ("lra", "dense") and p.name != "table3_rows.yaml"),
    ids=lambda p: p.stem,
)
def test_shipped_configs_load(path):
    # an ablation file is the classification tree plus its ABLATION rows
    cfg = load_ablation(path)[0] if path.parent.name == "ablations" else load_config(path)
    check_config(cfg)
    assert timm.is_model(resolve_model_name(cfg))


def test_unknown_key_lists_the_valid_ones(tmp_path):
    path = write(tmp_path, "typo.yaml", "TRAIN:\n  BASE_LRR: 1.0e-3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "'TRAIN.BASE_LRR'" in message and str(path) in message and "\n" not in message
    assert "valid keys under TRAIN:" in message and "BASE_LR" in message and "WARMUP_EPOCHS" in message
    with pytest.raises(ConfigError, match="valid keys at the top level: BASE, DATA, MODEL"):
        load_config(write(tmp_path, "top.yaml", "TRAINING: {}\n"))


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("TRAIN:\n  EPOCHS: many\n", "TRAIN.EPOCHS expects int, got 'many'"),
        ("TRAIN:\n  EPOCHS: 1.5\n", "TRAIN.EPOCHS expects int"),
        ("TRAIN: 3\n", "TRAIN is a group of keys"),
        ("- a\n- b\n", "must hold a mapping"),
        ("TRAIN: [unclosed\n", "is not valid YAML at line"),
    ],
)
def test_bad_values(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(write(tmp_path, "bad.yaml", text))


def test_ints_become_floats_and_lists_tuples(tmp_path):
    yaml = "MODEL:\n  DROP_PATH_RATE: 0\nTRAIN:\n  OPTIMIZER:\n    BETAS: [0.9, 0.95]\n"
    cfg = load_config(write(tmp_path, "c.yaml", yaml))
    assert cfg.MODEL.DROP_PATH_RATE == 0.0 and isinstance(cfg.MODEL.DROP_PATH_RATE, float)
    assert cfg.TRAIN.OPTIMIZER.BETAS == (0.9, 0.95)


def test_base_files_merge_first(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base", "common.yaml", "TRAIN:\n  EPOCHS: 100\n  BASE_LR: 1.0e-3\nDATA:\n  BATCH_SIZE: 64\n")
    child = write(tmp_path, "child.yaml", "BASE: ['base/common.yaml']\nTRAIN:\n  EPOCHS: 10\n")
    cfg = load_config(child)
    assert (cfg.TRAIN.EPOCHS, cfg.TRAIN.BASE_LR, cfg.DATA.BATCH_SIZE) == (10, 1e-3, 64)
    loop = write(tmp_path, "loop.yaml", "BASE: ['loop.yaml']\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(loop)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(write(tmp_path, "missing_base.yaml", "BASE: ['nope.yaml']\n"))


def test_opts_override_the_file(tmp_path):
    path = write(tmp_path, "pola_pvt_t.yaml", OFFICIAL_PVT_T)
    cfg = load_config(path, ["TRAIN.EPOCHS", "10", "TRAIN.BASE_LR", "1e-3", "TRAIN.CLIP_GRAD", "3",
                             "MODEL.KWARGS.depths", "[1, 1, 1, 1]", "AMP", "true", "OUTPUT", "runs/1e-3"])
    assert (cfg.TRAIN.EPOCHS, cfg.TRAIN.BASE_LR, cfg.TRAIN.CLIP_GRAD, cfg.AMP) == (10, 1e-3, 3.0, True)
    assert cfg.MODEL.KWARGS.to_dict() == {"depths": [1, 1, 1, 1]}
    assert cfg.OUTPUT == "runs/1e-3"  # string keys keep strings verbatim
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        load_config(None, ["TRAIN.EPOCHS"])
    with pytest.raises(ConfigError, match=r"unknown config key 'TRAIN.EPOCH' \(in --opts\); valid keys under TRAIN"):
        load_config(None, ["TRAIN.EPOCH", "3"])
    with pytest.raises(ConfigError, match="TRAIN.EPOCHS is a value"):
        load_config(None, ["TRAIN.EPOCHS.X", "3"])


def test_freeze_and_clone():
    cfg = default_config().freeze()
    with pytest.raises(ConfigError, match="frozen"):
        cfg.TRAIN.EPOCHS = 3
    clone = cfg.clone().defrost()
    clone.TRAIN.EPOCHS = 3
    assert (clone.TRAIN.EPOCHS, cfg.TRAIN.EPOCHS) == (3, 300)
    with pytest.raises(AttributeError, match="unknown config key 'TRAIN.NOPE'"):
        cfg.TRAIN.NOPE  # noqa: B018


@pytest.mark.parametrize(
    "opts, fragment",
    [
        (["TRAIN.EPOCHS", "0"], "TRAIN.EPOCHS must be a finite number > 0"),
        (["TRAIN.OPTIMIZER.NAME", "lamb"], "TRAIN.OPTIMIZER.NAME must be 'adamw' or 'sgd'"),
        (["TRAIN.LR_SCHEDULER.NAME", "linear"], "TRAIN.LR_SCHEDULER.NAME must be 'cosine' or 'step'"),
        (["TRAIN.EMA.DECAY", "1.5"], "TRAIN.EMA.DECAY must lie in"),
        (["AMP_DTYPE", "int8"], "AMP_DTYPE must be"),
    ],
)
def test_unusable_settings(opts, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_config(load_config(None, opts))


def test_unknown_model_name():
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        resolve_model_name(load_config(None, ["MODEL.NAME", "nope", "MODEL.TYPE", "nope"]))


def test_digits_demo_as_a_config():
    train_config = make_config(epochs=3, lr=1e-3, clip_grad=0.0, model_kwargs={"depth": 2})
    cfg = config_from_train_config(train_config)
    assert (cfg.MODEL.NAME, cfg.DATA.DATASET, cfg.TRAIN.EPOCHS, cfg.TRAIN.BASE_LR) == (
        "pola_deit_digits", "digits", 3, 1e-3)
    assert cfg.TRAIN.BASE_BATCH_SIZE == 0  # the demo's learning rate is absolute
    assert (cfg.TRAIN.CLIP_GRAD, cfg.AUG.MIXUP, cfg.MODEL.DROP_PATH_RATE) == (None, 0.0, 0.0)
    assert cfg.MODEL.KWARGS.to_dict() == {"depth": 2} and cfg.LAST_CHECKPOINT == "checkpoint.pth"
    check_config(cfg)


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "typo.yaml", "DATA:\n  BATCHSIZE: 8\n")
    assert main(["train", "--config", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("polaformer: error: unknown config key 'DATA.BATCHSIZE'")
    assert "BATCH_SIZE" in err
    assert main(["train", "--opts", "TRAIN.EPOCHS"]) == 2
    assert "KEY VALUE pairs" in capsys.readouterr().err
    assert main(["train", "--data", "digits", "--data-path", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
