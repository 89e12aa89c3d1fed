"""The classification task's configuration: the official key tree (YAML files, ``--opts``), and the digits demo's.

:func:`default_config` holds every key of the official PolaFormer / PolaFormer++ ``config.py``
(Swin-Transformer style: ``MODEL``, ``DATA``, ``TRAIN``, ``AUG``, ``TEST`` and a few top-level
keys), a few keys of Swin-Transformer's newer config that recipes use, every engine option
(:mod:`polaformer.engine.options`) at its official key (``DATA.BATCH_SIZE``, ``TRAIN.BASE_LR``,
``TRAIN.USE_CHECKPOINT``, ``TRAIN.EMA.ENABLE/DECAY``...) or, where the official code has none, at
``TRAIN.<NAME>`` / its declared key (``TRAIN.PARALLEL``, ``TRAIN.COMPILE``, ``TRAIN.SAVE_FREQ_STEPS``,
``AMP_DTYPE``...), and the engine's own:

==============================  ==============================================================
``MODEL.KWARGS``                extra keyword arguments for ``timm.create_model`` (any keys)
``MODEL.PRETRAINED``            weights to fine-tune from (Swin's key; ``--finetune FILE``)
``TRAIN.ACCUMULATION_STEPS``    gradient accumulation (Swin's key); the global batch counts it
``TRAIN.BASE_BATCH_SIZE``       BASE_LR/WARMUP_LR/MIN_LR are per this global batch (official:
                                512); 0 uses them as given
``DEVICE``                      ``auto`` (CUDA when available), ``cpu``, ``cuda``, ...
``TEST.BATCH_SIZE``             evaluation batch size (0: ``DATA.BATCH_SIZE``, as official)
``AUG.DIGITS_SHIFT``            the digits data set's random ±1 pixel shifts
``LAST_CHECKPOINT``             file name of the latest checkpoint in the output folder
``OVERWRITE``                   start afresh in an output folder that holds a run (``--overwrite``)
``ALLOW_CHANGED``               settings a resumed run may change from the checkpoint's (``--allow-changed``)
==============================  ==============================================================

Files are merged as the official ``_update_config_from_file`` does (``BASE:`` files first,
relative to the including file), values are decoded and type-checked as yacs does (``5e-4``,
which YAML reads as a string, becomes a float; ``None`` clears a value), and unknown keys are an
error naming the valid keys at that level. yacs itself is not needed.

The digits demo keeps its flat :class:`TrainConfig` (``polaformer train`` without ``--config``);
:func:`config_from_train_config` turns it into a :class:`Config` for the one training engine.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from ...data import DEFAULT_DATA
from ...engine.config import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    Config,
    ConfigError,
    check_settings,
    configure,
    unit,
)
from ...engine.options import CLASSIFICATION, add_official, check_options, keyed_values

# The model `polaformer train` uses when none is named.
DEFAULT_MODEL = "pola_deit_digits"

# Per-model settings for digits, applied over TrainConfig's defaults (and under explicit
# overrides): the model kwargs that shrink an architecture to 8x8 one-channel images, and any
# training hyper-parameters tuned for it.
DIGITS_PRESETS: dict[str, dict] = {
    # timm's plain ViT, shrunk. Patches of 2x2 pixels: with 1x1 patches it must learn all 64
    # positions from scratch and reaches only ~60% in the same time. Average pooling, QK-norm and
    # LayerScale make this small one train faster.
    "vit_tiny_patch16_224": {
        "model_kwargs": {
            "patch_size": 2, "embed_dim": 64, "depth": 4, "num_heads": 2,
            "global_pool": "avg", "class_token": False, "qk_norm": True, "init_values": 0.1,
        },
    },
}

# Evaluation batch of the digits demo: `polaformer eval` batches the test set the same way, so that
# it reproduces training's final top-1 exactly (other batch sizes may round a near-tie differently).
DIGITS_EVAL_BATCH_SIZE = 256


# --- the official key tree -------------------------------------------------------------------

def _official_defaults() -> dict:
    """The official config.py tree (PolaFormer, with PolaFormer++'s key), then our additions (the engine options
    the official code lacks come from their declarations: :func:`default_config`)."""
    return {
        "BASE": [""],
        "DATA": {
            "BATCH_SIZE": 128,  # per GPU
            "DATA_PATH": "",
            "DATASET": "imagenet",  # an ImageNet-layout folder; 'digits' is the embedded demo set
            "IMG_SIZE": 224,
            "INTERPOLATION": "bicubic",
            "ZIP_MODE": False,  # accepted, not used: image folders only
            "CACHE_MODE": "part",  # accepted, not used
            "PIN_MEMORY": True,
            "NUM_WORKERS": 8,
        },
        "MODEL": {
            "TYPE": "swin",
            "NAME": "swin_tiny_patch4_window7_224",  # a timm name, or an official one (OFFICIAL_MODEL_NAMES)
            "RESUME": "",
            "PRETRAINED": "",
            "LORA": 0,  # with PRETRAINED: LoRA adapters of this rank (--lora), merged into merged.pth at the end
            "NUM_CLASSES": 1000,  # set from the data
            "DROP_RATE": 0.0,
            "DROP_PATH_RATE": 0.1,
            "LABEL_SMOOTHING": 0.1,
            # Architecture keys of the official models: accepted so that official files load; the
            # architecture is the registered timm model MODEL.NAME (change it with MODEL.KWARGS).
            "SWIN": {
                "PATCH_SIZE": 4, "IN_CHANS": 3, "EMBED_DIM": 96, "DEPTHS": [2, 2, 6, 2],
                "NUM_HEADS": [3, 6, 12, 24], "WINDOW_SIZE": 7, "MLP_RATIO": 4.0, "QKV_BIAS": True,
                "QK_SCALE": None, "KA": [7, 7, 7, 7], "DIM_REDUCTION": [4, 4, 4, 4],
                "STAGES": [True, True, True, True], "STAGES_NUM": [-1, -1, -1, -1], "RPB": True,
                "PADDING_MODE": "zeros", "SHARE_DWC_KERNEL": True, "SHARE_QKV": False, "APE": False,
                "PATCH_NORM": True, "LR_FACTOR": 2, "DEPTHS_LR": [2, 2, 2, 2], "FUSION_TYPE": "add",
                "STAGE_CFG": None,
            },
            "SWIN_HR": Config(new_allowed=True, path="MODEL.SWIN_HR"),
            "SWIN_LRVIT": Config(new_allowed=True, path="MODEL.SWIN_LRVIT"),
            "PVD": Config(new_allowed=True, path="MODEL.PVD"),
            "LA": {
                "ALPHA": 4,  # PolaFormer
                "FOCUSING_FACTOR": 3,  # PolaFormer++
                "KERNEL_SIZE": 5,
                "ATTN_TYPE": "LLLL",
                "PVT_LA_SR_RATIOS": 1111,
                "CSWIN_LA_SPLIT_SIZE": "56-28-14-7",
            },
            "KWARGS": Config(new_allowed=True, path="MODEL.KWARGS"),
        },
        "TRAIN": {
            "START_EPOCH": 0,
            "EPOCHS": 300,
            "WARMUP_EPOCHS": 20,
            "COOLDOWN_EPOCHS": 0,
            "WEIGHT_DECAY": 0.05,
            "BASE_LR": 5e-4,
            "WARMUP_LR": 5e-7,
            "MIN_LR": 5e-6,
            "CLIP_GRAD": 5.0,
            # Official default True; here --resume auto (or this key) turns it on, so that a plain
            # rerun into the same folder starts afresh as the digits demo always did.
            "AUTO_RESUME": False,
            "USE_CHECKPOINT": False,
            "ACCUMULATION_STEPS": 1,
            "BASE_BATCH_SIZE": 512,
            "LR_SCHEDULER": {"NAME": "cosine", "DECAY_EPOCHS": 30, "DECAY_RATE": 0.1},
            "OPTIMIZER": {"NAME": "adamw", "EPS": 1e-8, "BETAS": (0.9, 0.999), "MOMENTUM": 0.9},
            "EMA": {"ENABLE": False, "DECAY": 0.9999},  # official main_ema.py's --model-ema-decay default
        },
        "AUG": {
            "COLOR_JITTER": 0.4,
            "AUTO_AUGMENT": "rand-m9-mstd0.5-inc1",
            "REPROB": 0.25,
            "REMODE": "pixel",
            "RECOUNT": 1,
            "MIXUP": 0.8,
            "CUTMIX": 1.0,
            "CUTMIX_MINMAX": None,
            "MIXUP_PROB": 1.0,
            "MIXUP_SWITCH_PROB": 0.5,
            "MIXUP_MODE": "batch",
            "DIGITS_SHIFT": True,
        },
        "TEST": {"CROP": True, "SEQUENTIAL": False, "BATCH_SIZE": 0},
        "AMP": False,
        "OUTPUT": "",
        "TAG": "default",
        "SAVE_FREQ": 1,  # epochs between checkpoints (the last epoch is always saved)
        "PRINT_FREQ": 100,  # iterations between log lines
        "SEED": 0,
        "EVAL_MODE": False,  # accepted, not used: see `polaformer eval`
        "THROUGHPUT_MODE": False,  # accepted, not used: see `polaformer throughput`
        "LOCAL_RANK": 0,  # accepted, not used: torchrun's environment variables are read
        "DEVICE": "auto",
        "LAST_CHECKPOINT": "last.pth",
        "OVERWRITE": False,  # replace a finished run in OUTPUT (--overwrite) instead of refusing
        "ALLOW_CHANGED": [],  # settings a resumed run may change from its checkpoint's (--allow-changed)
    }


def default_config() -> Config:
    """A fresh tree with every key at its default: the official tree, with every engine option it lacks."""
    return Config(add_official(_official_defaults()))


def load_config(path: str | os.PathLike | None = None, opts: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (with its ``BASE:`` files), then ``opts``.

    ``opts`` is a flat ``['TRAIN.EPOCHS', '10', 'MODEL.KWARGS.depth', '2', ...]`` list; each value
    is read as YAML. Raises :class:`ConfigError` for unknown keys, wrong types, a missing or
    unreadable file.
    """
    return configure(default_config(), path, opts)


