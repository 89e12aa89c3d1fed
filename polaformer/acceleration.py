"""``accelerate(model)``: the CPU speed-ups of whole modules, applied to a plain model in one explicit step.

The model files are written with plain modules (``nn.Linear``, timm's ``Mlp``, ``nn.Conv2d`` +
``nn.BatchNorm2d``, the attention layers). :func:`accelerate` changes the class of each module it knows
to a subclass whose ``forward`` computes the same function with the fused CPU kernels of
:mod:`polaformer.backends.cpu` (oneDNN products, fused convolutions, the native kernels). It stands above the
models, whose module types it knows; the kernels stand below the ops. Parameters, buffers, hooks and state_dict keys are
untouched, so a state_dict moves freely between an accelerated model and a plain one, and the optimizer
may be built before or after. Each fast ``forward`` falls back to the plain one where its kernels do
not apply (graph capture, autocast, other devices or dtypes), so an accelerated model is never wrong,
only sometimes not faster.

``accelerate(model, inference=True)`` also folds every eval-mode BatchNorm into the convolution before
it (timm's ``reparameterize_model`` idea): the model then has fewer modules and other state_dict keys,
and is meant for evaluation and deployment only. Load weights before folding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from .backends.cpu.conv import (
    conv2d_gelu,
    depthwise_conv2d,
    depthwise_conv_gelu_linear,
    fold_batch_norm,
    plus_depthwise_conv,
)
from .backends.cpu.onednn import gelu, linear, mlp
from .capture import capturing
from .layers import PacsLinearAttention, PolaLinearAttention, RopeSoftmaxAttention
from .models.polapp import ConvFFN, ConvStem, PatchMerging, PolaPPBlock
from .models.pvt_v2 import DepthwiseConvMlp
from .ops import tokens_to_map
from .ops.dispatch import cpu_kernels

__all__ = ["accelerate", "fold_conv_batch_norm"]


class OnednnLinear(nn.Linear):
    """``nn.Linear`` on oneDNN's matmul where that is faster (:func:`polaformer.backends.cpu.onednn.linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GeluWithSlope(nn.GELU):
    """Exact GELU that keeps its slope for a one-multiply backward (:func:`polaformer.backends.cpu.onednn.gelu`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x) if self.approximate == "none" else super().forward(x)


class PointwiseConv2d(nn.Conv2d):
    """A 1×1 conv as a product over channels (the same sums); the output is channels-last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.permute(0, 2, 3, 1), self.weight.flatten(1), self.bias).permute(0, 3, 1, 2)


