"""Build our modules from the records of the official code (reference vectors and manifests).

``from_official(record)`` reads a record's ``family``, ``official_class`` and
``constructor`` and returns the equivalent module of this library. Its
state_dict has exactly the official keys and shapes, and its ``forward`` takes
the official forward's arguments, so the authors' weights load strictly.
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from . import models  # noqa: F401  (the model families register their builders on import)
from .layers import PacsLinearAttention, PolaLinearAttention, RopeSoftmaxAttention
from .models.official import OFFICIAL_BUILDERS, register_official

__all__ = ["from_official", "register_official", "supported_official_classes"]


class _OfficialSwinWindowAttention(PolaLinearAttention):
    """Official Swin call signature: (windows·B, N, C) plus H, W and mask, of which only x is used
    (the official layer recomputes the square window side from N and ignores the mask)."""

    def forward(self, x, H=None, W=None, mask=None):
        side = math.isqrt(x.shape[1])
        if side * side != x.shape[1]:
            raise ValueError(f"window token count {x.shape[1]} is not a square")
        return super().forward(x, side, side)


def _pvt_attention(c: dict[str, Any]) -> nn.Module:
    sr = c.get("sr_ratio", 1)
    return PolaLinearAttention(
        c["dim"],
        c.get("num_heads", 8),
        qkv_bias=c.get("qkv_bias", False),
        proj_drop=c.get("proj_drop", 0.0),
        sr_ratio=sr,
        kernel_size=c.get("kernel_size", 5),
        alpha=c.get("alpha", 4),
        key_pos_tokens=c["num_patches"] // (sr * sr),
    )


def _swin_attention(c: dict[str, Any]) -> nn.Module:
    wh, ww = c["window_size"]
    return _OfficialSwinWindowAttention(
        c["dim"],
        c["num_heads"],
        qkv_bias=c.get("qkv_bias", True),
        proj_drop=c.get("proj_drop", 0.0),
        kernel_size=c.get("kernel_size", 5),
        alpha=c.get("alpha", 4),
        key_pos_tokens=wh * ww,
        fused_qkvg=True,
    )


OFFICIAL_BUILDERS.update({
    ("pvt", "PolaLinearAttention"): _pvt_attention,
    ("swin", "PolaLinearAttention"): _swin_attention,
    ("polapp", "PolaLinearAttention"): lambda c: PacsLinearAttention(c["dim"], c["num_heads"]),
    ("polapp", "VanillaSelfAttention"): lambda c: RopeSoftmaxAttention(c["dim"], c["num_heads"]),
})


def supported_official_classes() -> list[tuple[str, str]]:
    return sorted(OFFICIAL_BUILDERS)


def from_official(record: dict[str, Any]) -> nn.Module:
    """Return our module equivalent to the official ``record['official_class']`` of ``record['family']``."""
    try:
        key = (record["family"], record["official_class"])
        constructor = record["constructor"]
    except KeyError as err:
        raise ValueError(f"record lacks the field {err}; expected 'family', 'official_class' and 'constructor'")
    builder = OFFICIAL_BUILDERS.get(key)
    if builder is None:
        raise ValueError(f"no equivalent for official {key[1]!r} of family {key[0]!r}; "
                         f"supported: {supported_official_classes()}")
    return builder(constructor)
