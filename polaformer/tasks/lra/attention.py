"""The token mixers of the Long Range Arena model, by name.

:data:`ATTENTIONS` is the ``"encoder"`` kind of :data:`polaformer.layers.registry.SEQUENCE_ATTENTIONS`, the
one table of the sequence models' attentions. Every entry builds an ``nn.Module`` with::

    __init__(dim, num_heads, head_dim, *, max_seq_len, dropout=0.0, **options)
    forward(x, key_padding_mask=None) -> Tensor

the interface of the baseline token mixers in
:mod:`polaformer.layers.baseline_attention`, which document their equations,
upstream sources and padding behaviour. ``pola`` and ``pacs`` wrap the sequence
layers of :mod:`polaformer.layers` (:class:`SequenceLayerAdapter`).

Use :func:`build_attention` to construct one by name; :func:`attention_options`
lists the options an entry takes with their defaults.
"""
from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

from ...layers.registry import SequenceLayerAdapter, build_pacs, build_pola, sequence_attentions

__all__ = ["ATTENTIONS", "build_attention", "attention_options", "build_pola", "build_pacs", "SequenceLayerAdapter"]

ATTENTIONS: dict[str, Callable[..., nn.Module]] = sequence_attentions("encoder")

_COMMON = {"max_seq_len", "dropout"}


def attention_options(name: str) -> dict[str, object]:
    """The options of one entry with their defaults (None for pola/pacs: the layer's default)."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; known: {', '.join(ATTENTIONS)}")
    params = inspect.signature(ATTENTIONS[name]).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _COMMON}


def build_attention(name: str, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int,
                    dropout: float = 0.0, **options) -> nn.Module:
    """Build the token mixer ``name`` (a key of :data:`ATTENTIONS`).

    Raises ``ValueError`` for an unknown name or an option the entry does not take.
    """
    known = attention_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for attention {name!r}; its options: {takes}")
    return ATTENTIONS[name](dim, num_heads, head_dim, max_seq_len=max_seq_len, dropout=dropout, **options)
