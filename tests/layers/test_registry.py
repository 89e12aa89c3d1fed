"""The one table of the sequence models' attentions: every name each model accepted before, built as before."""
import pytest
import torch
from timm.layers import Attention

from polaformer.layers import (
    PacsCausalSelfAttention,
    PacsSequenceAttention,
    PolaCausalSelfAttention,
    SoftmaxAttention,
    SoftmaxCausalSelfAttention,
)
from polaformer.layers.pacs_grid_attention import PacsGridAttention
from polaformer.layers.registry import SEQUENCE_ATTENTIONS, SequenceLayerAdapter, sequence_attentions
from polaformer.models import pola_dit, pola_lm
from polaformer.tasks.lra import attention as lra_attention


def test_each_model_reads_its_kind_of_the_one_table():
    assert lra_attention.ATTENTIONS == sequence_attentions("encoder")
    assert pola_lm.ATTENTIONS == sequence_attentions("causal")
    assert pola_dit.ATTENTIONS == sequence_attentions("grid")
    assert set(sequence_attentions("encoder")) == {"softmax", "linear", "kernelized", "performer", "nystrom",
                                                   "linformer", "cosformer", "skyformer", "focused", "pola", "pacs"}
    assert set(sequence_attentions("causal")) == {"pola", "pacs", "elu", "softmax"}
    assert set(sequence_attentions("grid")) == {"pacs", "softmax"}
    assert all(builders for builders in SEQUENCE_ATTENTIONS.values())


def test_builders():
    encoder, causal, grid = (sequence_attentions(kind) for kind in ("encoder", "causal", "grid"))
    assert type(encoder["softmax"](16, 2, 8, max_seq_len=8)) is SoftmaxAttention
    adapted = encoder["pacs"](16, 2, 8, max_seq_len=8)
    assert isinstance(adapted, SequenceLayerAdapter) and isinstance(adapted.layer, PacsSequenceAttention)
    assert type(causal["pola"](16, 2, proj_drop=0.0)) is PolaCausalSelfAttention
    assert type(causal["pacs"](16, 2, proj_drop=0.0)) is PacsCausalSelfAttention
    assert type(causal["softmax"](16, 2, proj_drop=0.0)) is SoftmaxCausalSelfAttention
    assert type(grid["pacs"](16, 2)) is PacsGridAttention
    softmax = grid["softmax"](16, 2)
    assert type(softmax) is Attention and softmax.qkv.bias is not None
    assert grid["pacs"](16, 2)(torch.randn(1, 4, 16)).shape == (1, 4, 16)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind of sequence 'image' .known: encoder, causal, grid"):
        sequence_attentions("image")
