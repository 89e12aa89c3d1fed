"""What the plain O(N²) references share: the explicit weights of mean-normalised linear attention (every stream
of every polarity-aware op is one), softmax weights, two streams put together, and the layer ops' epilogue
written plainly. Each op's own reference is in its folder (``ops/<op>/naive.py``).

Conventions (as in the official code): values are split into two channel halves ``[v_same ; v_opposite]``; every
stream is normalised like linear attention, ``w(t, i) = (φq(t)·φk(i) / M) / (φq(t)·mean_i φk(i) + eps)``. With a
key padding mask (B, M), True at padding, the weight of a padded key is 0, and ``M`` and the mean count the valid
keys only (a sequence without any valid key gets all-zero weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_attention_weights", "reference_local_and_gate", "softmax_attention_weights", "two_streams"]


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


def two_streams(same: torch.Tensor, opposite: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[W_same @ v_same, W_opp @ v_opp]`` along channels, ``v`` split as ``torch.chunk`` splits it."""
    v_same, v_opposite = v.chunk(2, dim=-1)
    return torch.cat([same @ v_same, opposite @ v_opposite], dim=-1)


def reference_local_and_gate(out, local, gate):
    """``(out + local) · gate``, ``local`` on the last queries (zeros before), either None."""
    if local is not None:
        out = out + F.pad(local, (0, 0, out.shape[-2] - local.shape[-2], 0))
    return out if gate is None else out * gate


def softmax_attention_weights(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Row-stochastic ``softmax(q kᵀ · scale)``, scale defaulting to ``head_dim^-1/2``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)