def _unhooked(*modules: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class FusedMlp(Mlp):
    """timm's ``Mlp`` with GELU fused into fc1's product, or its backward folded into the products
    (:func:`polaformer.backends.cpu.onednn.mlp`), while the MLP is the plain fc1 -> exact GELU -> fc2 with no active
    dropout and no hooks on its parts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act, fc1, fc2 = self.act, self.fc1, self.fc2
        no_dropout = not self.training or (self.drop1.p == 0 and self.drop2.p == 0)
        if (isinstance(act, nn.GELU) and act.approximate == "none" and type(self.norm) is nn.Identity
                and isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and no_dropout
                and _unhooked(act, fc1, fc2)):
            return mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        return super().forward(x)


class FusedDepthwiseConvMlp(DepthwiseConvMlp):
    """PVTv2's MLP with GELU fused into oneDNN's conv, or its backward folded into fc2's products."""

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if not (isinstance(self.act, nn.GELU) and self.act.approximate == "none" and isinstance(self.fc2, nn.Linear)
                and _unhooked(self.act, self.fc2)):
            return super().forward(x, height, width)
        grid = tokens_to_map(self.fc1(x), height, width)
        return depthwise_conv_gelu_linear(grid, self.dwconv.weight, self.dwconv.bias, self.fc2.weight, self.fc2.bias)


def _plus_conv(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``x + conv(x)`` for a "same" depthwise ``conv`` as one convolution (the identity in its centre tap)."""
    return plus_depthwise_conv(x, conv.weight, conv.bias, conv.kernel_size[0], conv.groups)


class FusedConvFFN(ConvFFN):
    """PolaFormer++'s conv FFN with GELU fused into fc1 and ``h + dwconv(h)`` as one convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (isinstance(self.act, nn.GELU) and self.act.approximate == "none" and isinstance(self.fc1, nn.Linear)
                and _unhooked(self.act, self.dwconv)):
            return super().forward(x)
        b, c, h, w = x.shape
        hidden = linear(x.flatten(2).transpose(1, 2), self.fc1.weight, self.fc1.bias, activation="gelu")
        hidden = _plus_conv(tokens_to_map(hidden, h, w), self.dwconv)
        return tokens_to_map(self.fc2(hidden.flatten(2).transpose(1, 2)), h, w)


class FusedPolaPPBlock(PolaPPBlock):
    """PolaFormer++'s block with ``x + pos(x)`` as one convolution."""

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        if not _unhooked(self.pos):
            return super().forward(x, sin, cos)
        x = _plus_conv(x, self.pos)
        attn = self.attn(self.norm1(x), sin, cos)
        x = x + self.drop_path(attn if self.gamma_1 is None else self.gamma_1 * attn)
        ffn = self.ffn(self.norm2(x))
        return x + self.drop_path(ffn if self.gamma_2 is None else self.gamma_2 * ffn)


class ChannelsLastConvStem(ConvStem):
    """PolaFormer++'s stem on a channels-last input, so that the whole trunk runs channels-last (the token
    permutes become views, and oneDNN's depthwise convs take their channels-last kernels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.contiguous(memory_format=torch.channels_last))


def _add_and_gate(out: torch.Tensor, local: torch.Tensor, gate: torch.Tensor, prefix: int) -> torch.Tensor:
    """``(out + local) · gate``, in place on the attention's fresh output where autograd is not involved."""
    if not (out.requires_grad or local.requires_grad or gate.requires_grad):
        (out[:, prefix:] if prefix else out).add_(local)
        return out.mul_(gate)
    if prefix:
        return torch.cat([out[:, :prefix], out[:, prefix:] + local], dim=1) * gate
    return (out + local) * gate


def _one_pass_kernels(out, v, g, weight, bias):
    """The native kernels if ``(out + dwconv(v)) · g`` can run as one pass: no gradient wanted, CPU float
    tensors of one dtype, a contiguous ``out`` (the attention op's fresh output), ``v`` and ``g`` with a unit
    channel stride (rows where the projection wrote them)."""
    tensors = (out, v, g, weight, bias)
    if (bias is None or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or any(t.dtype != out.dtype for t in tensors) or not out.is_contiguous()
            or v.stride(-1) != 1 or g.stride(-1) != 1):
        return None
    return cpu_kernels(out)


def _local_branch_and_gate(out, v, g, weight, bias, prefix, height, width):
    """``(out + depthwise_conv(v)) · g`` on the grid tokens after ``prefix``, ``weight`` (C, 1, K, K) over all
    channels: one native pass without gradients, else the conv on a channels-last map of ``v``."""
    k = weight.shape[-1]
    kernels = _one_pass_kernels(out, v, g, weight, bias)
    if kernels is not None:
        taps = weight.view(weight.shape[0], k * k).t().contiguous()
        kernels.dwconv_add_gate(out, v, g, taps, bias, prefix, height, width, k)
        return out
    grid = tokens_to_map(v[:, prefix:], height, width).contiguous(memory_format=torch.channels_last)
    local = depthwise_conv2d(grid, weight, bias).flatten(2).transpose(1, 2)
    return _add_and_gate(out, local, g, prefix)


class FusedPolaLinearAttention(PolaLinearAttention):
    """PolaFormer's attention with the local branch and gate fused: the heads' shared ``dwc`` as one
    depthwise conv over all channels (its kernel repeated per head), in one native pass without gradients."""

    def _fusable(self, g, tokens: int, values: int) -> bool:
        # ablated layers (no dwc or gate) and spatially reduced values take the plain path
        return (self.local == "dwc" and g is not None and values == tokens and self.dwc.bias is not None
                and not capturing() and _unhooked(self.dwc))

    def attend(self, q, k, v, g, height, width):
        if not self._fusable(g, q.shape[1], v.shape[1]):
            return super().attend(q, k, v, g, height, width)
        return self.local_branch_and_gate(self.attention(q, k, v, height, width), v, g, height, width)

    def local_branch_and_gate(self, out, v, g, height, width):
        if not self._fusable(g, out.shape[1], v.shape[1]):
            return super().local_branch_and_gate(out, v, g, height, width)
        heads = self.num_heads
        weight, bias = torch.cat([self.dwc.weight] * heads), torch.cat([self.dwc.bias] * heads)
        return _local_branch_and_gate(out, v, g, weight, bias, self.num_prefix_tokens, height, width)


class FusedLePEMixin:
    """PolaFormer++'s ``(out + lepe(v)) · gate`` in one native pass without gradients."""

    def _fusable(self) -> bool:
        return self.lepe.bias is not None and not capturing() and _unhooked(self.lepe)

    def local_branch_and_gate(self, out, v, gate, height, width):
        if not self._fusable():
            return super().local_branch_and_gate(out, v, gate, height, width)
        return _local_branch_and_gate(out, v, gate, self.lepe.weight, self.lepe.bias, 0, height, width)


class FusedPacsLinearAttention(FusedLePEMixin, PacsLinearAttention):
    def attend(self, q, k, v, g, height, width, sin=None, cos=None):
        if not self._fusable():
            return super().attend(q, k, v, g, height, width, sin, cos)
        return self.local_branch_and_gate(self.attention(q, k, v, sin, cos), v, g, height, width)


class FusedRopeSoftmaxAttention(FusedLePEMixin, RopeSoftmaxAttention):
    pass


_SWAPS = {
    nn.Linear: OnednnLinear,
    nn.GELU: GeluWithSlope,
    Mlp: FusedMlp,
    DepthwiseConvMlp: FusedDepthwiseConvMlp,
    ConvFFN: FusedConvFFN,
    PolaPPBlock: FusedPolaPPBlock,
    ConvStem: ChannelsLastConvStem,
    PolaLinearAttention: FusedPolaLinearAttention,
    PacsLinearAttention: FusedPacsLinearAttention,
    RopeSoftmaxAttention: FusedRopeSoftmaxAttention,
}


def _is_pointwise(m: nn.Module) -> bool:
    return (type(m) is nn.Conv2d and m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0)
            and m.dilation == (1, 1) and m.groups == 1)


