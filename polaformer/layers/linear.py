"""``nn.Linear`` and the transformer MLP on :func:`polaformer.ops.linear` (oneDNN, fused bias and GELU).

Drop-in replacements: the same parameters and state_dict keys as ``nn.Linear`` and timm's ``Mlp``
(``fc1``, ``act``, ``drop1``, ``norm``, ``fc2``, ``drop2``), so checkpoints load unchanged and
``isinstance(m, nn.Linear)`` initialisers still apply.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.onednn import linear, mlp

__all__ = ["Linear", "Mlp"]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes oneDNN's matmul where that is faster (same result up to rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _unhooked(*modules: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class Mlp(nn.Module):
    """fc1 -> GELU -> dropout -> fc2 -> dropout, as :func:`polaformer.ops.mlp` where that applies.

    timm's ``Mlp(in_features, hidden_features, drop=...)`` with its default ``nn.GELU`` and no norm.
    Without gradients GELU is fused into fc1's product; with gradients its backward is folded into the
    products. The fused path is taken while ``act`` is the exact ``nn.GELU()``, no dropout is active
    and no module of the MLP has hooks; otherwise each module runs on its own.
    """

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 drop: float = 0.0):
        super().__init__()
        hidden_features = hidden_features or in_features
        self.fc1 = Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = Linear(hidden_features, out_features or in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act, fc1, fc2 = self.act, self.fc1, self.fc2
        no_dropout = not self.training or (self.drop1.p == 0 and self.drop2.p == 0)
        if (type(act) is nn.GELU and act.approximate == "none" and type(self.norm) is nn.Identity and no_dropout
                and _unhooked(act, fc1, fc2)):
            return mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        return self.drop2(fc2(self.norm(self.drop1(act(fc1(x))))))
