"""Training and evaluation: configuration, the one loop under every task, devices, model creation, checkpoints.

The names below are imported from their modules on first use, so that importing one light module of the engine
(``polaformer.engine.config`` and ``polaformer.engine.options``, which the command line's parser reads) does not
import torch.
"""
import importlib

_SOURCES = {
    "ArchitectureMismatchError": "checkpoint", "CheckpointError": "checkpoint", "CheckpointNotFoundError": "checkpoint",
    "CorruptCheckpointError": "checkpoint", "load_model_state": "checkpoint", "read_run_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "Config": "config", "ConfigError": "config", "configure": "config",
    "ModelBuildError": "factory", "create_model": "factory", "create_model_from_checkpoint": "factory",
    "build_optimizer": "optim", "build_scheduler": "optim",
    "amp_dtype": "device", "autocast": "device", "resolve_device": "device",
    "Engine": "loop", "LoopSettings": "task", "StepOutput": "task", "Task": "task", "TrainingDivergedError": "loop",
    "TrainingInterrupted": "loop", "train": "loop",
    "StepTask": "steps", "load_task_model": "steps", "step_settings": "steps",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
