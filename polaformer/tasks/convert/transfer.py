"""Attention transfer: each Pola layer of the converted student learns to give the output its softmax layer gives in
the frozen teacher, on the teacher's own inputs to that layer, all layers at once (output matching, as LoLCATs
linearises language models). Optionally, where the sequence is short enough to form them, the Pola layer's
normalised attention weights also learn the teacher's softmax weights by cross-entropy (Hedgehog's loss).

The teacher runs once per batch; forward hooks keep the input and output of each matched module (the attention,
or for Swin and DiT the whole block: see :data:`~.weights.FAMILIES`). The student then runs with each matched
module's input replaced by the teacher's, so no layer sees its predecessors' errors. Each layer's loss is the mean
squared difference of the outputs (plus ``attention_weight`` times the cross-entropy of the weights); the loss
trained is the mean over layers, and each layer's is kept (:meth:`AttentionTransfer.layer_losses`).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ...ops import learnable_power, pola_attention_weights
from .weights import ConversionError, ConversionReport, Family

__all__ = ["MAX_WEIGHT_TOKENS", "AttentionTransfer", "freeze_for_transfer", "pola_weights", "softmax_weights"]

# the attention-weight loss forms (batch, heads, N, N) matrices per layer: sequences up to this long
MAX_WEIGHT_TOKENS = 512
WEIGHT_FAMILIES = ("deit", "lm")  # attention layers matched one to one, keys the queries' tokens
_FLOOR = 1e-12  # log of a Pola weight (a power of a ReLU: exactly 0 where a feature is) stays finite


def softmax_weights(attention: nn.Module, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """(B, H, N, N) softmax weights of a softmax attention module with a fused ``qkv`` projection (timm's
    ``Attention``, :class:`~polaformer.layers.SoftmaxCausalSelfAttention`) on its input ``x`` (B, N, C)."""
    b, n, _ = x.shape
    heads = attention.num_heads
    q, k, _ = attention.qkv(x).reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = getattr(attention, "q_norm", nn.Identity())(q), getattr(attention, "k_norm", nn.Identity())(k)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    return scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # float32 at least


def pola_weights(attention: nn.Module, x: torch.Tensor, *grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same-sign and opposite-sign (B, H, N, M) weights of a Pola attention layer on its input ``x``:
    :class:`~polaformer.layers.PolaLinearAttention` (with its ``height, width``) or
    :class:`~polaformer.layers.PolaCausalSelfAttention`, from :func:`polaformer.ops.pola_attention_weights`."""
    if grid:  # the vision layer: q and k as its forward makes them (scale, key positions)
        from ...analysis.attention_maps import layer_features

        features = layer_features(attention, x, *grid)
        return pola_attention_weights(features.q, features.k, features.power)
    b, n, _ = x.shape
    heads = attention.num_heads
    q = attention.qg(x).chunk(2, dim=-1)[0].reshape(b, n, heads, -1).transpose(1, 2)
    k = attention.kv(x).chunk(2, dim=-1)[0].reshape(b, n, heads, -1).transpose(1, 2)
    scale = F.softplus(attention.scale)
    return pola_attention_weights(q / scale, k / scale, learnable_power(attention.power, attention.alpha),
                                  attention.eps, causal=True)


