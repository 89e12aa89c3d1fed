"""The plain O(N²) reference of the one-stream causal op, building the masked weights explicitly. The Pola and PaCS
causal ops' references are :func:`~polaformer.ops.naive_pola_linear_attention` and
:func:`~polaformer.ops.naive_pacs_linear_attention` with ``causal=True``."""
from __future__ import annotations

import torch

from ..reference import linear_attention_weights

__all__ = ["naive_causal_linear_attention"]


def naive_causal_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                  eps: float = 1e-6) -> torch.Tensor:
    """Reference output of :func:`~polaformer.ops.causal_linear_attention`: the causal weights of
    mean-normalised linear attention on the given features, times ``v``."""
    return linear_attention_weights(phi_q, phi_k, eps, causal=True) @ v
