"""Parameter-efficient fine-tuning of a converted Pola model with LoRA, through the ``peft`` library (as LoLCATs
fine-tunes after its attention transfer): low-rank adapters on every attention projection (q/k/v with the gate
rows, and the output), and the Pola layer's own small tensors (powers, temperatures, key positions, the local
branch) trained whole; every other weight stays the teacher's. The gate's weight rows learn through the adapter of
their projection. At the end :func:`merge_lora` folds the adapters into the weights: a plain model again."""
from __future__ import annotations

import copy
import re

from torch import nn

from .engine.config import ConfigError

__all__ = ["LORA_TARGETS", "add_lora", "lora_model", "merge_lora", "pola_own_parameters"]

# the attention's projections by module name: Pola's fused q/k/v/gate or q/gate + k/v, softmax's qkv, the output
LORA_TARGETS = r".*\.attn\.(qkvg|qkv|qg|q|kv|proj)"
# the Pola attention's own tensors (no softmax counterpart), small enough to train whole
_OWN = re.compile(r".*\.(power|scale|s1|s2|positional_encoding|(dwc|lepe)\.\w+)")


def pola_own_parameters(model: nn.Module) -> list[str]:
    """Names of the Pola attention's own tensors in ``model``: powers, temperatures, key positions, local branch."""
    return [name for name, _ in model.named_parameters() if _OWN.fullmatch(name)]


def add_lora(model: nn.Module, rank: int, alpha: float = 0.0, train: tuple[str, ...] = ()) -> nn.Module:
    """``model`` wrapped by peft with rank-``rank`` LoRA adapters (scale ``alpha / rank``; ``alpha`` 0: twice the
    rank) on every module matching :data:`LORA_TARGETS`; only the adapters, the Pola layer's own tensors
    (:func:`pola_own_parameters`) and the parameters named in ``train`` (a new classifier) learn."""
    try:
        import peft
    except ModuleNotFoundError as e:
        raise ConfigError(f"LoRA fine-tuning needs peft (pip install peft, or polaformer[lora]): {e}") from None
    if not any(re.fullmatch(LORA_TARGETS, name) for name, _ in model.named_modules()):
        raise ConfigError(f"{type(model).__name__} has no attention projection for LoRA (modules matching "
                          f"{LORA_TARGETS})")
    trained = set(pola_own_parameters(model)) | set(train)
    kept = [param for name, param in model.named_parameters() if name in trained]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    wrapped = peft.get_peft_model(model, config)
    for param in kept:  # peft froze everything but its adapters
        param.requires_grad_(True)
    return wrapped


def lora_model(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by :func:`add_lora`."""
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def merge_lora(model: nn.Module) -> nn.Module:
    """A copy of the plain model under ``model`` (from :func:`add_lora`) with its adapters merged into the
    weights: the same function, the keys and shapes of the model before :func:`add_lora`."""
    return copy.deepcopy(model).merge_and_unload()
