"""Training and evaluation: configuration, the loop, model creation through timm, checkpoints."""
from .checkpoint import (
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    atomic_write,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from .config import (
    DEFAULT_MODEL,
    DIGITS_PRESETS,
    Config,
    ConfigError,
    TrainConfig,
    config_from_train_config,
    default_config,
    load_config,
    make_config,
)
from .factory import ModelBuildError, create_model, create_model_from_checkpoint
from .optim import build_optimizer, build_scheduler
from .train import TrainData, Trainer, evaluate, evaluate_checkpoint, run_training, train_one_epoch

__all__ = [
    "ArchitectureMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "DEFAULT_MODEL",
    "DIGITS_PRESETS",
    "ModelBuildError",
    "TrainConfig",
    "TrainData",
    "Trainer",
    "atomic_write",
    "build_optimizer",
    "build_scheduler",
    "config_from_train_config",
    "create_model",
    "create_model_from_checkpoint",
    "default_config",
    "evaluate",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_model_state",
    "make_config",
    "run_training",
    "save_checkpoint",
    "train_one_epoch",
]
