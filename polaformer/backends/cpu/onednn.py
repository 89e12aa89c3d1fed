"""Linear maps on oneDNN's matmul, with the bias and GELU fused, where that is faster on the CPU.

torch runs ``F.linear`` on the CPU as MKL's GEMM after copying the bias into the output, and GELU as
a pass of its own over the hidden activations. oneDNN's matmul (the one ``torch.compile`` uses for
frozen CPU graphs, ``torch.ops.mkldnn._linear_pointwise``) adds the bias and applies GELU to each
output tile while it is still in cache, and its kernels are faster for most transformer shapes
(docs/benchmarks.md). The GELU pass over a large MLP's hidden activations is a large share of its memory
traffic, so fusing it is most of the gain at inference.

How much faster oneDNN is depends on the CPU, so the sizes from which it is used (:class:`Policy`) follow
from the CPU's identity (:func:`policy`), never from a timing: a run and its resume on a busy machine
must take the same kernels, hence round the same way.

- ``narrow``: where both libraries run the CPU's widest vector code (Intel; AMD up to Zen 4, whose
  AVX-512 is executed as two 256-bit halves), oneDNN's fixed cost per call loses on small products. It
  takes the forward and the input's gradient from 2^25 multiply-adds (2^22 with an inner dimension of
  256 or more), and the weight's gradient stays on MKL.
- ``wide``: AMD from Zen 5 (CPU family 26) with AVX-512, which it executes at full width while MKL runs
  its AVX2 code there (MKL's AVX-512 kernels are for Intel CPUs only), so oneDNN is about twice as fast:
  oneDNN takes every product of 2^21 multiply-adds or more, the weight's gradient from 2^23.

``POLAFORMER_ONEDNN=0`` turns the path off, ``=narrow`` or ``=wide`` chooses the policy.

Both kernels compute the same IEEE float32 products (oneDNN's default math mode is strict): outputs
differ from ``F.linear`` by rounding only, and by nothing under float64, where torch's own kernel
runs. The oneDNN path is taken for float32 CPU tensors outside autocast and graph capture, when the
product is large enough to win (:func:`_prefers_onednn`); everything else runs ``F.linear`` (and
``F.gelu``), so exporters and compilers see plain ops. With gradients the forward and the input's
gradient run on oneDNN, and the weight's gradient where the policy says so; GELU (at any size, after MKL's product where
that is too small for oneDNN) is then a native pass that also writes its slope over the pre-activation
(its backward is then one multiply, or none at all in :func:`mlp`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...capture import capturing
from .native import native_kernels

__all__ = ["Policy", "gelu", "gelu_linear", "linear", "mlp", "onednn_linear_available", "policy"]

log = logging.getLogger(__name__)

_ACTIVATIONS = (None, "gelu")


def _onednn_op(overload: str):
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return getattr(mkldnn._linear_pointwise, overload) if mkldnn is not None else None
    except (AttributeError, RuntimeError):
        return None


_OP = _onednn_op("default")
_OP_BINARY = _onednn_op("binary")  # the product combined elementwise with a second tensor


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's fused linear (and ``POLAFORMER_ONEDNN`` is not ``0``)."""
    return (_OP is not None and _OP_BINARY is not None and torch.backends.mkldnn.is_available()
            and os.environ.get("POLAFORMER_ONEDNN") != "0")


_ENABLED = onednn_linear_available()


@dataclass(frozen=True)
class Policy:
    """From how many multiply-adds a product runs on oneDNN rather than MKL (see the module docstring)."""

    name: str
    min_macs: int  # the forward and the input's gradient
    min_macs_wide_inner: int  # the same with an inner dimension of 256 or more
    min_macs_weight_grad: int | None  # None: the weight's gradient always on MKL

    def prefers_onednn(self, rows: int, inner: int, outer: int) -> bool:
        macs = rows * inner * outer
        return macs >= self.min_macs or (inner >= 256 and macs >= self.min_macs_wide_inner)


