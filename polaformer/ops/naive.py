"""Plain O(N²) references that build the attention weights explicitly.

These are the obviously-correct versions of the fast ops: tests compare the
two in float64, and the analysis tools draw the weights they return. Nothing
here is tuned for speed.

Conventions (as in the official code): values are split into two channel
halves ``[v_same ; v_opposite]``; every stream is normalised like linear
attention, ``w(t, i) = (φq(t)·φk(i) / M) / (φq(t)·mean_i φk(i) + eps)``.
With a key padding mask (B, M), True at padding, the weight of a padded key is
0, and ``M`` and the mean count the valid keys only (a sequence without any
valid key gets all-zero weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import swap_halves
from .feature_maps import pacs_key_features, pacs_query_features, power_feature
from .rope import apply_rope

__all__ = [
    "linear_attention_weights",
    "pola_attention_weights",
    "naive_pacs_layer_attention",
    "naive_pola_layer_attention",
    "naive_pola_linear_attention",
    "naive_power_linear_attention",
    "power_attention_weights",
    "pacs_attention_weights",
    "naive_pacs_linear_attention",
    "softmax_attention_weights",
]


def linear_attention_weights(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    eps: float = 1e-6,
    phi_q_num: torch.Tensor | None = None,
    phi_k_num: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Explicit (B, H, N, M) weights of mean-normalised linear attention.

    ``phi_q_num``/``phi_k_num`` replace the features in the numerator only
    (PolaFormer++ rotates them with RoPE but normalises with the plain ones).
    ``key_padding_mask``: (B, M) bool, True at padded keys.
    ``causal``: query ``t`` sees keys ``0..t`` only (N = M): later keys weigh 0, and
    ``M`` and the mean count the valid keys of the prefix (at least 1).
    """
    seen = torch.ones(phi_q.shape[-2], phi_k.shape[-2], dtype=torch.bool, device=phi_k.device)
    if causal:
        seen = seen.tril()
    if key_padding_mask is not None:
        seen = seen & ~key_padding_mask[:, None, None, :]  # (B, 1, 1, M) over the key axis
    num_q = phi_q if phi_q_num is None else phi_q_num
    num_k = phi_k if phi_k_num is None else phi_k_num
    m = seen.sum(dim=-1, keepdim=True).clamp_min(1)
    scores = (num_q @ num_k.transpose(-2, -1)).masked_fill(~seen, 0.0) / m
    key_sum = (phi_q @ phi_k.transpose(-2, -1)).masked_fill(~seen, 0.0).sum(dim=-1, keepdim=True)
    return scores / (key_sum / m + eps)


def _two_streams(same: torch.Tensor, opposite: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[W_same @ v_same, W_opp @ v_opp]`` along channels, ``v`` split as ``torch.chunk`` splits it."""
    v_same, v_opposite = v.chunk(2, dim=-1)
    return torch.cat([same @ v_same, opposite @ v_opposite], dim=-1)


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
    return _two_streams(*pola_attention_weights(q, k, power, eps, key_padding_mask, causal), v)


def _local_and_gate(out, local, gate):
    """``(out + local) · gate``, ``local`` on the last queries (zeros before), either None."""
    if local is not None:
        out = out + F.pad(local, (0, 0, out.shape[-2] - local.shape[-2], 0))
    return out if gate is None else out * gate


def naive_pola_layer_attention(q, k, v, scale, power, alpha=4.0, key_positions=None, eps=1e-6,
                               key_padding_mask=None, *, local=None, gate=None, causal=False) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pola_layer_attention`: the layer's arithmetic written out,
    ``(W @ v + local) · gate`` for ``q / softplus(scale)``, ``(k + key_positions) / softplus(scale)`` and
    ``p = 1 + alpha·sigmoid(power)``."""
    divisor = F.softplus(scale)
    k = k if key_positions is None else k + key_positions
    out = naive_pola_linear_attention(q / divisor, k / divisor, v, 1 + alpha * torch.sigmoid(power), eps,
                                      key_padding_mask, causal)
    return _local_and_gate(out, local, gate)


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
    return _two_streams(*weights, v)


def naive_pacs_layer_attention(q, k, v, same, opposite, sin=None, cos=None, eps=1e-6, key_padding_mask=None, *,
                               local=None, gate=None, causal=False) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.pacs_layer_attention`: PaCS attention with the temperatures
    ``sigmoid(same)`` and ``sigmoid(opposite)``, then ``(out + local) · gate``."""
    out = naive_pacs_linear_attention(q, k, v, torch.sigmoid(same), torch.sigmoid(opposite), sin, cos, eps,
                                      key_padding_mask, causal)
    return _local_and_gate(out, local, gate)


def softmax_attention_weights(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Row-stochastic ``softmax(q kᵀ · scale)``, scale defaulting to ``head_dim^-1/2``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)

