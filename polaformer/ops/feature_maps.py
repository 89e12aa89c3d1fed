"""Feature maps for linear attention, as pure tensor functions.

Every function works on the last dimension of a (..., tokens, head_dim) tensor.
The polarity-aware maps return ``2 * head_dim`` channels laid out as
``[positive part ; negative part]``, the layout of the official code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..capture import legacy_onnx_export

__all__ = [
    "polarity_split",
    "learnable_power",
    "power_feature",
    "pacs_temperature",
    "pacs_query_features",
    "pacs_key_features",
    "elu_feature",
    "relu_feature",
    "focused_feature",
]


def polarity_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x⁺, x⁻)`` with ``x = x⁺ − x⁻`` and both parts non-negative."""
    return F.relu(x), F.relu(-x)


def learnable_power(weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """PolaFormer's exponent ``p = 1 + α·sigmoid(w)``; always in ``(1, 1 + α)``."""
    return 1 + alpha * torch.sigmoid(weight)


def _expm1(x: torch.Tensor) -> torch.Tensor:
    # The TorchScript-based ONNX exporter has no symbolic for expm1 (ONNX has no such operator);
    # exp(x) - 1 is also what the dynamo exporter writes for it.
    return torch.exp(x) - 1 if legacy_onnx_export() else torch.expm1(x)


def _sign_expand(magnitude: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Place ``magnitude`` into the positive or negative half by the sign of ``x``."""
    positive = x > 0
    zero = magnitude.new_zeros(())
    return torch.cat([torch.where(positive, magnitude, zero), torch.where(positive, zero, magnitude)], dim=-1)


def power_feature(x: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """``[relu(x)^p ; relu(-x)^p]``, computing one power per element.

    Only one of ``x⁺``, ``x⁻`` is non-zero at each position, so ``|x|^p`` is
    evaluated once and routed to its half by the sign.
    """
    return _sign_expand(x.abs() ** power, x)


def check_power_values(power: torch.Tensor, capturing: bool) -> None:
    """``power >= 1``, checked only in eager mode on the CPU: elsewhere the check would synchronise with the
    device on every call (and graph capture cannot branch on values); :func:`~polaformer.ops.learnable_power`
    is > 1 by construction. (The native forward of the bidirectional op makes the same check.)"""
    if power.device.type != "cpu" or capturing or not power.numel():
        return
    power = power.detach()
    if not bool(torch.isfinite(power).all()):  # NaN would pass the comparison below
        raise ValueError("power must be finite, got NaN or infinite values")
    if bool(power.amin() < 1):
        raise ValueError(f"power must be >= 1 everywhere (the map |x|^p needs p >= 1), got a minimum of "
                         f"{power.amin().item():g}")


def pacs_temperature(weight: torch.Tensor) -> torch.Tensor:
    """PolaFormer++ channel-wise temperature ``s = sigmoid(w)`` (one per stream)."""
    return torch.sigmoid(weight)


def pacs_query_features(
    q: torch.Tensor, temp_same: torch.Tensor, temp_opposite: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PaCS query features of PolaFormer++.

    Returns ``exp([q⁺; q⁻]·s_same) − 1`` (same-sign stream) and
    ``exp([q⁻; q⁺]·s_opp) − 1`` (opposite-sign stream); the temperatures have
    ``2 * head_dim`` channels. ``exp`` runs once per element and stream, on
    ``|q|`` with the temperature of the half that element lands in.
    """
    d = q.shape[-1]
    positive = q > 0
    mag = q.abs()
    same = _expm1(mag * torch.where(positive, temp_same[..., :d], temp_same[..., d:]))
    opposite = _expm1(mag * torch.where(positive, temp_opposite[..., d:], temp_opposite[..., :d]))
    zero = q.new_zeros(())
    same = torch.cat([torch.where(positive, same, zero), torch.where(positive, zero, same)], dim=-1)
    opposite = torch.cat([torch.where(positive, zero, opposite), torch.where(positive, opposite, zero)], dim=-1)
    return same, opposite


def pacs_key_features(k: torch.Tensor) -> torch.Tensor:
    """PolaFormer++ key features ``exp([k⁺; k⁻]) − 1`` (no temperature, as in the official code)."""
    return _sign_expand(_expm1(k.abs()), k)


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    """``ELU(x) + 1`` (Katharopoulos et al., 2020)."""
    return F.elu(x) + 1


def relu_feature(x: torch.Tensor) -> torch.Tensor:
    """``ReLU(x)`` (Qin et al., 2022)."""
    return F.relu(x)


def focused_feature(x: torch.Tensor, focusing_factor: float = 3.0, eps: float = 1e-6) -> torch.Tensor:
    """FLatten Transformer's focused map: ``relu(x)^p`` rescaled to the norm of ``relu(x)``."""
    x = F.relu(x) + eps
    norm = x.norm(dim=-1, keepdim=True)
    x = x**focusing_factor
    return x * (norm / x.norm(dim=-1, keepdim=True))
