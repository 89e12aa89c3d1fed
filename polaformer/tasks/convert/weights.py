"""Softmax → Pola weight conversion: which weight of a trained softmax model becomes which weight of its Pola
counterpart, what the Pola model has that the softmax one lacks, and how those new parts start.

Five pairs (:data:`FAMILIES`, found from the source model's class): timm's ``VisionTransformer`` (DeiT) →
``PolaDeiT``, timm's ``SwinTransformer`` → ``PolaSwinTransformer``, timm's ``PyramidVisionTransformerV2`` →
``PolaPVTv2``, ``PolaDiT(attention="softmax")`` → PolaDiT (PaCS), ``PolaLM(attention="softmax")`` → ``pola_lm``.
Each pair's map is a function of a source key: the target keys it fills (a fused ``qkv`` split by rows into the
Pola layer's ``qkvg`` / ``qg`` + ``kv``), or the reason it has no counterpart. Every other weight keeps its name.

The new parts start so that the converted layer is the teacher's projections around a linear attention:
the gate rows give a gate of 1 (weights 0, bias 1), the local branch (``dwc``, ``lepe``) starts at 0, power,
temperature and key positions keep the Pola model's own initial values. The gate needs its bias: a source without
q/k/v biases gets a target built with them (:func:`~.build.target_of`), zero where the source has none (the same
map), and a target without a gate bias is refused (its gate would be 0 and silence every attention branch). A
source weight the target cannot take (no counterpart, another shape) is a :class:`ConversionError`, never skipped.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ...engine.factory import ModelBuildError

__all__ = ["FAMILIES", "TARGETS", "ConversionError", "ConversionReport", "convert_state_dict", "family_of"]


class ConversionError(ModelBuildError):
    """The source weights do not fit the target model (one line)."""


# (target key, part, parts, role): the source fills rows [part/parts, (part+1)/parts) of the target; role "q",
# "k", "v" for attention projections, else ""
Part = tuple[str, int, int, str]


def _fused_qkv(key: str, target: str, names: set[str]) -> list[Part] | None:
    """``….attn.qkv.X`` into the rows q, k, v of ``….attn.TARGET.X`` (the gate rows stay new)."""
    m = re.fullmatch(r"(.*\.attn)\.qkv\.(weight|bias)", key)
    if not m:
        return None
    prefix, leaf = m.groups()
    if f"{prefix}.qkv.{leaf}" in names:  # a softmax block of the target (Swin's later stages)
        return [(key, 0, 1, "")]
    if target == "qkvg":
        return [(f"{prefix}.qkvg.{leaf}", i, 4, role) for i, role in enumerate("qkv")]
    return [(f"{prefix}.qg.{leaf}", 0, 2, "q"), (f"{prefix}.kv.{leaf}", 0, 2, "k"), (f"{prefix}.kv.{leaf}", 1, 2, "v")]


def _map_qkvg(key: str, names: set[str]) -> list[Part] | str:
    return _fused_qkv(key, "qkvg", names) or [(key, 0, 1, "")]


def _map_lm(key: str, names: set[str]) -> list[Part] | str:
    return _fused_qkv(key, "qg+kv", names) or [(key, 0, 1, "")]


def _map_swin(key: str, names: set[str]) -> list[Part] | str:
    m = re.fullmatch(r"layers\.(\d+)\.downsample\.(.*)", key)
    if m:  # timm merges patches at the start of a stage, the official Swin at the end of the one before
        return [(f"layers.{int(m.group(1)) - 1}.downsample.{m.group(2)}", 0, 1, "")]
    if key.startswith("head.fc."):
        return [(key.replace("head.fc.", "head.", 1), 0, 1, "")]
    if key.endswith(".attn.relative_position_bias_table") and key not in names:
        return "a linear-attention block has no relative position bias"
    return _fused_qkv(key, "qkvg", names) or [(key, 0, 1, "")]


def _map_pvt_v2(key: str, names: set[str]) -> list[Part] | str:
    if key.startswith("patch_embed."):
        return [(key.replace("patch_embed.", "patch_embed1.", 1), 0, 1, "")]
    m = re.fullmatch(r"stages\.(\d+)\.(downsample|norm)\.(.*)", key)
    if m:
        stage, part, rest = int(m.group(1)) + 1, m.group(2), m.group(3)
        return [(f"patch_embed{stage}.{rest}" if part == "downsample" else f"norm{stage}.{rest}", 0, 1, "")]
    m = re.fullmatch(r"stages\.(\d+)\.blocks\.(\d+)\.(.*)", key)
    if not m:
        return [(key, 0, 1, "")]
    name = f"block{int(m.group(1)) + 1}.{m.group(2)}.{m.group(3)}"
    if re.fullmatch(r".*\.attn\.(sr|norm)\.(weight|bias)", name) and name not in names:
        return "the Pola-PVTv2 blocks reduce no keys (sr 1): no spatial-reduction conv"
    if name.endswith((".attn.q.weight", ".attn.q.bias")):
        return [(name.replace(".attn.q.", ".attn.qg."), 0, 2, "q")]
    if name.endswith((".attn.kv.weight", ".attn.kv.bias")):
        return [(name, 0, 2, "k"), (name, 1, 2, "v")]
    return [(name, 0, 1, "")]


@dataclass(frozen=True)
class Family:
    """One softmax → Pola pair: the map of source keys, and the modules whose outputs the transfer stage
    matches (regular expressions on module names, teacher's and student's, paired in order)."""

    name: str
    map_key: Callable[[str, set[str]], list[Part] | str]
    teacher_modules: str
    student_modules: str
    shared_kwargs: tuple[str, ...]  # source model arguments the target takes under the same name
    # the target argument that gives its projections (and so its gate) a bias, dotted for a nested one; empty:
    # the target always has them
    bias_kwarg: str = "qkv_bias"


_VIT_KWARGS = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
               "qkv_bias", "global_pool")
FAMILIES = {
    "deit": Family("deit", _map_qkvg, r"blocks\.\d+\.attn", r"blocks\.\d+\.attn", _VIT_KWARGS),
    # Swin's windows differ (softmax 7x7, Pola global), so whole blocks are matched, given the teacher's input
    "swin": Family("swin", _map_swin, r"layers\.\d+\.blocks\.\d+", r"layers\.\d+\.blocks\.\d+",
                   ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depths", "num_heads",
                    "mlp_ratio", "qkv_bias")),
    "pvt_v2": Family("pvt_v2", _map_pvt_v2, r"stages\.\d+\.blocks\.\d+\.attn", r"block\d+\.\d+\.attn",
                     ("img_size", "in_chans", "num_classes", "embed_dims", "depths", "num_heads", "mlp_ratios"), ""),
    # the PaCS layer reads maps, the softmax one tokens: whole blocks are matched
    "dit": Family("dit", _map_qkvg, r"blocks\.\d+", r"blocks\.\d+", (), ""),
    "lm": Family("lm", _map_lm, r"blocks\.\d+\.attn", r"blocks\.\d+\.attn", (), "attention_kwargs.qkv_bias"),
}
_CLASSES = {"VisionTransformer": "deit", "SwinTransformer": "swin", "PyramidVisionTransformerV2": "pvt_v2",
            "PolaDiT": "dit", "PolaLM": "lm"}
# timm names of softmax models -> their Pola counterparts (ours with attention="softmax": the same name)
TARGETS = {
    **{f"{kind}_{size}_patch16_224": f"pola_deit_{size}_patch16_224" for kind in ("deit", "vit")
       for size in ("tiny", "small", "base")},
    "swin_tiny_patch4_window7_224": "pola_swin_t", "swin_small_patch4_window7_224": "pola_swin_s",
    "swin_base_patch4_window7_224": "pola_swin_b",
    **{f"pvt_v2_b{i}": f"pola_pvt_v2_b{i}" for i in range(6)},
}
# the attention of the Pola counterpart of our own softmax variants
POLA_ATTENTION = {"dit": "pacs", "lm": "pola"}


def family_of(model: nn.Module) -> Family:
    """The pair a softmax source model belongs to; a Pola model or an unknown class is a :class:`ConversionError`."""
    name = _CLASSES.get(type(model).__name__)
    if name in POLA_ATTENTION and getattr(model, "attention", None) != "softmax":
        raise ConversionError(f"the source {type(model).__name__} has attention {model.attention!r}; "
                              "conversion starts from attention='softmax'")
    if name is None:
        raise ConversionError(f"no conversion from {type(model).__name__} (known: {', '.join(_CLASSES)})")
    return FAMILIES[name]


@dataclass
class ConversionReport:
    """What :func:`convert_state_dict` did: ``copied`` (target key -> source key with its rows), ``new``
    (target key -> how it was initialised), ``dropped`` (source key -> why it has no counterpart), and the rows of
    each target tensor that are new (``new_rows``) or the teacher's q and k (``qk_rows``)."""

    family: str
    copied: dict[str, str] = field(default_factory=dict)
    new: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    new_rows: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    qk_rows: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"family": self.family, "copied": self.copied, "new": self.new, "dropped": self.dropped}

    def lines(self) -> list[str]:
        """The report grouped by layer pattern (block numbers as N), one line per pattern."""
        out = []
        for title, entries in (("copied", self.copied), ("new", self.new), ("dropped", self.dropped)):
            groups: dict[tuple[str, str], int] = defaultdict(int)
            for key, note in entries.items():
                groups[(_layers_as_n(key), _layers_as_n(note))] += 1
            out.append(f"{title}: {len(entries)} tensors")
            out += [f"  {key} <- {note}" + (f" (x{count})" if count > 1 else "") for (key, note), count in
                    groups.items()]
        return out