NARROW = Policy("narrow", min_macs=1 << 25, min_macs_wide_inner=1 << 22, min_macs_weight_grad=None)
WIDE = Policy("wide", min_macs=1 << 21, min_macs_wide_inner=1 << 21, min_macs_weight_grad=1 << 23)
_ZEN5_FAMILY = 26
_POLICY: Policy | None = None


def _cpu_identity() -> tuple[str, int]:
    """(vendor, family) of the first CPU in /proc/cpuinfo; ("", 0) where it cannot be read."""
    vendor, family = "", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "vendor_id":
                    vendor = value
                elif key == "cpu family" and value.isdigit():
                    family = int(value)
                elif not key and (vendor or family):  # the end of the first CPU's entry
                    break
    except OSError:
        pass
    return vendor, family


def _policy_for(vendor: str, family: int, capability: str) -> Policy:
    wide = vendor == "AuthenticAMD" and family >= _ZEN5_FAMILY and capability == "AVX512"
    return WIDE if wide else NARROW


def policy() -> Policy:
    """This process's :class:`Policy`: ``POLAFORMER_ONEDNN=narrow`` or ``=wide`` if set, else the CPU's."""
    global _POLICY
    if _POLICY is None:
        forced = os.environ.get("POLAFORMER_ONEDNN", "").strip().lower()
        if forced in ("narrow", "wide"):
            _POLICY = NARROW if forced == "narrow" else WIDE
        else:
            _POLICY = _policy_for(*_cpu_identity(), torch.backends.cpu.get_cpu_capability())
            log.info("oneDNN policy %r for this CPU", _POLICY.name)
    return _POLICY


def _prefers_onednn(rows: int, inner: int, outer: int) -> bool:
    return policy().prefers_onednn(rows, inner, outer)