def weight_cross_entropy(teacher: torch.Tensor, student: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over queries (and the Pola layer's streams, each of which the teacher's weights should give) of
    ``−Σ_keys teacher · log student``."""
    return torch.stack([-(teacher * w.float().clamp_min(_FLOOR).log()).sum(-1).mean() for w in student]).mean()


def _tensors_alike(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.numel() == b.numel()


def _matched(model: nn.Module, pattern: str) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if re.fullmatch(pattern, name)]


class AttentionTransfer:
    """The transfer loss of ``student`` against ``teacher`` (:meth:`loss`, :meth:`layer_losses`), with
    ``attention_weight`` times the attention-weight cross-entropy added to each layer's (0: outputs only; the deit
    and lm pairs, sequences up to :data:`MAX_WEIGHT_TOKENS`); :meth:`remove` takes the hooks off."""

    def __init__(self, teacher: nn.Module, student: nn.Module, family: Family, attention_weight: float = 0.0):
        teacher_modules = _matched(teacher, family.teacher_modules)
        student_modules = _matched(student, family.student_modules)
        if not teacher_modules or len(teacher_modules) != len(student_modules):
            raise ConversionError(f"the teacher has {len(teacher_modules)} layers to match, the student "
                                  f"{len(student_modules)}")
        if attention_weight and family.name not in WEIGHT_FAMILIES:
            raise ConversionError(f"the attention-weight loss needs attention layers matched one to one with the "
                                  f"same keys ({', '.join(WEIGHT_FAMILIES)} sources); {family.name} is not")
        self.teacher, self.student = teacher, student
        self.attention_weight, self.causal = attention_weight, family.name == "lm"
        layers = len(teacher_modules)
        self._inputs: list[tuple | None] = [None] * layers
        self._targets: list[torch.Tensor | None] = [None] * layers
        self._outputs: list[torch.Tensor | None] = [None] * layers
        self._teacher_weights: list[torch.Tensor | None] = [None] * layers
        self._student_weights: list[tuple | None] = [None] * layers
        self._active = False
        self._handles = []
        for i, (t, s) in enumerate(zip(teacher_modules, student_modules)):
            self._handles.append(t.register_forward_hook(self._keep_teacher(i)))
            self._handles.append(s.register_forward_pre_hook(self._feed_student(i)))
            self._handles.append(s.register_forward_hook(self._keep_student(i)))

    def _keep_teacher(self, i):
        def hook(module, args, output):
            if self._active:
                self._inputs[i], self._targets[i] = args, output
                if self.attention_weight:
                    x = args[0]
                    if x.shape[1] > MAX_WEIGHT_TOKENS:
                        raise ConversionError(f"the attention-weight loss forms N x N weights: {x.shape[1]} tokens "
                                              f"are more than {MAX_WEIGHT_TOKENS} (set transfer.attention_weight 0)")
                    self._teacher_weights[i] = softmax_weights(module, x, self.causal)
        return hook

    def _feed_student(self, i):
        def hook(module, args):
            if not self._active:
                return None
            # the teacher's tensors in the student's layout; other arguments (a grid's height and width) the
            # student's own (DiT's condition is the teacher's too: the student's would see label dropout)
            return tuple(t.reshape(s.shape) if _tensors_alike(t, s) else s
                         for t, s in zip(self._inputs[i], args)) + tuple(args[len(self._inputs[i]):])
        return hook

    def _keep_student(self, i):
        def hook(module, args, output):
            if self._active:
                self._outputs[i] = output
                if self.attention_weight:
                    self._student_weights[i] = pola_weights(module, *args)
        return hook

    def layer_losses(self, *inputs, student: nn.Module | None = None) -> torch.Tensor:
        """Each matched layer's loss on ``inputs`` (the models' forward arguments), (layers,): the MSE between
        the student's and the teacher's outputs, plus ``attention_weight`` times the weights' cross-entropy;
        ``student``: the module to run (a DDP wrapper of the student)."""
        self._active = True
        try:
            with torch.no_grad():
                self.teacher(*inputs)
            (student or self.student)(*inputs)
            losses = [F.mse_loss(out.float().reshape(target.shape), target.float())
                      for out, target in zip(self._outputs, self._targets)]
            if self.attention_weight:
                losses = [loss + self.attention_weight * weight_cross_entropy(t, s)
                          for loss, t, s in zip(losses, self._teacher_weights, self._student_weights)]
        finally:
            self._active = False
            for kept in (self._inputs, self._targets, self._outputs, self._teacher_weights, self._student_weights):
                kept[:] = [None] * len(kept)
        return torch.stack(losses)

    def loss(self, *inputs, student: nn.Module | None = None) -> torch.Tensor:
        """The mean over layers of :meth:`layer_losses`."""
        return self.layer_losses(*inputs, student=student).mean()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def freeze_for_transfer(student: nn.Module, report: ConversionReport, train_qk: bool = False) -> list[str]:
    """Leave trainable only what the conversion made new (and, with ``train_qk``, the rows the teacher's q and k
    projections filled): other parameters are frozen, and a tensor trained only in some rows (the gate rows of
    ``qkvg``) gets a gradient mask, so its copied rows stay exactly the teacher's (with no weight decay).
    Returns the names of the trained tensors."""
    rows = {key: list(spans) for key, spans in report.new_rows.items()}
    if train_qk:
        for key, spans in report.qk_rows.items():
            rows.setdefault(key, []).extend(spans)
    trained = []
    for name, param in student.named_parameters():
        spans = rows.get(name)
        param.requires_grad_(bool(spans))
        if not spans:
            continue
        trained.append(name)
        if spans != [(0, len(param))]:
            mask = torch.zeros_like(param)
            for start, end in spans:
                mask[start:end] = 1
            param.register_hook(lambda grad, mask=mask: grad * mask.to(grad.device))
    return trained