# --- model names -----------------------------------------------------------------------------

# MODEL.NAME / MODEL.TYPE values of the official cfgs -> our timm names.
OFFICIAL_MODEL_NAMES = {
    "pola_swin_tiny_patch4_224": "pola_swin_t",
    "pola_swin_small_patch4_224": "pola_swin_s",
    "pola_swin_base_patch4_224": "pola_swin_b",
    "pola_swin_base_patch4_384": "pola_swin_b_384",
    "pola_swin_base_patch4_384_finetune": "pola_swin_b_384",
    **{f"pola_b{i}_patch4_224": f"POLA_b{i}" for i in range(6)},
    **{f"polab{i}": f"POLA_b{i}" for i in range(6)},
}


def resolve_model_name(cfg: Config) -> str:
    """The timm model for ``MODEL.NAME`` (or, failing that, ``MODEL.TYPE``), official names included."""
    import timm

    from ... import models  # noqa: F401  (registers our architectures)

    for name in (cfg.MODEL.NAME, cfg.MODEL.TYPE):
        if timm.is_model(name):
            return name
        if name in OFFICIAL_MODEL_NAMES:
            return OFFICIAL_MODEL_NAMES[name]
    raise ConfigError(
        f"unknown model {cfg.MODEL.NAME!r}: neither MODEL.NAME nor MODEL.TYPE ({cfg.MODEL.TYPE!r}) is a timm model "
        f"or an official model name (ours: {', '.join(timm.list_models('pola_*'))})"
    )