def _weight_grad(grad_rows: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """``gᵀ x``, (out, in), for the output's gradient ``g`` (T, out) and the input ``x`` (T, in) as rows.

    On oneDNN where the policy says so. oneDNN reads both operands transposed; which of the two products
    ``gᵀ x`` or ``(xᵀ g)ᵀ`` is faster depends on the shape: the one
    whose output rows are the narrower side, except that ``xᵀ g`` (then copied to the weight's layout)
    pays only for many tokens."""
    tokens, inner = x_rows.shape
    outer = grad_rows.shape[1]
    threshold = policy().min_macs_weight_grad if _ENABLED else None
    if threshold is None or tokens < 8 or tokens * inner * outer < threshold:
        return torch.mm(grad_rows.t(), x_rows)
    # dense rows first: oneDNN runs a transposed operand with a row stride of its own on its reference code,
    # orders of magnitude slower (a projection fed a slice of the qkv output)
    x_rows, grad_rows = x_rows.contiguous(), grad_rows.contiguous()
    if inner < outer and tokens >= 4 * inner:
        return _OP(x_rows.t(), grad_rows.t(), None, "none", [], "").t().contiguous()
    return _OP(grad_rows.t(), x_rows.t(), None, "none", [], "")


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not _ENABLED or capturing() or torch.is_autocast_enabled("cpu"):
        return False  # tracers and exporters see F.linear; autocast picks its own dtype
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if x.dim() < 1 or x.numel() == 0 or not _float32_weights(weight, bias):
        return False
    return x.shape[-1] == weight.shape[1]  # F.linear reports malformed calls in its own words


def _float32_weights(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    return bias is None or (bias.dtype == torch.float32 and bias.shape == weight.shape[:1])


def _linear_grads(grad_rows, x, weight, needs, has_bias, onednn=True):
    """Gradients of ``x Wᵀ + b`` from the output's gradient as rows: ``g W`` on oneDNN (MKL for a product too
    small for oneDNN to win, ``onednn=False``), ``gᵀ x`` by :func:`_weight_grad`, the bias's as the column
    sums."""
    grad_x = None
    if needs[0]:
        grad_rows_x = _OP(grad_rows, weight.t(), None, "none", [], "") if onednn else torch.mm(grad_rows, weight)
        grad_x = grad_rows_x.view(x.shape)
    grad_w = _weight_grad(grad_rows, x.reshape(-1, x.shape[-1])) if needs[1] else None
    grad_b = grad_rows.sum(0) if has_bias and needs[2] else None
    return grad_x, grad_w, grad_b


class _OnednnLinear(torch.autograd.Function):
    """``x Wᵀ + b`` on oneDNN, gradients from :func:`_linear_grads`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _OP(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return _linear_grads(grad.reshape(-1, grad.shape[-1]), x, weight, ctx.needs_input_grad, ctx.has_bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``activation(x Wᵀ + b)`` for ``x`` of shape (..., in_features), ``weight`` (out_features, in_features).

    ``activation`` is ``None`` or ``"gelu"`` (the exact, erf form of ``nn.GELU()``). Same result as
    ``F.linear`` (then ``F.gelu``) up to float32 rounding; see the module docstring for when oneDNN runs.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if _takes_onednn(x, weight, bias):
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        rows = x.numel() // x.shape[-1]
        if not needs_grad:
            if activation is not None:  # the fused GELU saves a pass over the output at any size
                return _OP(x, weight, bias, activation, [], "none")
            if _prefers_onednn(rows, weight.shape[1], weight.shape[0]):
                return _OP(x, weight, bias, "none", [], "")
        else:
            onednn = _prefers_onednn(rows, weight.shape[1], weight.shape[0])
            if activation is None:
                if onednn:
                    return _OnednnLinear.apply(x, weight, bias)
            elif (kernels := _gelu_kernels()) is not None:  # GELU's backward folded away at any size
                return _LinearGelu.apply(x, weight, bias, kernels, onednn)
            elif onednn:
                return F.gelu(_OnednnLinear.apply(x, weight, bias))
    out = F.linear(x, weight, bias)
    return F.gelu(out) if activation is not None else out


def _gelu_kernels():
    """The native module if it has the GELU-with-slope kernel (an older cached build may not)."""
    kernels = native_kernels()
    return kernels if kernels is not None and hasattr(kernels, "gelu_with_slope") else None


class _Gelu(torch.autograd.Function):
    """GELU whose forward pass also writes its slope (one native pass, one ``exp`` for both), so that the
    backward is one multiply instead of torch's ``gelu_backward``, which evaluates ``exp`` and ``erf`` again."""

    @staticmethod
    def forward(ctx, x, kernels):
        out, slope = kernels.gelu_with_slope(x, in_place=False)
        ctx.save_for_backward(slope)
        return out

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x)`` (the exact, erf form). With gradients on a contiguous or channels-last float CPU tensor and
    the native kernels built, the forward also keeps GELU's slope for a one-multiply backward (:class:`_Gelu`);
    elsewhere it is ``F.gelu``."""
    if capturing():  # first: under FX, x is a proxy
        return F.gelu(x)
    if (torch.is_grad_enabled() and x.requires_grad and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled("cpu")
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))):
        kernels = _gelu_kernels()
        if kernels is not None:
            return _Gelu.apply(x, kernels)
    return F.gelu(x)


class _LinearGelu(torch.autograd.Function):
    """``GELU(x Wᵀ + b)`` with the slope of GELU written over the pre-activation in the forward's GELU pass,
    so that the backward multiplies by it instead of evaluating ``exp`` and ``erf`` again. The products run
    on oneDNN, or on MKL (``onednn=False``) where they are too small for oneDNN to win."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernels, onednn):
        hidden = _OP(x, weight, bias, "none", [], "") if onednn else F.linear(x, weight, bias)
        (activated,) = kernels.gelu_with_slope(hidden, in_place=True)
        ctx.save_for_backward(x, weight, hidden)
        ctx.has_bias, ctx.onednn = bias is not None, onednn
        return activated

    @staticmethod
    def backward(ctx, grad):
        x, weight, slope = ctx.saved_tensors
        grad_rows = (grad * slope).reshape(-1, slope.shape[-1])
        return *_linear_grads(grad_rows, x, weight, ctx.needs_input_grad, ctx.has_bias, ctx.onednn), None, None


class _OnednnMlp(torch.autograd.Function):
    """``GELU(x W1ᵀ + b1) W2ᵀ + b2`` with gradients, GELU's backward folded into the products.

    The forward's GELU pass also writes GELU's slope over the pre-activation it no longer needs (native
    kernel), and the backward multiplies by it inside the product that forms the hidden gradient
    (oneDNN's binary post-op): no ``gelu_backward`` pass, which costs more than the forward GELU
    (``exp`` and ``erf`` again). Saves the same two hidden-sized tensors as the unfused modules.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, kernels):
        hidden = _OP(x, w1, b1, "none", [], "")
        (activated,) = kernels.gelu_with_slope(hidden, in_place=True)  # hidden now holds the slope
        ctx.save_for_backward(x, w1, w2, activated, hidden)
        ctx.has_bias = b1 is not None, b2 is not None
        return _OP(activated, w2, b2, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2, activated, slope = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        activated, slope = activated.view(-1, activated.shape[-1]), slope.view(-1, slope.shape[-1])
        grad_w2 = _weight_grad(grad_rows, activated) if needs[3] else None
        grad_b2 = grad_rows.sum(0) if ctx.has_bias[1] and needs[4] else None
        grad_x = grad_w1 = grad_b1 = None
        if needs[0] or needs[1] or needs[2]:
            grad_hidden = _OP_BINARY(grad_rows, slope, w2.t(), None, "mul")
            grad_x, grad_w1, grad_b1 = _linear_grads(grad_hidden, x, w1, needs, ctx.has_bias[0])
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
        b2: torch.Tensor | None) -> torch.Tensor:
    """``linear(GELU(linear(x, w1, b1)), w2, b2)``, the transformer MLP (erf GELU, no dropout).

    Without gradients GELU is fused into the first product; with gradients, where both products run on
    oneDNN and the native kernels are built, GELU's backward is folded into the products
    (:class:`_OnednnMlp`). Elsewhere it is the two :func:`linear` calls.
    """
    if (_takes_onednn(x, w1, b1) and _float32_weights(w2, b2) and w2.shape[1] == w1.shape[0]  # tracers: False
            and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w1, b1, w2, b2))):
        rows = x.numel() // x.shape[-1]
        kernels = _gelu_kernels()
        if (kernels is not None and _prefers_onednn(rows, w1.shape[1], w1.shape[0])
                and _prefers_onednn(rows, w2.shape[1], w2.shape[0])):
            return _OnednnMlp.apply(x, w1, b1, w2, b2, kernels)
    return linear(linear(x, w1, b1, activation="gelu"), w2, b2)


class _GeluLinear(torch.autograd.Function):
    """``GELU(h) Wᵀ + b`` with gradients: GELU and its slope in one native pass (the slope saved instead of
    ``h``), and GELU's backward folded into the product that forms ``h``'s gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, kernels):
        activated, slope = kernels.gelu_with_slope(hidden, in_place=False)
        ctx.save_for_backward(activated, slope, weight)
        ctx.has_bias = bias is not None
        return _OP(activated, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        activated, slope, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_h = grad_w = grad_b = None
        if needs[0]:
            grad_h = _OP_BINARY(grad_rows, slope.view(-1, slope.shape[-1]), weight.t(), None, "mul").view(slope.shape)
        if needs[1]:
            grad_w = _weight_grad(grad_rows, activated.view(-1, activated.shape[-1]))
        if ctx.has_bias and needs[2]:
            grad_b = grad_rows.sum(0)
        return grad_h, grad_w, grad_b, None


def gelu_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(GELU(hidden), weight, bias)`` (erf GELU): with gradients on a contiguous float32 ``hidden``, where
    the product runs on oneDNN and the native kernels are built, GELU's backward is folded into the products
    (:class:`_GeluLinear`); otherwise GELU and :func:`linear`."""
    if (_takes_onednn(hidden, weight, bias) and hidden.is_contiguous() and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        kernels = _gelu_kernels()
        rows = hidden.numel() // hidden.shape[-1]
        if kernels is not None and _prefers_onednn(rows, weight.shape[1], weight.shape[0]):
            return _GeluLinear.apply(hidden, weight, bias, kernels)
    return linear(F.gelu(hidden), weight, bias)
