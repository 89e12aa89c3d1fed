"""Training configuration, and the per-model defaults for the embedded digits data set."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..data import DEFAULT_DATA

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
