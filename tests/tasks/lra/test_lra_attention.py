"""The LRA model's token mixers by name (polaformer.tasks.lra.attention): registry, options, Pola/PaCS adapters."""
import pytest
import torch

from polaformer.layers import NystromAttention, PacsSequenceAttention, PolaSequenceAttention, SoftmaxAttention
from polaformer.tasks.lra.attention import ATTENTIONS, attention_options, build_attention
from token_mixer_helpers import (
    DIM,
    HEAD_DIM,
    HEADS,
    MAX_LEN,
    check_finite_outputs_and_gradients,
    check_input_errors,
    check_padded_contents_never_reach_valid_outputs,
    check_right_padding_gives_the_unpadded_output,
    padded_batch,
    randomize_zero_init,
)

ADAPTED = ["pola", "pacs"]


def make(name, dtype=torch.float64, **options):
    layer = build_attention(name, DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, **options).to(dtype)
    return randomize_zero_init(layer)


def test_registry_and_options():
    assert set(ATTENTIONS) == {"softmax", "linear", "kernelized", "performer", "nystrom", "linformer",
                               "cosformer", "skyformer", "focused", "pola", "pacs"}
    assert attention_options("softmax") == {}
    assert attention_options("performer") == {"nb_features": 128, "qk_scale": None, "seed": None}
    assert attention_options("nystrom")["num_landmarks"] == 128
    assert attention_options("skyformer")["nb_features"] == 128
    assert attention_options("linformer")["linformer_k"] == 128
    assert attention_options("pola") == {"alpha": None, "kernel_size": None, "gate_init": None}
    layer = build_attention("pola", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, alpha=3.0, kernel_size=3)
    assert layer.layer.alpha == 3.0 and layer.layer.dwc.kernel_size == (3,)


def test_entries_build_the_layers_with_sizes_dropout_and_options():
    layer = build_attention("nystrom", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, num_landmarks=4)
    assert isinstance(layer, NystromAttention) and layer.core.num_landmarks == 4 and layer.max_seq_len == MAX_LEN
    assert build_attention("softmax", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, dropout=0.3).core.dropout == 0.3
    assert type(build_attention("softmax", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN)) is SoftmaxAttention
    assert isinstance(make("pola").layer, PolaSequenceAttention)
    assert isinstance(make("pacs").layer, PacsSequenceAttention)


def test_adapter_parameters_live_under_layer():
    """Saved LRA checkpoints name the Pola/PaCS parameters ``...attn.layer.*``."""
    for name in ADAPTED:
        keys = set(make(name).state_dict())
        assert keys and all(k.startswith("layer.") for k in keys), name


def test_build_attention_errors():
    with pytest.raises(ValueError, match=r"unknown attention 'bogus'; known: softmax, linear") as err:
        build_attention("bogus", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"unknown option\(s\) rp_dim for attention 'performer'; its options: "
                                         r"nb_features=128, qk_scale=None, seed=None"):
        build_attention("performer", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, rp_dim=64)
    with pytest.raises(ValueError, match="its options: none"):
        build_attention("softmax", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, num_landmarks=4)
    for name in ADAPTED:
        with pytest.raises(ValueError, match="head_dim == dim // num_heads"):
            build_attention(name, DIM, HEADS, 32, max_seq_len=MAX_LEN)
    with pytest.raises(ValueError, match="odd"):
        build_attention("nystrom", DIM, HEADS, HEAD_DIM, max_seq_len=MAX_LEN, conv_kernel_size=4)


# ----------------------------------------------------------------------------- the adapted Pola/PaCS layers
# (the baselines' interface is tested in test_baseline_attention.py)


@pytest.mark.parametrize("name", ADAPTED)
def test_shape_finite_outputs_and_gradients(name):
    check_finite_outputs_and_gradients(make(name, torch.float32))


@pytest.mark.parametrize("name", ADAPTED)
def test_right_padding_gives_the_unpadded_output(name):
    check_right_padding_gives_the_unpadded_output(make(name))


@pytest.mark.parametrize("name", ADAPTED)
def test_padded_contents_never_reach_valid_outputs(name):
    check_padded_contents_never_reach_valid_outputs(make(name))


@pytest.mark.parametrize("name", ADAPTED)
def test_forward_input_checks(name):
    check_input_errors(make(name))


def test_adapter_passes_the_mask_to_the_layer():
    adapter = make("pola")
    x, pad = padded_batch([12, 5], 12)
    with torch.no_grad():
        torch.testing.assert_close(adapter(x, pad), adapter.layer(x, key_padding_mask=pad), atol=0, rtol=0)
        torch.testing.assert_close(adapter(x, key_padding_mask=pad), adapter(x, pad), atol=0, rtol=0)
