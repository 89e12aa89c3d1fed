"""Plain O(N²) references of the Pola ops, building the attention weights explicitly (float64 tests compare the
fast paths with them; the analysis tools draw the weights), and the official code's two-stream formulation."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common import swap_halves
from ..feature_maps import power_feature
from ..reference import linear_attention_weights, reference_local_and_gate, two_streams

__all__ = [
    "naive_pola_layer_attention",
    "naive_pola_linear_attention",
    "naive_power_linear_attention",
    "official_pola_linear_attention",
    "pola_attention_weights",
    "power_attention_weights",
]


def pola_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-sign and opposite-sign weight matrices of PolaFormer's attention.

    ``q``: (B, H, N, d), ``k``: (B, H, M, d), ``power`` broadcastable to (B, H, 1, d); the opposite-sign
    query is the same-sign one with its halves swapped.
    """
    phi_q, phi_k = power_feature(q, power), power_feature(k, power)
    same = linear_attention_weights(phi_q, phi_k, eps, key_padding_mask=key_padding_mask, causal=causal)
    opposite = linear_attention_weights(swap_halves(phi_q), phi_k, eps, key_padding_mask=key_padding_mask,
                                        causal=causal)
    return same, opposite


def naive_pola_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pola_linear_attention` (``causal``: of
    :func:`~polaformer.ops.causal_pola_linear_attention`): ``[W_same @ v_same, W_opp @ v_opp]`` along channels."""
    return two_streams(*pola_attention_weights(q, k, power, eps, key_padding_mask, causal), v)


def naive_pola_layer_attention(q, k, v, scale, power, alpha=4.0, key_positions=None, eps=1e-6,
                               key_padding_mask=None, *, local=None, gate=None, causal=False) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pola_layer_attention`: the layer's arithmetic written out,
    ``(W @ v + local) · gate`` for ``q / softplus(scale)``, ``(k + key_positions) / softplus(scale)`` and
    ``p = 1 + alpha·sigmoid(power)``."""
    divisor = F.softplus(scale)
    k = k if key_positions is None else k + key_positions
    out = naive_pola_linear_attention(q / divisor, k / divisor, v, 1 + alpha * torch.sigmoid(power), eps,
                                      key_padding_mask, causal)
    return reference_local_and_gate(out, local, gate)


def power_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weights of the attention without polarity split: ``φ(x) = relu(x)ᵖ`` on q and k, one stream."""
    return linear_attention_weights(F.relu(q) ** power, F.relu(k) ** power, eps, key_padding_mask=key_padding_mask)


def naive_power_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    power: torch.Tensor,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.power_linear_attention`: ``W @ v`` over the whole value."""
    return power_attention_weights(q, k, power, eps, key_padding_mask) @ v


def official_pola_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor,
                                   eps: float = 1e-6) -> torch.Tensor:
    """The official PolaFormer computation as its code writes it, O(N·d²): the four power features, the
    opposite-sign query as a second concatenation, one ``φkᵀv`` product per stream. The baseline that
    benchmarks time the fused op against."""
    m = k.shape[-2]
    q_pos, q_neg = F.relu(q) ** power, F.relu(-q) ** power
    k_pos, k_neg = F.relu(k) ** power, F.relu(-k) ** power
    q_same, q_opposite = torch.cat([q_pos, q_neg], dim=-1), torch.cat([q_neg, q_pos], dim=-1)
    phi_k = torch.cat([k_pos, k_neg], dim=-1)
    v_same, v_opposite = v.chunk(2, dim=-1)
    k_mean = phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1)
    out_same = q_same @ (phi_k.transpose(-2, -1) @ v_same / m) / (q_same @ k_mean + eps)
    out_opposite = q_opposite @ (phi_k.transpose(-2, -1) @ v_opposite / m) / (q_opposite @ k_mean + eps)
    return torch.cat([out_same, out_opposite], dim=-1)