def _layers_as_n(text: str) -> str:
    return re.sub(r"(?<=[.a-z])\d+(?=\.)", "N", text)


# what each new tensor starts as, in the report's words
GATE_WEIGHT = "gate rows: weight 0 (the gate is its bias)"
GATE_BIAS = "gate rows: bias 1 (gate 1, the output passes unchanged)"
ZERO_BIAS_ROWS = "the copied rows: bias 0 (the source has no bias: the same map)"
ZERO_BIAS = "bias 0 (the source has no bias: the same map)"
LOCAL_ZEROS = "local branch: zeros (adds nothing at first)"


def gate_rows(key: str, rows: int) -> tuple[int, int] | None:
    """The rows of target tensor ``key`` (``rows`` long) that compute the gate: the last quarter of ``qkvg``, the
    last half of ``qg``; None for another tensor."""
    parent = key.split(".")[-2] if "." in key else ""
    return {"qkvg": (rows * 3 // 4, rows), "qg": (rows // 2, rows)}.get(parent)


def _init_new(key: str, value: torch.Tensor, rows: list[tuple[int, int]], weight_copied: bool
              ) -> tuple[str, list[tuple[int, int]]]:
    """Initialise the new ``rows`` (all rows: the whole tensor) of target ``key`` in place. Returns how, in words,
    and the rows the transfer stage trains (a zero bias standing for a source without one is not trained)."""
    *_, parent, leaf = ["", *key.split(".")]
    gate = gate_rows(key, len(value))
    if gate is not None and any(start <= gate[0] and gate[1] <= end for start, end in rows):
        others = [(a, b) for start, end in rows for a, b in ((start, min(end, gate[0])), (max(start, gate[1]), end))
                  if a < b]
        if leaf == "weight" and not others:
            value[gate[0]:gate[1]] = 0.0
            return GATE_WEIGHT, [gate]
        if leaf == "bias" and (not others or weight_copied):
            value[gate[0]:gate[1]] = 1.0
            for start, end in others:
                value[start:end] = 0.0
            return GATE_BIAS + (f"; {ZERO_BIAS_ROWS}" if others else ""), [gate]
    if leaf == "bias" and weight_copied:
        value.zero_()
        return ZERO_BIAS, []
    if parent in ("dwc", "lepe") and rows == [(0, len(value))]:
        value.zero_()
        return LOCAL_ZEROS, rows
    if leaf in ("power", "scale", "s1", "s2", "positional_encoding"):
        return f"{leaf}: the Pola model's initial value", rows
    raise ConversionError(f"target weight {key} has no counterpart in the source and no initialisation rule")


def convert_state_dict(source: nn.Module, target: nn.Module) -> tuple[dict[str, torch.Tensor], ConversionReport]:
    """The target's state dict with every source weight that has a counterpart copied into it, and the report.

    Raises :class:`ConversionError` for a source weight with no counterpart (other than those its pair drops by
    design) or with another shape, and for a target weight left neither copied nor initialised by a rule."""
    family = family_of(source)
    src = source.state_dict()
    out = {key: value.detach().clone() for key, value in target.state_dict().items()}
    parameters = {name for name, _ in target.named_parameters()}
    names = set(out)
    report = ConversionReport(family.name)
    filled: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, value in src.items():
        parts = family.map_key(key, names)
        if isinstance(parts, str):
            report.dropped[key] = parts
            continue
        chunks = value.chunk(len(parts), dim=0) if len(parts) > 1 else (value,)
        if len(parts) > 1 and len({c.shape for c in chunks}) != 1:
            raise ConversionError(f"source {key} {tuple(value.shape)} does not split into {len(parts)} equal parts")
        for i, ((name, part, total, role), chunk) in enumerate(zip(parts, chunks)):
            if name not in out:
                raise ConversionError(f"source weight {key} {tuple(value.shape)} has no counterpart {name} in "
                                      f"{type(target).__name__}")
            rows = len(out[name]) // total if total > 1 else len(out[name])
            start = part * rows
            expected = (rows, *out[name].shape[1:]) if total > 1 else tuple(out[name].shape)
            if tuple(chunk.shape) != expected:
                raise ConversionError(f"shape mismatch: source {key} {tuple(chunk.shape)}"
                                      f"{f' (part {i + 1} of {len(parts)})' if len(parts) > 1 else ''} -> {name} "
                                      f"{expected}")
            out[name][start:start + len(chunk)] = chunk.to(out[name].dtype)
            filled[name].append((start, start + len(chunk)))
            note = key + (f"[{i * len(chunk)}:{(i + 1) * len(chunk)}]" if len(parts) > 1 else "")
            note += f" into rows {start}:{start + len(chunk)}" if total > 1 else ""
            report.copied[name] = (report.copied[name] + ", " if name in report.copied else "") + note
            if role in ("q", "k"):
                report.qk_rows.setdefault(name, []).append((start, start + len(chunk)))
    for key, value in out.items():
        if key not in parameters:
            continue  # buffers the model computes (window masks, index tables)
        taken = sorted(filled.get(key, []))
        free = _free_rows(taken, len(value))
        if not free:
            continue
        weight = key[:-len("bias")] + "weight"
        report.new[key], trained = _init_new(key, value, free, key.endswith(".bias") and weight in filled)
        if trained:
            report.new_rows[key] = trained
    _check_live_gates(report, names, type(target).__name__)
    return out, report


def _check_live_gates(report: ConversionReport, names: set[str], target: str) -> None:
    """A gate of new rows needs a bias: with weight 0 and none it is 0 and every attention branch is silent."""
    for key, note in report.new.items():
        if note == GATE_WEIGHT and key[:-len("weight")] + "bias" not in names:
            raise ConversionError(f"{target} has no gate bias ({key[:-len('.weight')]} built without bias, "
                                  "qkv_bias False): its new gate would be 0 and silence every attention layer; "
                                  "leave qkv_bias to the converter (it gives a bias-less source's target biases, "
                                  "zero where the source has none)")


def _free_rows(taken: list[tuple[int, int]], rows: int) -> list[tuple[int, int]]:
    free, at = [], 0
    for start, end in taken:
        if start > at:
            free.append((at, start))
        at = max(at, end)
    if at < rows:
        free.append((at, rows))
    return free
