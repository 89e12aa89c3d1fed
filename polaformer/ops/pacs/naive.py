"""Plain O(N²) references of the PaCS ops, building the attention weights explicitly (float64 tests compare the
fast paths with them; the analysis tools draw the weights)."""
from __future__ import annotations

import torch

from ..feature_maps import pacs_key_features, pacs_query_features
from ..reference import linear_attention_weights, reference_local_and_gate, two_streams
from ..rope import apply_rope

__all__ = ["naive_pacs_layer_attention", "naive_pacs_linear_attention", "pacs_attention_weights"]


def pacs_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    temp_same: torch.Tensor,
    temp_opposite: torch.Tensor,
    sin: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight matrices of PolaFormer++'s PaCS attention, RoPE (given the tables) rotating the numerator's
    features only."""
    q_same, q_opposite = pacs_query_features(q, temp_same, temp_opposite)
    phi_k = pacs_key_features(k)
    rotate = (lambda x: apply_rope(x, sin, cos)) if sin is not None else (lambda x: x)
    k_num = rotate(phi_k)
    same = linear_attention_weights(q_same, phi_k, eps, rotate(q_same), k_num, key_padding_mask, causal)
    opposite = linear_attention_weights(q_opposite, phi_k, eps, rotate(q_opposite), k_num, key_padding_mask, causal)
    return same, opposite


def naive_pacs_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    temp_same: torch.Tensor,
    temp_opposite: torch.Tensor,
    sin: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pacs_linear_attention` (``causal``: of
    :func:`~polaformer.ops.causal_pacs_linear_attention`)."""
    weights = pacs_attention_weights(q, k, temp_same, temp_opposite, sin, cos, eps, key_padding_mask, causal)
    return two_streams(*weights, v)


def naive_pacs_layer_attention(q, k, v, same, opposite, sin=None, cos=None, eps=1e-6, key_padding_mask=None, *,
                               local=None, gate=None, causal=False) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pacs_layer_attention`: PaCS attention with the temperatures
    ``sigmoid(same)`` and ``sigmoid(opposite)``, then ``(out + local) · gate``."""
    out = naive_pacs_linear_attention(q, k, v, torch.sigmoid(same), torch.sigmoid(opposite), sin, cos, eps,
                                      key_padding_mask, causal)
    return reference_local_and_gate(out, local, gate)