# --- checks ----------------------------------------------------------------------------------

# The range of every numeric setting besides the engine options, whose declarations give theirs (engine/config.py
# checks them, naming the key).
RULES = {
    "TRAIN.COOLDOWN_EPOCHS": NON_NEGATIVE, "TRAIN.BASE_BATCH_SIZE": COUNT.but(note="0: lrs as given"),
    "TRAIN.WARMUP_LR": NON_NEGATIVE, "TRAIN.MIN_LR": NON_NEGATIVE,
    "TRAIN.OPTIMIZER.EPS": POSITIVE, "TRAIN.OPTIMIZER.BETAS": unit(), "TRAIN.OPTIMIZER.MOMENTUM": unit(),
    "TRAIN.LR_SCHEDULER.DECAY_EPOCHS": POSITIVE, "TRAIN.LR_SCHEDULER.DECAY_RATE": POSITIVE,
    "DATA.IMG_SIZE": POSITIVE_INT, "TEST.BATCH_SIZE": COUNT.but(note="0: DATA.BATCH_SIZE"),
    "MODEL.LABEL_SMOOTHING": unit(), "MODEL.DROP_RATE": unit(), "MODEL.DROP_PATH_RATE": unit(),
    "MODEL.LORA": COUNT.but(note="0: every weight learns"),
    "AUG.MIXUP": NON_NEGATIVE, "AUG.CUTMIX": NON_NEGATIVE, "AUG.MIXUP_PROB": unit(high_open=False),
    "AUG.MIXUP_SWITCH_PROB": unit(high_open=False), "AUG.REPROB": unit(high_open=False),
}


