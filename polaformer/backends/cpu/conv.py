"""Convolutions: the "same"-padded depthwise conv with a fast backward, the identity folded into one, and an
inference-time conv with its BatchNorm folded in and GELU fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...capture import capturing
from . import onednn
from .native import native_kernels
from .onednn import gelu_linear, linear

__all__ = ["conv2d_gelu", "depthwise_conv2d", "depthwise_conv_gelu_linear", "fold_batch_norm", "plus_depthwise_conv"]

_CONV_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_convolution_pointwise", None)


# oneDNN's own 3×3 backward is as fast on maps below ~2M elements and is kept there
_NATIVE_MIN_KERNEL, _NATIVE_MIN_3X3_ELEMENTS = 5, 1 << 21


def _weight_grad_kernels():
    kernels = native_kernels()
    return kernels if kernels is not None and hasattr(kernels, "depthwise_weight_grad") else None


def _is_dense_channels_last(x: torch.Tensor) -> bool:
    n, c, h, w = x.shape
    return all(size == 1 or stride == expected for size, stride, expected in
               ((c, x.stride(1), 1), (w, x.stride(3), c), (h, x.stride(2), w * c), (n, x.stride(0), h * w * c)))


class _DepthwiseConv(torch.autograd.Function):
    """Forward and input gradient on oneDNN's depthwise kernel (the input gradient of a stride-1 "same"
    conv is the same conv of the output gradient with the kernel flipped); weight and bias gradients from
    the native kernel: oneDNN's backward-weights pass is far slower on channels-last maps."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernels):
        ctx.save_for_backward(x, weight)
        ctx.kernels, ctx.has_bias = kernels, bias is not None
        return F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        size = weight.shape[-1]
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_x = grad_w = grad_b = None
        if needs[0]:
            grad_x = F.conv2d(grad, weight.flip((2, 3)), None, padding=size // 2, groups=x.shape[1])
        if needs[1] or (ctx.has_bias and needs[2]):
            grad_w, grad_b = ctx.kernels.depthwise_weight_grad(x, grad, size)
        return grad_x, grad_w if needs[1] else None, grad_b if ctx.has_bias and needs[2] else None, None


def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=K // 2, groups=C)`` for ``weight`` (C, 1, K, K), K odd.

    With gradients, on a dense channels-last float map and where the native kernels are built, the
    weight and bias gradients come from a native kernel (:class:`_DepthwiseConv`) for 5×5 and larger
    kernels and for 3×3 on maps of 2M elements or more; on smaller 3×3 maps oneDNN's backward is as fast
    and is kept (docs/benchmarks.md). Elsewhere it is ``F.conv2d``. Both give the same values up to the order of the
    sums.
    """
    if capturing():  # shapes may be proxies: no checks
        return F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=weight.shape[0])
    if weight.dim() != 4 or weight.shape[1] != 1 or weight.shape[2] != weight.shape[3] or weight.shape[2] % 2 == 0:
        raise ValueError(f"expected a depthwise weight (C, 1, K, K) with K odd, got {tuple(weight.shape)}")
    if x.dim() != 4 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"expected a map (B, {weight.shape[0]}, H, W), got {tuple(x.shape)}")
    padding = weight.shape[-1] // 2
    leaves = (x, weight) if bias is None else (x, weight, bias)
    large = weight.shape[-1] >= _NATIVE_MIN_KERNEL or x.numel() >= _NATIVE_MIN_3X3_ELEMENTS
    if (large and torch.is_grad_enabled() and any(t.requires_grad for t in leaves) and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64) and all(t.dtype == x.dtype for t in leaves)
            and not torch.is_autocast_enabled("cpu") and _is_dense_channels_last(x)):
        kernels = _weight_grad_kernels()
        if kernels is not None:
            return _DepthwiseConv.apply(x, weight, bias, kernels)
    return F.conv2d(x, weight, bias, padding=padding, groups=weight.shape[0])


def depthwise_conv_gelu_linear(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                               weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(GELU(depthwise_conv2d(x)), weight, bias)`` over the map's tokens: (B, C, H, W) -> (B, H·W, out).

    The tail of PVTv2's MLP. Without gradients GELU is fused into oneDNN's convolution (float32,
    channels-last; one pass less over the hidden map); with gradients GELU's backward is folded into the
    products (:func:`gelu_linear`).
    """
    if capturing():
        hidden = F.gelu(F.conv2d(x, conv_weight, conv_bias, padding=conv_weight.shape[-1] // 2, groups=x.shape[1]))
        return F.linear(hidden.flatten(2).transpose(1, 2), weight, bias)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, conv_weight, conv_bias, weight, bias))
    if needs_grad:
        return gelu_linear(depthwise_conv2d(x, conv_weight, conv_bias).flatten(2).transpose(1, 2), weight, bias)
    if (_CONV_POINTWISE is not None and onednn._ENABLED and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and _is_dense_channels_last(x) and conv_weight.shape[1] == 1
            and all(t is None or t.dtype == torch.float32 for t in (conv_weight, conv_bias))):
        padding = [conv_weight.shape[-1] // 2] * 2
        hidden = _CONV_POINTWISE.default(x, conv_weight, conv_bias, padding, [1, 1], [1, 1], x.shape[1], "gelu", [],
                                         "none")
    else:
        hidden = F.gelu(depthwise_conv2d(x, conv_weight, conv_bias))
    return linear(hidden.flatten(2).transpose(1, 2), weight, bias)


def plus_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel_size: int,
                        channels: int) -> torch.Tensor:
    """``x + depthwise_conv(x)`` (square odd kernel, stride 1, "same" zero padding) as one convolution.

    The identity is folded into the kernel's centre tap, so the sum costs no pass of its own over the
    map (written once instead of twice, read once instead of three times); gradients are the same, the
    kernel being the weight plus a constant. ``weight`` is (channels, 1, k, k). Graph capture and FX
    tracing get the plain sum: exporters want a convolution kernel of known shape, and FX cannot
    follow the folded kernel's construction through proxies.
    """
    if kernel_size % 2 == 0:
        raise ValueError(f"the identity needs an odd kernel with a centre tap, got kernel_size {kernel_size}")
    padding = kernel_size // 2
    if capturing():
        return x + F.conv2d(x, weight, bias, padding=padding, groups=channels)
    identity = F.pad(weight.new_ones(1, 1, 1, 1), (padding,) * 4)
    return depthwise_conv2d(x, weight + identity, bias)


def fold_batch_norm(weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
                    gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float):
    """A conv's (weight, bias) with an eval-mode BatchNorm that follows it folded in: one conv gives
    ``BN(conv(x))``. The weight is returned channels-last (the layout oneDNN reads for channels-last inputs;
    a contiguous weight is re-laid out on every call)."""
    scale = torch.rsqrt(var + eps)
    if gamma is not None:
        scale = scale * gamma
    folded = (weight * scale.view(-1, *([1] * (weight.dim() - 1)))).contiguous(memory_format=torch.channels_last)
    shift = -mean * scale if bias is None else (bias - mean) * scale
    return folded, shift if beta is None else shift + beta


def conv2d_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding,
                gelu: bool) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` (dense, dilation 1), then GELU if ``gelu``.

    Without gradients on float32 channels-last CPU maps GELU is a post-op of oneDNN's convolution (no pass
    of its own); elsewhere it is ``F.conv2d`` and ``F.gelu``.
    """
    stride, padding = list(torch.nn.modules.utils._pair(stride)), list(torch.nn.modules.utils._pair(padding))
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if (not needs_grad and _CONV_POINTWISE is not None and onednn._ENABLED and not capturing()
            and not torch.is_autocast_enabled("cpu") and x.device.type == "cpu"
            and x.dim() == 4 and _is_dense_channels_last(x)
            and all(t is None or t.dtype == torch.float32 for t in (x, weight, bias))):
        return _CONV_POINTWISE.default(x, weight, bias, padding, stride, [1, 1], 1, "gelu" if gelu else "none", [],
                                       "none" if gelu else "")
    out = F.conv2d(x, weight, bias, stride, padding)
    return F.gelu(out) if gelu else out
