"""Model creation through timm's registry (ours included), from a name or from a checkpoint, and the check that a
model takes the images it will be given."""
from __future__ import annotations

import os

import timm
import torch
from torch import nn

from .. import models  # noqa: F401  (registers our architectures with timm)
from ..limits import check_model_kwargs
from .checkpoint import check_arch, load_model_state


class ModelBuildError(ValueError):
    """An unknown model name, or keyword arguments the model does not accept."""


def create_model(arch: str, num_classes: int, **model_kwargs) -> nn.Module:
    if not isinstance(arch, str) or not timm.is_model(arch):
        raise ModelBuildError(f"unknown model {arch!r} (not registered with timm)")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ModelBuildError(f"num_classes must be an integer >= 0, got {num_classes!r}")
    check_model_kwargs(arch, model_kwargs, ModelBuildError)  # before a huge model is allocated
    try:
        return timm.create_model(arch, pretrained=False, num_classes=num_classes, **model_kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        # Typically a kwarg the architecture does not take, or an inconsistent one (dim % heads).
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelBuildError(f"cannot build model {arch!r} with {model_kwargs}: {reason}") from e


def create_model_from_checkpoint(
    checkpoint: dict, path: str | os.PathLike, arch: str | None = None, *, allow_nonfinite: bool = False
) -> nn.Module:
    """Rebuild the checkpoint's model and load its weights.

    ``arch``, if given, is the architecture the caller expects; a checkpoint of another one is
    refused before anything is built.
    """
    if arch is not None:
        check_arch(checkpoint, arch, path)
    arch = checkpoint["arch"]
    model = create_model(arch, checkpoint["num_classes"], **checkpoint["model_kwargs"])
    load_model_state(model, checkpoint, arch=arch, path=path, allow_nonfinite=allow_nonfinite)
    return model


def check_forward(model: nn.Module, input_size: tuple[int, int, int], arch: str,
                  error: type[Exception] = ModelBuildError) -> None:
    """Run ``model`` on one blank image of ``input_size`` in eval mode (no dropout drawn, no statistics updated;
    its mode is restored): a size the model cannot take (not divisible by its patches or windows, or other than
    its fixed size) fails here in one line, not at the first batch."""
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_size))
    except (RuntimeError, AssertionError, ValueError, IndexError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise error(f"model {arch!r} cannot take {input_size[1]}x{input_size[2]} images: {reason}") from None
    finally:
        model.train(training)
