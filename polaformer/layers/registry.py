"""The token mixers of the sequence models, by name: one table for the LRA encoder, the language model and the DiT.

Each entry of :data:`SEQUENCE_ATTENTIONS` maps the kinds of token sequence that attention is built for to its
builder:

- ``"encoder"``: every token sees every other, with padding (the Long Range Arena model),
  ``builder(dim, num_heads, head_dim, *, max_seq_len, dropout=0.0, **options)`` -> a module with
  ``forward(x, key_padding_mask=None)``, the interface of :mod:`.baseline_attention`; ``pola`` and ``pacs`` wrap
  the sequence layers in a :class:`SequenceLayerAdapter`.
- ``"causal"``: token ``t`` sees tokens ``0..t`` (the language model),
  ``builder(dim, num_heads, *, proj_drop=0.0, **options)`` -> a module with ``forward(x)`` and ``step(x, cache)``
  (:mod:`.causal_attention`).
- ``"grid"``: the tokens of a square image grid in raster order (the diffusion transformer),
  ``builder(dim, num_heads)`` -> a module with ``forward(x)``.

:func:`sequence_attentions` gives one kind's builders by name; a name is accepted for the kinds it lists.
"""
from __future__ import annotations

from typing import Callable

import torch
from timm.layers import Attention
from torch import nn

from .baseline_attention import (
    CosformerAttention,
    FocusedLinearAttention,
    KernelizedAttention,
    LinearAttention,
    LinformerAttention,
    NystromAttention,
    PerformerAttention,
    SkyformerAttention,
    SoftmaxAttention,
    check_mixer_inputs,
    check_mixer_sizes,
)
from .causal_attention import (
    EluCausalSelfAttention,
    PacsCausalSelfAttention,
    PolaCausalSelfAttention,
    SoftmaxCausalSelfAttention,
)
from .pacs_grid_attention import PacsGridAttention
from .sequence_attention import PacsSequenceAttention, PolaSequenceAttention

__all__ = ["KINDS", "SEQUENCE_ATTENTIONS", "SequenceLayerAdapter", "build_pacs", "build_pola",
           "sequence_attentions", "softmax_grid_attention"]

KINDS = ("encoder", "causal", "grid")


class SequenceLayerAdapter(nn.Module):
    """Gives a Pola/PaCS sequence layer the interface of the baseline token mixers.

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


def softmax_grid_attention(dim: int, num_heads: int) -> nn.Module:
    """The original DiT's attention: timm's ``Attention`` with a qkv bias (keys ``qkv`` and ``proj``)."""
    return Attention(dim, num_heads, qkv_bias=True)


SEQUENCE_ATTENTIONS: dict[str, dict[str, Callable[..., nn.Module]]] = {
    "softmax": {"encoder": SoftmaxAttention, "causal": SoftmaxCausalSelfAttention, "grid": softmax_grid_attention},
    "linear": {"encoder": LinearAttention},
    "kernelized": {"encoder": KernelizedAttention},
    "performer": {"encoder": PerformerAttention},
    "nystrom": {"encoder": NystromAttention},
    "linformer": {"encoder": LinformerAttention},
    "cosformer": {"encoder": CosformerAttention},
    "skyformer": {"encoder": SkyformerAttention},
    "focused": {"encoder": FocusedLinearAttention},
    "pola": {"encoder": build_pola, "causal": PolaCausalSelfAttention},
    "pacs": {"encoder": build_pacs, "causal": PacsCausalSelfAttention, "grid": PacsGridAttention},
    "elu": {"causal": EluCausalSelfAttention},  # ELU+1 (the "linear" encoder's map), causal with a recurrent step
}


def sequence_attentions(kind: str) -> dict[str, Callable[..., nn.Module]]:
    """The builders of one kind (a key of :data:`KINDS`) by name, in :data:`SEQUENCE_ATTENTIONS`' order."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of sequence {kind!r} (known: {', '.join(KINDS)})")
    return {name: builders[kind] for name, builders in SEQUENCE_ATTENTIONS.items() if kind in builders}
