"""The training recipes in configs/: official keys, one file per zoo model, the papers' rules.

Fast: reads the YAML files, timm's registry and the default configuration; builds no model.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import timm
import yaml
from timm.models import get_pretrained_cfg

import polaformer.models  # noqa: F401  (registers the zoo with timm)
from conftest import REPO
from polaformer.tasks.classification import default_config, load_config

ROOT = REPO
CONFIG_DIR = ROOT / "configs"
RECIPES_DOC = ROOT / "docs" / "recipes.md"
# Image-classification recipes; configs/lra/ holds the LRA recipes (tests/test_lra_train.py checks those),
# configs/dense/ the detection and segmentation ones (tests/test_dense_cli.py), configs/ablations/ the
# ablation files (tests/tasks/classification/test_ablation.py).
FILES = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name not in ("lra", "dense", "ablations"))
IDS = [str(p.relative_to(CONFIG_DIR)) for p in FILES]

# Registered names that are not models of their own: lower-case aliases of POLA_b0..b5, and the
# tiny digits demo model.
ALIASES = {f"pola_b{i}" for i in range(6)} | {"pola_deit_digits"}
GPUS = 8  # the official launch lines (pretrain.sh) and ours run 8 processes
LR_REFERENCE_BATCH = 512  # official main.py: lr = BASE_LR * global batch / 512
PAPER_LR_PER_1024 = 1e-3  # paper appendix A.2: 1e-3 for a batch of 1024, scaled linearly
PAPER_WEIGHT_DECAY = 0.05
PP_EMA_DECAY = 0.99982  # PolaFormer++ pretrain.sh: --model-ema-decay 0.99982
EMA_GROUP = ("TRAIN", "EMA")  # where the EMA settings live: TRAIN.EMA.ENABLE / TRAIN.EMA.DECAY

# Official recipes whose optimisation is a fine-tuning one (weight decay 1e-8, lr 2e-5), kept as
# the authors published them: the 384 fine-tuning of Pola-Swin-B, and PolaFormer++'s pola_b5.yaml.
FINE_TUNING = {
    "pola_swin_b_384": dict(BASE_LR=2e-5, WEIGHT_DECAY=1e-8),
    "POLA_b5": dict(BASE_LR=2e-5, WEIGHT_DECAY=1e-8),
}

# The official recipes, pinned: the official cfgs/*.yaml over the official config.py defaults.
# (batch per GPU, epochs, warm-up, cool-down, BASE_LR, WARMUP_LR, MIN_LR, weight decay, clip, drop path)
OFFICIAL = {
    "pola_swin_t": (128, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.2),
    "pola_swin_s": (128, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.3),
    "pola_swin_b": (64, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.5),
    "pola_swin_b_384": (32, 30, 5, 0, 2e-5, 2e-8, 2e-7, 1e-8, 5.0, 0.5),
    "pola_pvt_tiny": (128, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, None, 0.1),
    "pola_pvt_small": (64, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, None, 0.1),
    "pola_pvt_medium": (64, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, 1.0, 0.3),
    "pola_pvt_large": (32, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, 1.0, 0.3),
    # PolaFormer++: drop path as POLA_bN() in the official models/pola.py sets it.
    "POLA_b0": (256, 300, 20, 0, 5e-4, 5e-7, 1e-7, 0.05, 5.0, 0.1),
    "POLA_b1": (256, 300, 20, 0, 5e-4, 5e-7, 1e-7, 0.05, 5.0, 0.1),
    "POLA_b2": (256, 300, 20, 0, 5e-4, 5e-7, 1e-7, 0.05, 5.0, 0.1),
    "POLA_b3": (128, 300, 20, 0, 5e-4, 5e-7, 1e-7, 0.05, 5.0, 0.15),
    "POLA_b4": (128, 300, 5, 10, 5e-4, 1e-7, 1e-5, 0.05, 1.0, 0.4),
    "POLA_b5": (64, 300, 1, 5, 2e-5, 5e-7, 5e-6, 1e-8, None, 0.55),
}
OFFICIAL_TYPE = {
    **{n: "pola_swin" for n in ("pola_swin_t", "pola_swin_s", "pola_swin_b", "pola_swin_b_384")},
    **{n: n for n in ("pola_pvt_tiny", "pola_pvt_small", "pola_pvt_medium", "pola_pvt_large")},
    **{f"POLA_b{i}": f"polab{i}" for i in range(6)},
}
# Models without official code: drop path of the backbone's own recipe (DeiT main.py; PVTv2's
# classification/configs/pvt_v2/*.py).
BACKBONE_DROP_PATH = {
    "pola_deit_tiny_patch16_224": 0.1, "pola_deit_small_patch16_224": 0.1, "pola_deit_base_patch16_224": 0.1,
    "pola_pvt_v2_b0": 0.1, "pola_pvt_v2_b1": 0.1, "pola_pvt_v2_b2": 0.1,
    "pola_pvt_v2_b3": 0.3, "pola_pvt_v2_b4": 0.3, "pola_pvt_v2_b5": 0.3,
}


# Keys the recipes may use: keys of both official config.py files (so the official main.py accepts
# the files), plus two settings the official code takes on its command line instead (documented in
# the files that use them): PolaFormer++'s --model-ema/--model-ema-decay and Pola-PVT's
# --find-unused-params.
def _keys(*names, **groups) -> dict:
    return {**dict.fromkeys(names), **groups}


OFFICIAL_KEYS = _keys(
    "AMP", "SEED", "SAVE_FREQ", "PRINT_FREQ",
    MODEL=_keys("TYPE", "NAME", "DROP_PATH_RATE", "LABEL_SMOOTHING", "DROP_RATE", "NUM_CLASSES",
                SWIN=_keys("PATCH_SIZE", "IN_CHANS", "EMBED_DIM", "DEPTHS", "NUM_HEADS", "WINDOW_SIZE", "MLP_RATIO",
                           "QKV_BIAS", "QK_SCALE", "APE", "PATCH_NORM"),
                LA=_keys("KERNEL_SIZE", "ATTN_TYPE", "PVT_LA_SR_RATIOS")),
    DATA=_keys("BATCH_SIZE", "IMG_SIZE", "INTERPOLATION", "NUM_WORKERS", "PIN_MEMORY"),
    TRAIN=_keys("EPOCHS", "WARMUP_EPOCHS", "COOLDOWN_EPOCHS", "WEIGHT_DECAY", "BASE_LR", "WARMUP_LR", "MIN_LR",
                "CLIP_GRAD", "USE_CHECKPOINT",
                LR_SCHEDULER=_keys("NAME", "DECAY_EPOCHS", "DECAY_RATE"),
                OPTIMIZER=_keys("NAME", "EPS", "BETAS", "MOMENTUM")),
    AUG=_keys("COLOR_JITTER", "AUTO_AUGMENT", "REPROB", "REMODE", "RECOUNT", "MIXUP", "CUTMIX", "CUTMIX_MINMAX",
              "MIXUP_PROB", "MIXUP_SWITCH_PROB", "MIXUP_MODE"),
    TEST=_keys("CROP"),
)
PVT_V1 = {"pola_pvt_tiny", "pola_pvt_small", "pola_pvt_medium", "pola_pvt_large"}
POLA_PP = {f"POLA_b{i}" for i in range(6)}


def command_line_keys(name: str) -> set[tuple]:
    if name in POLA_PP:
        return {EMA_GROUP + ("ENABLE",), EMA_GROUP + ("DECAY",)}
    if name in PVT_V1:
        return {("TRAIN", "FIND_UNUSED_PARAMETERS")}
    return set()


def zoo_models() -> set[str]:
    """The image classifiers (the language, super-resolution and diffusion models, ``pola_lm_*``, ``pola_sr_*``
    and ``pola_dit_*``, have no ImageNet recipe)."""
    return (set(timm.list_models(["pola_*", "POLA_*"])) - ALIASES
            - set(timm.list_models(["pola_lm_*", "pola_sr_*", "pola_dit_*"])))


def read(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def lookup(tree: dict, *keys, default=None):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def ema_settings(cfg: dict) -> tuple[bool, float | None]:
    group = lookup(cfg, *EMA_GROUP, default={})
    return bool(group.get("ENABLE", False)), group.get("DECAY")


def global_batch(cfg: dict) -> int:
    return cfg["DATA"]["BATCH_SIZE"] * GPUS * lookup(cfg, "TRAIN", "ACCUMULATION_STEPS", default=1)


def lr_at_global_batch(cfg: dict, key: str = "BASE_LR") -> float:
    """The learning rate the run uses: the file's per-512 value scaled to the global batch."""
    return cfg["TRAIN"][key] * global_batch(cfg) / LR_REFERENCE_BATCH


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {i: read(p) for i, p in zip(IDS, FILES)}


