"""Image classification: the official key tree and the digits demo (:mod:`.config`), the training task over
the engine (:mod:`.train`), and evaluation and throughput (:mod:`.evaluation`)."""
from .config import (
    DEFAULT_MODEL,
    DIGITS_PRESETS,
    TrainConfig,
    config_from_train_config,
    default_config,
    load_config,
    make_config,
)
from .train import ClassificationTask, TrainData, build_trainer, evaluate, evaluate_checkpoint, run_training

__all__ = [
    "ClassificationTask",
    "DEFAULT_MODEL",
    "DIGITS_PRESETS",
    "TrainConfig",
    "TrainData",
    "build_trainer",
    "config_from_train_config",
    "default_config",
    "evaluate",
    "evaluate_checkpoint",
    "load_config",
    "make_config",
    "run_training",
]
