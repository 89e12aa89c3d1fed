"""Softmax attention over many small windows with an additive bias shared by groups of windows.

Swin's window attention: each of B windows attends over its own N tokens, with a relative-position bias
per head plus, for shifted windows, a mask per window position. Windows are batch-major (all windows of
image 0 first), so window ``b`` takes bias row ``b % G`` of a (G, H, N, N) bias.

On the CPU the fused SDPA kernel is slow for such small problems: its tiles are sized for long
sequences, and with gradients (and a float mask) torch takes its math path, which adds several full
passes (isneginf, all, where). Here the logits come from one batched product with the scale in its
epilogue, the bias is added in place as a broadcast over the images (never repeated per window), and the
weights meet v in a second product, faster than SDPA for Swin's 7x7 windows, forward or
forward+backward (docs/benchmarks.md). PolaFormer++'s softmax blocks use it too, one window
per image and no bias. Elsewhere (CUDA, graph capture, long windows, and many long windows without a bias)
SDPA runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..capture import capturing

__all__ = ["window_softmax_attention"]

# Beyond this many tokens per window the fused kernel's tiling pays off; Swin's windows are 49 or 144.
_MAX_EXPLICIT_TOKENS = 256
# Without a bias (no mask for SDPA to read) the fused kernel also wins once the logits of all windows
# outgrow the cache (docs/benchmarks.md).
_MAX_EXPLICIT_LOGITS_WITHOUT_BIAS = 1 << 18
_ALWAYS_EXPLICIT_TOKENS = 64


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q, k, v must be (B, H, N, d) with the same B, H, N; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if bias is None:
        return
    b, h, n, _ = q.shape
    if bias.dim() != 4 or bias.shape[1:] != (h, n, n) or bias.shape[0] < 1 or b % bias.shape[0]:
        raise ValueError(f"bias must be (G, {h}, {n}, {n}) with G dividing the {b} windows, got {tuple(bias.shape)}")


def window_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                             scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """``softmax(scale · q kᵀ + bias[b % G]) v`` for (B, H, N, d) windows; returns (B, H, N, dv).

    ``bias``: (G, H, N, N) additive logits, or None; window ``b`` uses ``bias[b % G]``. A row may hold
    -inf entries but must keep one finite entry. ``dropout_p`` applies to the weights (pass 0 outside
    training). ``scale`` defaults to ``d ** -0.5``.
    """
    graph = capturing()
    if graph and bias is None:  # under FX the sizes are proxies: no checks, the plain op
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    _check(q, k, v, bias)
    b, h, n, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    large_without_bias = (bias is None and n > _ALWAYS_EXPLICIT_TOKENS
                          and b * h * n * n > _MAX_EXPLICIT_LOGITS_WITHOUT_BIAS)
    if q.device.type != "cpu" or n > _MAX_EXPLICIT_TOKENS or large_without_bias or dropout_p > 0 or graph:
        mask = None
        if bias is not None:  # SDPA wants one mask row per window
            mask = bias.repeat(b // bias.shape[0], 1, 1, 1).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    rows = b * h
    logits = torch.baddbmm(q.new_empty(()).expand(rows, n, n), q.reshape(rows, n, d),
                           k.reshape(rows, n, d).transpose(1, 2), beta=0, alpha=scale)
    if bias is not None:
        groups = bias.shape[0]
        bias = bias.to(logits.dtype)
        grouped = logits.view(b // groups, groups, h, n, n)
        if torch.is_grad_enabled() and (logits.requires_grad or bias.requires_grad):
            logits = (grouped + bias).view(rows, n, n)
        else:
            grouped.add_(bias)
    weights = torch.softmax(logits, dim=-1)
    return torch.bmm(weights, v.reshape(rows, n, v.shape[-1])).view(b, h, n, v.shape[-1])
