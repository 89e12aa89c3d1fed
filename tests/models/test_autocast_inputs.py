"""Under autocast every model family hands its attention op half-precision q, k and v (issue 52): the layers pass
their scale, exponent, temperatures and key positions to the op as parameters (or apply them in the projections'
dtype), so nothing promotes the projections to float32 on the way and the GPU kernels multiply in bf16. Checked
on the CPU under bf16 autocast, at each attention op's entry."""
from __future__ import annotations

import pytest
import timm
import torch

import polaformer.models  # noqa: F401  (registers the models)
from call_counting import counted
from models.test_timm_conformance import SMALLEST
from polaformer import ops
from polaformer.layers import PolaMultiheadAttention
from polaformer.tasks.lra.model import LRAClassifier, LRAModelConfig

# the ops the layers call with their projections
ENTRIES = ("pola_layer_attention", "pacs_layer_attention", "causal_pola_linear_attention",
           "causal_pacs_linear_attention")


def _image(name):
    return timm.create_model(name, num_classes=3), (torch.randn(1, *SMALLEST[name]),)


def _dit():
    model = timm.create_model("pola_dit_s_2", input_size=8, in_channels=4, depth=1, hidden_size=48, num_heads=2,
                              num_classes=10)
    return model, (torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 7]))


def _lm(attention):
    model = timm.create_model("pola_lm_tiny", attention=attention, context=16)
    return model, (torch.randint(0, 256, (2, 16)),)


def _lra(attention):
    config = LRAModelConfig(vocab_size=32, num_classes=3, max_len=16, attention=attention, dropout=0.0,
                            attention_dropout=0.0)
    tokens = torch.randint(0, 32, (2, 16))
    return LRAClassifier(config), (tokens, torch.arange(16) >= torch.tensor([16, 9])[:, None])


def _mha(feature_map):
    layer = PolaMultiheadAttention(32, 2, batch_first=True, feature_map=feature_map)
    x = torch.randn(2, 10, 32)
    return layer, (x, x, x)


FAMILIES = {
    **{name: (lambda name=name: _image(name)) for name in SMALLEST},
    "pola_dit": _dit,
    **{f"lm {attention}": (lambda attention=attention: _lm(attention)) for attention in ("pola", "pacs")},
    **{f"lra {attention}": (lambda attention=attention: _lra(attention)) for attention in ("pola", "pacs")},
    **{f"mha {feature_map}": (lambda feature_map=feature_map: _mha(feature_map)) for feature_map in ("pola", "pacs")},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_ops_receive_half_precision_projections(monkeypatch, family):
    calls = {name: counted(monkeypatch, ops, name) for name in ENTRIES}
    model, inputs = FAMILIES[family]()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.eval()(*inputs)
    received = [(name, tuple(str(t.dtype).removeprefix("torch.") for t in args[:3]))
                for name, made in calls.items() for args in made]
    assert received, "no attention op was called"
    assert all(dtypes == ("bfloat16",) * 3 for _, dtypes in received), received