def check_config(cfg: Config) -> None:
    """Reject settings the engine cannot run with, one line each: every key of :data:`RULES` and every engine option
    in its range, the names it knows."""
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check_settings(cfg, RULES)
    check_options(cfg, CLASSIFICATION)
    train = cfg.TRAIN
    require(train.OPTIMIZER.NAME.lower() in ("adamw", "sgd"),
            f"TRAIN.OPTIMIZER.NAME must be 'adamw' or 'sgd', got {train.OPTIMIZER.NAME!r}")
    require(train.LR_SCHEDULER.NAME.lower() in ("cosine", "step"),
            f"TRAIN.LR_SCHEDULER.NAME must be 'cosine' or 'step', got {train.LR_SCHEDULER.NAME!r}")
    require(bool(cfg.LAST_CHECKPOINT) and "/" not in cfg.LAST_CHECKPOINT,
            f"LAST_CHECKPOINT must be a file name, got {cfg.LAST_CHECKPOINT!r}")
    require("num_classes" not in cfg.MODEL.KWARGS,
            f"MODEL.KWARGS.num_classes: the number of classes comes from the data (MODEL.NUM_CLASSES), not from "
            f"the model's keyword arguments; got {cfg.MODEL.KWARGS.get('num_classes')!r}")
    require(not cfg.MODEL.LORA or bool(cfg.MODEL.PRETRAINED),
            f"MODEL.LORA {cfg.MODEL.LORA} (--lora) adapts weights it starts from: give MODEL.PRETRAINED "
            "(--finetune FILE)")
    require(isinstance(cfg.ALLOW_CHANGED, list) and all(isinstance(key, str) for key in cfg.ALLOW_CHANGED),
            f"ALLOW_CHANGED must be a list of setting names, got {cfg.ALLOW_CHANGED!r}")


# --- the digits demo ---------------------------------------------------------------------------

@dataclass
class TrainConfig:
    model: str = DEFAULT_MODEL
    model_kwargs: dict = field(default_factory=dict)  # on top of num_classes/in_chans/img_size
    data: str = DEFAULT_DATA
    augment: bool = True
    epochs: int = 60
    batch_size: int = 32
    lr: float = 2e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: int = 2
    label_smoothing: float = 0.1
    clip_grad: float | None = 1.0  # max gradient norm; None disables clipping
    seed: int = 0
    output: str = "runs/digits"
    device: str = "auto"  # "auto" picks CUDA when available
    num_workers: int = 0  # digits lives in memory: worker processes would only add start-up time

    def to_dict(self) -> dict:
        return asdict(self)


