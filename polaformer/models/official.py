"""Builders of our modules from the official code's class names and constructor arguments.

Each family file registers its whole-model builder next to the model it builds (``@register_official``);
:mod:`polaformer.compat` adds the layer-level ones and looks records up.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["OFFICIAL_BUILDERS", "Builder", "register_official"]

Builder = Callable[[dict[str, Any]], nn.Module]

# (family, official class name) -> builder(constructor kwargs) -> module
OFFICIAL_BUILDERS: dict[tuple[str, str], Builder] = {}


def register_official(family: str, official_class: str) -> Callable[[Builder], Builder]:
    """Decorator: ``builder(constructor_kwargs) -> module`` for an official class."""

    def decorate(builder: Builder) -> Builder:
        OFFICIAL_BUILDERS[(family, official_class)] = builder
        return builder

    return decorate
