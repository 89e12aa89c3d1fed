"""Attention transfer: each Pola layer of the converted student learns to give the output its softmax layer gives in
the frozen teacher, on the teacher's own inputs to that layer, all layers at once (as LoLCATs and Hedgehog
linearise language models).

The teacher runs once per batch; forward hooks keep the input and output of each matched module (the attention,
or for Swin and DiT the whole block: see :data:`~.weights.FAMILIES`). The student then runs with each matched
module's input replaced by the teacher's, so no layer sees its predecessors' errors, and the loss is the mean over
layers of the mean squared difference of the outputs.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .weights import ConversionError, ConversionReport, Family

__all__ = ["AttentionTransfer", "freeze_for_transfer"]


def _tensors_alike(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.numel() == b.numel()


def _matched(model: nn.Module, pattern: str) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if re.fullmatch(pattern, name)]


class AttentionTransfer:
    """The transfer loss of ``student`` against ``teacher`` (:meth:`loss`); :meth:`remove` takes the hooks off."""

    def __init__(self, teacher: nn.Module, student: nn.Module, family: Family):
        teacher_modules = _matched(teacher, family.teacher_modules)
        student_modules = _matched(student, family.student_modules)
        if not teacher_modules or len(teacher_modules) != len(student_modules):
            raise ConversionError(f"the teacher has {len(teacher_modules)} layers to match, the student "
                                  f"{len(student_modules)}")
        self.teacher, self.student = teacher, student
        self._inputs: list[tuple | None] = [None] * len(teacher_modules)
        self._targets: list[torch.Tensor | None] = [None] * len(teacher_modules)
        self._outputs: list[torch.Tensor | None] = [None] * len(teacher_modules)
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
        return hook

    def loss(self, *inputs, student: nn.Module | None = None) -> torch.Tensor:
        """Mean over the matched layers of the MSE between the student's and the teacher's outputs on ``inputs``
        (the models' forward arguments); ``student``: the module to run (a DDP wrapper of the student)."""
        self._active = True
        try:
            with torch.no_grad():
                self.teacher(*inputs)
            (student or self.student)(*inputs)
            losses = [F.mse_loss(out.float().reshape(target.shape), target.float())
                      for out, target in zip(self._outputs, self._targets)]
        finally:
            self._active = False
            self._inputs = [None] * len(self._inputs)
            self._targets = [None] * len(self._targets)
            self._outputs = [None] * len(self._outputs)
        return torch.stack(losses).mean()

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