def make_config(model: str = DEFAULT_MODEL, data: str = DEFAULT_DATA, **overrides) -> TrainConfig:
    """TrainConfig for ``model`` on ``data``: defaults, then the model's preset, then ``overrides``.

    ``overrides`` set to None are ignored (unset command-line options); ``model_kwargs`` in
    overrides are merged key by key into the preset's instead of replacing them.
    """
    preset = dict(DIGITS_PRESETS.get(model, {})) if data == "digits" else {}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    model_kwargs = {**preset.pop("model_kwargs", {}), **overrides.pop("model_kwargs", {})}
    base = TrainConfig(model=model, data=data, model_kwargs=model_kwargs)
    return replace(base, **{**preset, **overrides})


# The engine options the digits demo's TrainConfig holds, by its field names.
_DIGITS_FIELDS = {"epochs": "epochs", "batch_size": "batch_size", "lr": "lr", "weight_decay": "weight_decay",
                  "warmup_epochs": "warmup_epochs", "clip_grad_norm": "clip_grad", "seed": "seed",
                  "num_workers": "num_workers"}


def digits_config(model: str, data: str, options: dict, **overrides) -> tuple[TrainConfig, list]:
    """The digits demo's :class:`TrainConfig` (:func:`make_config` with ``overrides``) holding the engine options
    ``options`` (``{name: value}``) it has fields for, and the others as ``KEY VALUE`` overrides of its official
    tree."""
    fields = {_DIGITS_FIELDS[name]: value for name, value in options.items() if name in _DIGITS_FIELDS}
    others = {name: value for name, value in options.items() if name not in _DIGITS_FIELDS}
    config = make_config(model, data, **overrides, **fields)
    return config, [item for pair in keyed_values(CLASSIFICATION, others) for item in pair]


def config_from_train_config(config: TrainConfig) -> Config:
    """The digits demo's settings as a full :class:`Config`: no Mixup, no drop path, absolute lrs.

    The learning rate is not scaled with the batch (``TRAIN.BASE_BATCH_SIZE`` 0), warm-up starts
    at ``min_lr``, and the last checkpoint keeps the demo's name, ``checkpoint.pth``.
    """
    from ...data import get_data_spec

    spec = get_data_spec(config.data)
    cfg = default_config()
    cfg.merge({
        "MODEL": {
            "NAME": config.model, "TYPE": config.model, "KWARGS": dict(config.model_kwargs),
            "DROP_RATE": 0.0, "DROP_PATH_RATE": 0.0, "LABEL_SMOOTHING": config.label_smoothing,
        },
        "DATA": {"DATASET": config.data, "BATCH_SIZE": config.batch_size, "IMG_SIZE": spec.img_size,
                 "NUM_WORKERS": config.num_workers},
        "TRAIN": {
            "EPOCHS": config.epochs, "WARMUP_EPOCHS": config.warmup_epochs, "COOLDOWN_EPOCHS": 0,
            "BASE_LR": config.lr, "WARMUP_LR": config.min_lr, "MIN_LR": config.min_lr,
            "WEIGHT_DECAY": config.weight_decay, "CLIP_GRAD": config.clip_grad or None, "BASE_BATCH_SIZE": 0,
        },
        "AUG": {"MIXUP": 0.0, "CUTMIX": 0.0, "DIGITS_SHIFT": config.augment},
        "TEST": {"BATCH_SIZE": DIGITS_EVAL_BATCH_SIZE},
        "SEED": config.seed,
        "OUTPUT": config.output,
        "DEVICE": config.device,
        "LAST_CHECKPOINT": "checkpoint.pth",
    })
    return cfg
