"""The teacher (a softmax model with its trained weights) and its converted Pola student, and the file that holds a
converted model."""
from __future__ import annotations

import os
from pathlib import Path

import timm
import torch
from torch import nn

from ... import models  # noqa: F401  (registers the pola_* names)
from ...checkpoint import atomic_write, load_checkpoint
from .weights import POLA_ATTENTION, TARGETS, ConversionError, ConversionReport, convert_state_dict, family_of

__all__ = ["build_source", "convert_model", "save_converted", "target_of"]


def _create(name: str, kwargs: dict, what: str) -> nn.Module:
    try:
        return timm.create_model(name, **kwargs)
    except (RuntimeError, ValueError, TypeError) as e:  # unknown name, a size the model refuses
        raise ConversionError(f"cannot build the {what} {name!r}: {str(e).splitlines()[0]}") from None


def build_source(name: str, kwargs: dict | None = None, weights: str | os.PathLike | None = None) -> nn.Module:
    """The softmax model ``name`` (timm's, or ours with ``attention='softmax'``) with the trained ``weights``
    (any file :func:`~polaformer.checkpoint.load_checkpoint` reads; they must fit exactly), in eval mode."""
    model = _create(name, dict(kwargs or {}), "source model")
    family_of(model)
    if weights:
        load_checkpoint(model, weights, strict=True)
    return model.eval()


def target_of(source: nn.Module, name: str, kwargs: dict | None, target: str = "",
              target_kwargs: dict | None = None) -> tuple[str, dict]:
    """The Pola counterpart of the source model ``name`` built with ``kwargs``: ``target`` or the pair's default
    (:data:`TARGETS`; ours: the same name), and ``target_kwargs`` over the source's arguments the target shares."""
    family = family_of(source)
    kwargs = dict(kwargs or {})
    if family.name in POLA_ATTENTION:
        base = {**kwargs, "attention": POLA_ATTENTION[family.name]}
        target = target or name
    else:
        base = {key: value for key, value in kwargs.items() if key in family.shared_kwargs}
        target = target or TARGETS.get(name, "")
        if not target:
            raise ConversionError(f"no default Pola counterpart of {name!r}: name the target model")
    return target, {**base, **dict(target_kwargs or {})}


def convert_model(source: nn.Module, target: str, target_kwargs: dict) -> tuple[nn.Module, ConversionReport]:
    """The Pola model ``target`` holding every weight of ``source`` that has a counterpart (see
    :func:`~.weights.convert_state_dict`), and the report."""
    student = _create(target, target_kwargs, "target model")
    state, report = convert_state_dict(source, student)
    student.load_state_dict(state, strict=True)
    return student, report


def save_converted(model: nn.Module, report: ConversionReport, target: str, target_kwargs: dict,
                   path: str | os.PathLike) -> Path:
    """Write the converted weights (``'model'``, which the plain Pola class loads strictly), the target's name and
    arguments and the report, atomically."""
    state = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
    blob = {"model": state, "target": {"name": target, "kwargs": dict(target_kwargs)}, "conversion": report.to_dict()}
    return atomic_write(path, lambda f: torch.save(blob, f))
