"""Model creation through timm's registry (ours included), from a name or from a checkpoint."""
from __future__ import annotations

import os

import timm
from torch import nn

from .. import models  # noqa: F401  (registers our architectures with timm)
from .checkpoint import check_arch, load_model_state


class ModelBuildError(ValueError):
    """An unknown model name, or keyword arguments the model does not accept."""


def create_model(arch: str, num_classes: int, **model_kwargs) -> nn.Module:
    if not timm.is_model(arch):
        raise ModelBuildError(f"unknown model {arch!r} (not registered with timm)")
    try:
        return timm.create_model(arch, pretrained=False, num_classes=num_classes, **model_kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        # Typically a kwarg the architecture does not take, or an inconsistent one (dim % heads).
        raise ModelBuildError(f"cannot build model {arch!r} with {model_kwargs}: {e}") from e


def create_model_from_checkpoint(
    checkpoint: dict, path: str | os.PathLike, arch: str | None = None
) -> nn.Module:
    """Rebuild the checkpoint's model and load its weights.

    ``arch``, if given, is the architecture the caller expects; a checkpoint of another one is
    refused before anything is built.
    """
    if arch is not None:
        check_arch(checkpoint, arch, path)
    arch = checkpoint["arch"]
    model = create_model(arch, checkpoint["num_classes"], **checkpoint["model_kwargs"])
    load_model_state(model, checkpoint, arch=arch, path=path)
    return model
