"""Rank of a Pola layer's token mixing, without and with its local branch (the paper's case for the DWC).

Linear attention's weight matrix is a product of an N×D and a D×M feature matrix, so its rank is at most
the feature width D (2·head_dim for the polarity features ``[x⁺ᵖ; x⁻ᵖ]``, head_dim without polarity),
however many tokens there are. The local branch adds, for each value channel, a banded token-mixing
matrix that restores rank. For one head and one value channel ``c`` the layer computes, over the patch
tokens, ``(A_c + L_c)·v_c``:

- ``A_c``: the stream's weights (same-sign for the first ``ceil(d/2)`` channels, opposite-sign for the
  rest; one matrix without polarity), rows and columns of the patch tokens;
- ``L_c``: the local branch as a matrix, read off by applying it to one-hot token maps: exact for the
  depthwise conv; for the deformable conv, the conv with its sampling offsets held at those computed
  from this input's values (its linearisation at this input).

Only layers whose keys are the query tokens (no spatial reduction) have a square ``A_c + L_c``; others,
and layers of more than ``max_tokens`` tokens (each rank is an SVD of a full P×P matrix), are reported
without ranks.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..layers.deformable import DeformableDepthwiseConv2d
from ..ops import linear_attention_weights, pola_attention_weights

__all__ = ["layer_ranks", "local_matrices", "stream_weights"]

DEFAULT_MAX_CHANNELS = 16
DEFAULT_MAX_TOKENS = 256


def stream_weights(feat, head: int) -> list[torch.Tensor]:
    """The weight matrices of one head over the patch tokens, float64: ``[same, opposite]``, or ``[one]``
    without polarity. Each is (P, P) with P the patch tokens."""
    q, k = feat.q[:, head:head + 1].double(), feat.k[:, head:head + 1].double()
    power = feat.power[:, head:head + 1].double()
    if feat.polarity:
        matrices = pola_attention_weights(q, k, power)
    else:
        matrices = (linear_attention_weights(F.relu(q) ** power, F.relu(k) ** power),)
    p = feat.prefix
    return [w[0, 0, p:, p:] for w in matrices]


@torch.no_grad()
def local_matrices(feat, head: int) -> torch.Tensor | None:
    """(d, P, P) float64: row ``c`` is the local branch's token-mixing matrix of value channel ``c`` (output
    token × input token), or None for a layer without one."""
    local = feat.local
    if local is None:
        return None
    height, width = feat.grid
    tokens, channels = height * width, feat.v.shape[-1]
    local = copy.deepcopy(local).double()  # the model keeps its dtype
    # sample j: a one at token j in every channel; depthwise, so each channel sees only its own map
    basis = torch.eye(tokens, dtype=torch.float64).reshape(tokens, 1, height, width).expand(-1, channels, -1, -1)
    zeros = torch.zeros(1, channels, height, width, dtype=torch.float64)
    if isinstance(local, DeformableDepthwiseConv2d):
        values = feat.v[0, head, feat.prefix:].double().t().reshape(1, channels, height, width)
        offsets = local.offset(values)
        columns = local.conv(basis, offsets.expand(tokens, -1, -1, -1)) - local.conv(zeros, offsets)
    else:
        columns = local(basis) - local(zeros)  # the bias is no token mixing
    return columns.reshape(tokens, channels, tokens).permute(1, 2, 0)


def _channels(d: int, max_channels: int) -> list[int]:
    if d <= max_channels:
        return list(range(d))
    return torch.linspace(0, d - 1, max_channels).round().long().unique().tolist()


def layer_ranks(feat, max_channels: int = DEFAULT_MAX_CHANNELS, max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
    """Mean rank over heads (and streams) of the attention weights, and over heads and up to
    ``max_channels`` evenly spaced value channels of attention + local branch; ``None`` ranks for a
    spatially reduced layer or one of more than ``max_tokens`` tokens (and for ``with_local`` in a layer
    without local branch)."""
    d = feat.q.shape[-1]
    tokens = feat.grid[0] * feat.grid[1]
    result = {"layer": feat.name, "tokens": tokens, "feature_width": 2 * d if feat.polarity else d,
              "attention_rank": None, "with_local_rank": None}
    if feat.key_grid != feat.grid or feat.k.shape[2] != feat.q.shape[2] or tokens > max_tokens:
        return result
    attention, with_local = [], []
    same_channels = (d + 1) // 2
    for head in range(feat.q.shape[1]):
        streams = stream_weights(feat, head)
        attention += [torch.linalg.matrix_rank(w).item() for w in streams]
        local = local_matrices(feat, head)
        if local is None:
            continue
        for c in _channels(d, max_channels):
            stream = streams[0] if len(streams) == 1 or c < same_channels else streams[1]
            with_local.append(torch.linalg.matrix_rank(stream + local[c]).item())
    result["attention_rank"] = sum(attention) / len(attention)
    if with_local:
        result["with_local_rank"] = sum(with_local) / len(with_local)
    return result
