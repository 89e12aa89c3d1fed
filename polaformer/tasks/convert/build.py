"""The teacher (a softmax model with its trained weights) and its converted Pola student, and the file that holds a
converted model."""
from __future__ import annotations

import os
import re
from pathlib import Path

import timm
import torch
from timm.models import get_pretrained_cfg
from torch import nn

from ... import models  # noqa: F401  (registers the pola_* names)
from ...checkpoint import atomic_write, load_checkpoint
from .weights import POLA_ATTENTION, TARGETS, ConversionError, ConversionReport, convert_state_dict, family_of

__all__ = ["build_source", "convert_model", "save_converted", "target_of"]


def _create(name: str, kwargs: dict, what: str, pretrained: bool = False) -> nn.Module:
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except (RuntimeError, ValueError, TypeError) as e:  # unknown name, a size the model refuses, no such weights
        raise ConversionError(f"cannot build the {what} {name!r}: {str(e).splitlines()[0]}") from None
    except OSError as e:  # huggingface_hub's: offline without the file in the cache, no connection
        raise ConversionError(f"cannot fetch timm's pretrained weights of {name!r} ({type(e).__name__}): set "
                              "HF_HUB_OFFLINE=1 with them in the local cache (HF_HOME, HF_HUB_CACHE), or give the "
                              "weights file") from None


def build_source(name: str, kwargs: dict | None = None, weights: str | os.PathLike | None = None, *,
                 pretrained: bool = False) -> nn.Module:
    """The softmax model ``name`` (timm's, or ours with ``attention='softmax'``) with the trained ``weights``
    (any file :func:`~polaformer.checkpoint.load_checkpoint` reads; they must fit exactly) or, with
    ``pretrained``, timm's own weights of that name (fetched through huggingface_hub: its cache and
    ``HF_HUB_OFFLINE`` apply), in eval mode."""
    if pretrained and weights:
        raise ConversionError(f"give the weights file {weights} or pretrained, not both")
    if pretrained:
        cfg = get_pretrained_cfg(name)
        if not (cfg and (cfg.hf_hub_id or cfg.url or cfg.file)):  # timm would warn and start from random weights
            raise ConversionError(f"timm has no pretrained weights of {name!r}: give its trained weights file")
    model = _create(name, dict(kwargs or {}), "source model", pretrained)
    family_of(model)
    if weights:
        load_checkpoint(model, weights, strict=True)
    return model.eval()


def target_of(source: nn.Module, name: str, kwargs: dict | None, target: str = "",
              target_kwargs: dict | None = None) -> tuple[str, dict]:
    """The Pola counterpart of the source model ``name`` built with ``kwargs``: ``target`` or the pair's default
    (:data:`TARGETS`; ours: the same name), and ``target_kwargs`` over the source's arguments the target shares.
    A source whose q/k/v projections have no bias gets a target with biases (``qkv_bias``): its gate needs one."""
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
    if family.bias_kwarg and _lacks_projection_bias(source):
        base = _with(base, family.bias_kwarg, True)  # the gate's bias; q, k, v get zero biases: the same map
    return target, _merged(base, dict(target_kwargs or {}))


def _lacks_projection_bias(model: nn.Module) -> bool:
    """Whether some attention's q/k/v projection of ``model`` has no bias."""
    return any(isinstance(m, nn.Linear) and m.bias is None and re.search(r"\.attn\.(qkv|q|kv)$", name)
               for name, m in model.named_modules())


def _with(kwargs: dict, dotted: str, value) -> dict:
    """``kwargs`` with the (nested, ``a.b``) key ``dotted`` set to ``value``."""
    head, _, rest = dotted.partition(".")
    return {**kwargs, head: _with(dict(kwargs.get(head) or {}), rest, value) if rest else value}


def _merged(base: dict, given: dict) -> dict:
    """``given`` over ``base``, nested dictionaries (``attention_kwargs``) merged key by key."""
    out = dict(base)
    for key, value in given.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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
