"""The token mixers of the Long Range Arena model, by name.

Every entry of :data:`ATTENTIONS` builds an ``nn.Module`` with::

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

import torch
from torch import nn

from ...layers import (
    CosformerAttention,
    FocusedLinearAttention,
    KernelizedAttention,
    LinearAttention,
    LinformerAttention,
    NystromAttention,
    PacsSequenceAttention,
    PerformerAttention,
    PolaSequenceAttention,
    SkyformerAttention,
    SoftmaxAttention,
)
from ...layers.baseline_attention import check_mixer_inputs, check_mixer_sizes

__all__ = ["ATTENTIONS", "build_attention", "attention_options", "build_pola", "build_pacs", "SequenceLayerAdapter"]


# ----------------------------------------------------------------------------- PolaFormer / PolaFormer++


class SequenceLayerAdapter(nn.Module):
    """Gives a Pola/PaCS sequence layer this module's interface.

    Those layers take ``forward(query, key=None, value=None, key_padding_mask=None)``;
    the adapter passes a positional mask on as ``key_padding_mask`` and checks the
    inputs as the baselines do (including ``N <= max_seq_len``). The wrapped layer
    is ``self.layer``, so its parameters are saved under ``layer.``.
    """

    def __init__(self, layer: nn.Module, dim: int, max_seq_len: int):
        super().__init__()
        self.layer = layer
        self.dim = dim
        self.max_seq_len = max_seq_len

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_mixer_inputs(x, key_padding_mask, self.dim, self.max_seq_len)
        return self.layer(x, key_padding_mask=key_padding_mask)


def _adapt(kind: str, layer_class: type[nn.Module], dim: int, num_heads: int, head_dim: int, max_seq_len: int,
           **options) -> SequenceLayerAdapter:
    """The adapted sequence layer; options left at None take the layer's own defaults."""
    check_mixer_sizes(dim, num_heads, head_dim, max_seq_len)
    if dim % num_heads or head_dim != dim // num_heads:
        raise ValueError(
            f"{kind} needs head_dim == dim // num_heads (its projections are dim -> dim); "
            f"got dim={dim}, num_heads={num_heads}, head_dim={head_dim}"
        )
    given = {k: v for k, v in options.items() if v is not None}
    return SequenceLayerAdapter(layer_class(dim, num_heads, **given), dim, max_seq_len)


def build_pola(dim: int, num_heads: int, head_dim: int, *, max_seq_len: int, dropout: float = 0.0,
               alpha: float | None = None, kernel_size: int | None = None,
               gate_init: str | None = None) -> SequenceLayerAdapter:
    """PolaFormer: ``polaformer.layers.PolaSequenceAttention(dim, num_heads, ...)``.

    Options left at None take the layer's own defaults: ``alpha`` (range of the
    learnable power; the paper's LRA rows use 3, 5 and 7), ``kernel_size``
    (depthwise conv on v), ``gate_init`` (a key of ``polaformer.layers.GATE_INITS``).
    ``dropout`` is not passed on (no attention matrix).
    """
    return _adapt("pola", PolaSequenceAttention, dim, num_heads, head_dim, max_seq_len,
                  alpha=alpha, kernel_size=kernel_size, gate_init=gate_init)


def build_pacs(dim: int, num_heads: int, head_dim: int, *, max_seq_len: int, dropout: float = 0.0,
               kernel_size: int | None = None, gate_init: str | None = None) -> SequenceLayerAdapter:
    """PolaFormer++: ``polaformer.layers.PacsSequenceAttention(dim, num_heads, ...)``.

    Options left at None take the layer's own defaults: ``kernel_size`` (depthwise
    conv on v), ``gate_init``. ``dropout`` is not passed on.
    """
    return _adapt("pacs", PacsSequenceAttention, dim, num_heads, head_dim, max_seq_len,
                  kernel_size=kernel_size, gate_init=gate_init)


# ----------------------------------------------------------------------------- registry


ATTENTIONS: dict[str, Callable[..., nn.Module]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "kernelized": KernelizedAttention,
    "performer": PerformerAttention,
    "nystrom": NystromAttention,
    "linformer": LinformerAttention,
    "cosformer": CosformerAttention,
    "skyformer": SkyformerAttention,
    "focused": FocusedLinearAttention,
    "pola": build_pola,
    "pacs": build_pacs,
}

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