def test_every_zoo_model_has_exactly_one_config(configs):
    names = [cfg["MODEL"]["NAME"] for cfg in configs.values()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"more than one config for {duplicates}"
    assert set(names) == zoo_models(), (
        f"models without a config: {sorted(zoo_models() - set(names))}; "
        f"configs of no zoo model: {sorted(set(names) - zoo_models())}")


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_model_name_is_a_registered_model_and_the_file_name(path):
    name = read(path)["MODEL"]["NAME"]
    assert timm.is_model(name), f"{name} is not a registered timm model"
    assert name not in ALIASES
    assert path.stem == name


# ----------------------------------------------------------------- keys: the engine's default tree

def _default_tree() -> dict:
    return default_config().to_dict()


def _compatible(value, default) -> bool:
    """yacs' merge rule: same type, None on either side, or list <-> tuple; an int is not a float."""
    if value is None or default is None:
        return True
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return True
    return type(value) is type(default)


def _check_keys(tree: dict, defaults: dict, prefix: str = "") -> list[str]:
    problems = []
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if key not in defaults:
            problems.append(f"unknown key {full} (valid here: {sorted(defaults)})")
        elif isinstance(value, dict):
            if not isinstance(defaults[key], dict):
                problems.append(f"{full} is a group here but a value ({defaults[key]!r}) in the defaults")
            else:
                problems += _check_keys(value, defaults[key], full + ".")
        elif isinstance(defaults[key], dict):
            problems.append(f"{full} is a value here but a group in the defaults")
        elif not _compatible(value, defaults[key]):
            problems.append(f"{full}: {value!r} ({type(value).__name__}) where the default is "
                            f"{defaults[key]!r} ({type(defaults[key]).__name__})")
    return problems


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_keys_and_types_match_the_default_config(path):
    problems = _check_keys(read(path), _default_tree())
    assert not problems, "\n".join(problems)


def _leaf_paths(tree: dict, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_paths(value, prefix + (key,))
        else:
            yield prefix + (key,)


def _is_official(path: tuple) -> bool:
    level = OFFICIAL_KEYS
    for key in path:
        if not isinstance(level, dict) or key not in level:
            return False
        level = level[key]
    return level is None


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_only_official_keys_besides_documented_command_line_settings(path):
    cfg = read(path)
    name = cfg["MODEL"]["NAME"]
    extra = {p for p in _leaf_paths(cfg) if not _is_official(p)}
    unexpected = sorted(".".join(p) for p in extra - command_line_keys(name))
    assert not unexpected, f"keys the official config.py lacks: {unexpected}"
    header = path.read_text().split("\n\n", 1)[0]
    for key in extra:  # the header says how to use the file with the official code
        assert ".".join(key[:2]) in header, f"the header must explain {'.'.join(key)}"
    # Pola-PVT's final norm is unused (as in the official model, trained with --find-unused-params),
    # so DDP must be told; the other models use every parameter.
    assert lookup(cfg, "TRAIN", "FIND_UNUSED_PARAMETERS", default=False) is (name in PVT_V1)


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_load_config_reads_the_file(path):
    raw = read(path)
    cfg = load_config(str(path), ["TRAIN.EPOCHS", "3"])
    assert cfg.MODEL.NAME == raw["MODEL"]["NAME"]
    assert cfg.DATA.BATCH_SIZE == raw["DATA"]["BATCH_SIZE"]
    assert math.isclose(cfg.TRAIN.BASE_LR, raw["TRAIN"]["BASE_LR"])
    assert cfg.TRAIN.EPOCHS == 3


# ----------------------------------------------------------------- the recipes

@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_recipe_invariants(path):
    cfg = read(path)
    name, train = cfg["MODEL"]["NAME"], cfg["TRAIN"]
    # AdamW, cosine with a linear warm-up from WARMUP_LR, down to MIN_LR.
    assert train["OPTIMIZER"]["NAME"] == "adamw"
    assert train["LR_SCHEDULER"]["NAME"] == "cosine"
    assert 0 < train["WARMUP_EPOCHS"] < train["EPOCHS"]
    assert train["WARMUP_LR"] < train["BASE_LR"] and train["MIN_LR"] < train["BASE_LR"]
    assert cfg["MODEL"]["LABEL_SMOOTHING"] == 0.1
    # Learning rate and weight decay: the paper's rule, except the published fine-tuning recipes.
    if name in FINE_TUNING:
        assert train["BASE_LR"] == FINE_TUNING[name]["BASE_LR"]
        assert train["WEIGHT_DECAY"] == FINE_TUNING[name]["WEIGHT_DECAY"]
    else:
        assert train["WEIGHT_DECAY"] == PAPER_WEIGHT_DECAY
        expected = PAPER_LR_PER_1024 * global_batch(cfg) / 1024
        assert math.isclose(lr_at_global_batch(cfg), expected), (
            f"{name}: lr {lr_at_global_batch(cfg):g} at global batch {global_batch(cfg)}, "
            f"paper rule gives {expected:g}")
    # EMA: PolaFormer++ trains with EMA 0.99982; the PolaFormer families have no EMA.
    enabled, decay = ema_settings(cfg)
    if name.startswith("POLA_b"):
        assert enabled and decay == PP_EMA_DECAY
    else:
        assert not enabled
    # The input pipeline matches the model's default configuration in timm.
    pretrained = get_pretrained_cfg(name)
    assert (3, cfg["DATA"]["IMG_SIZE"], cfg["DATA"]["IMG_SIZE"]) == tuple(pretrained.input_size)
    assert cfg["DATA"]["INTERPOLATION"] == pretrained.interpolation == "bicubic"
    assert cfg["TEST"]["CROP"] == (pretrained.crop_pct < 1.0)


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_official_recipes_are_reproduced(configs, name):
    cfg = next(c for c in configs.values() if c["MODEL"]["NAME"] == name)
    train = cfg["TRAIN"]
    got = (cfg["DATA"]["BATCH_SIZE"], train["EPOCHS"], train["WARMUP_EPOCHS"], train["COOLDOWN_EPOCHS"],
           train["BASE_LR"], train["WARMUP_LR"], train["MIN_LR"], train["WEIGHT_DECAY"], train["CLIP_GRAD"],
           cfg["MODEL"]["DROP_PATH_RATE"])
    assert got == OFFICIAL[name]
    assert cfg["MODEL"]["TYPE"] == OFFICIAL_TYPE[name]


@pytest.mark.parametrize("name", sorted(BACKBONE_DROP_PATH))
def test_recipes_without_official_code(configs, name):
    """Paper A.2 (1e-3 per 1024, weight decay 0.05, 20 warm-up epochs), 300 epochs, batch 1024."""
    cfg = next(c for c in configs.values() if c["MODEL"]["NAME"] == name)
    assert cfg["MODEL"]["DROP_PATH_RATE"] == BACKBONE_DROP_PATH[name]
    assert cfg["TRAIN"]["WARMUP_EPOCHS"] == 20
    assert cfg["TRAIN"]["EPOCHS"] == 300
    assert global_batch(cfg) == 1024
    assert math.isclose(lr_at_global_batch(cfg), PAPER_LR_PER_1024)


# ----------------------------------------------------------------- docs/recipes.md

def _doc_rows() -> dict[str, dict]:
    """The recipe table of docs/recipes.md, by model name."""
    rows = {}
    for line in RECIPES_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([A-Za-z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if match and len(cells) == 10:
            rows[match.group(1)] = dict(zip(
                ("config", "epochs", "batch", "lr", "warmup", "drop_path", "wd", "ema", "source"), cells[1:]))
    return rows


def test_docs_recipe_table_matches_the_configs(configs):
    rows = _doc_rows()
    assert set(rows) == {c["MODEL"]["NAME"] for c in configs.values()}
    for rel, cfg in configs.items():
        row, train = rows[cfg["MODEL"]["NAME"]], cfg["TRAIN"]
        assert row["config"] == f"[`{rel}`](../configs/{rel})"
        epochs = str(train["EPOCHS"]) + (f" + {train['COOLDOWN_EPOCHS']}" if train["COOLDOWN_EPOCHS"] else "")
        assert row["epochs"] == epochs
        assert row["batch"] == f"{global_batch(cfg)} (8 × {cfg['DATA']['BATCH_SIZE']})"
        assert math.isclose(float(row["lr"]), lr_at_global_batch(cfg))
        assert int(row["warmup"]) == train["WARMUP_EPOCHS"]
        assert float(row["drop_path"]) == cfg["MODEL"]["DROP_PATH_RATE"]
        assert float(row["wd"]) == train["WEIGHT_DECAY"]
        enabled, decay = ema_settings(cfg)
        assert row["ema"] == (str(decay) if enabled else "–")
