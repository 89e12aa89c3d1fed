"""Training and evaluation: configuration, the one loop under every task, devices, model creation, checkpoints."""
from .checkpoint import (
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    load_model_state,
    read_run_checkpoint,
    save_checkpoint,
)
from .config import Config, ConfigError, configure
from .factory import ModelBuildError, create_model, create_model_from_checkpoint
from .optim import build_optimizer, build_scheduler
from .device import amp_dtype, autocast, resolve_device
from .loop import Engine, LoopSettings, StepOutput, Task, TrainingDivergedError, TrainingInterrupted, train
from .steps import StepTask, load_task_model, step_settings

__all__ = [
    "ArchitectureMismatchError",
    "Engine",
    "LoopSettings",
    "StepOutput",
    "StepTask",
    "Task",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Config",
    "ConfigError",
    "configure",
    "CorruptCheckpointError",
    "ModelBuildError",
    "TrainingDivergedError",
    "TrainingInterrupted",
    "amp_dtype",
    "autocast",
    "build_optimizer",
    "build_scheduler",
    "create_model",
    "create_model_from_checkpoint",
    "load_model_state",
    "load_task_model",
    "read_run_checkpoint",
    "resolve_device",
    "save_checkpoint",
    "step_settings",
    "train",
]