class FoldedConv2d(nn.Conv2d):
    """A conv with the eval-mode BatchNorm after it folded in, and an optional exact GELU after both, fused
    into oneDNN's convolution on channels-last maps (:func:`polaformer.backends.cpu.conv.conv2d_gelu`)."""

    apply_gelu: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros" or self.dilation != (1, 1) or self.groups != 1 or isinstance(self.padding, str):
            out = super().forward(x)
            return F.gelu(out) if self.apply_gelu else out
        return conv2d_gelu(x, self.weight, self.bias, self.stride, self.padding, self.apply_gelu)


def fold_conv_batch_norm(conv: nn.Conv2d, bn: nn.BatchNorm2d, gelu_after: bool = False) -> FoldedConv2d:
    """A :class:`FoldedConv2d` computing ``bn(conv(x))`` (then GELU if ``gelu_after``) with ``bn`` in eval mode."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("cannot fold a BatchNorm without running statistics into its conv")
    folded = FoldedConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                          conv.dilation, conv.groups, bias=True, padding_mode=conv.padding_mode,
                          device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        weight, bias = fold_batch_norm(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                       bn.eps)
    folded.weight, folded.bias = nn.Parameter(weight), nn.Parameter(bias)  # the weight stays channels-last
    folded.apply_gelu = gelu_after
    return folded.eval()


def _exact_gelu(m: nn.Module) -> bool:
    return isinstance(m, nn.GELU) and m.approximate == "none"


def _fold_stem(stem: ConvStem) -> None:
    mods = list(stem.proj)
    for i in range(0, len(mods) - 1):
        conv, bn = mods[i], mods[i + 1]
        if type(conv) is nn.Conv2d and type(bn) is nn.BatchNorm2d:
            gelu_after = i + 2 < len(mods) and _exact_gelu(mods[i + 2])
            stem.proj[i] = fold_conv_batch_norm(conv, bn, gelu_after)
            stem.proj[i + 1] = nn.Identity()
            if gelu_after:
                stem.proj[i + 2] = nn.Identity()


def _fold(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, ConvStem):
            _fold_stem(m)
        elif isinstance(m, PatchMerging) and type(m.reduction) is nn.Conv2d and type(m.norm) is nn.BatchNorm2d:
            m.reduction = fold_conv_batch_norm(m.reduction, m.norm)
            m.norm = nn.Identity()


def accelerate(model: nn.Module, inference: bool = False) -> nn.Module:
    """Swap ``model``'s modules, in place, for their fused CPU versions (see the module docstring); returns it.

    With ``inference=True`` the model must be in eval mode, and its conv + BatchNorm pairs are folded into
    single convs (other state_dict keys; for evaluation and deployment only).
    """
    if inference:
        if model.training:
            raise ValueError("accelerate(model, inference=True) folds BatchNorm statistics: call model.eval() first")
        _fold(model)
    for m in model.modules():
        fast = _SWAPS.get(type(m))
        if fast is not None:
            m.__class__ = fast
        elif _is_pointwise(m):
            m.__class__ = PointwiseConv2d
    return model
