"""Training and evaluation: the loop, model creation through timm, checkpoints."""
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
from .config import DEFAULT_MODEL, DIGITS_PRESETS, TrainConfig, make_config
from .factory import ModelBuildError, create_model, create_model_from_checkpoint
from .train import evaluate, evaluate_checkpoint, fit, run_training, train_one_epoch

__all__ = [
    "ArchitectureMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DEFAULT_MODEL",
    "DIGITS_PRESETS",
    "ModelBuildError",
    "TrainConfig",
    "atomic_write",
    "create_model",
    "create_model_from_checkpoint",
    "evaluate",
    "evaluate_checkpoint",
    "fit",
    "load_checkpoint",
    "load_model_state",
    "make_config",
    "run_training",
    "save_checkpoint",
    "train_one_epoch",
]
