"""timm.create_model refuses sizes and rates that would build a broken model, in one ValueError
naming the argument (issue 27): a 0-block model, zero heads (a ZeroDivisionError before), NaN logits."""
import pytest
import timm

import polaformer.models  # noqa: F401
from polaformer.layers import PolaMultiheadAttention

CASES = [
    ("pola_deit_tiny_patch16_224", dict(depth=0), "depth must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(depth=-1), "depth must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(num_heads=0), "num_heads must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(drop_path_rate=-0.1), "drop_path_rate must be a number in [0, 1), got -0.1"),
    ("pola_deit_tiny_patch16_224", dict(alpha=float("nan")), "alpha must be a finite number >= 0, got nan"),
    ("pola_deit_tiny_patch16_224", dict(alpha=-3), "alpha must be a finite number >= 0, got -3"),
    ("pola_pvt_tiny", dict(depths=[-1, 2, 2, 2]), "depths must be a positive integer"),
    ("pola_pvt_tiny", dict(sr_ratios=[0, 4, 2, 1]), "sr_ratios must be a positive integer"),
    ("pola_pvt_v2_b0", dict(num_heads=[0, 2, 5, 8]), "num_heads must be a positive integer"),
    ("pola_swin_t", dict(depths=(2, 2, 0, 2)), "depths must be a positive integer"),
    ("pola_swin_t", dict(drop_path_rate=float("nan")), "drop_path_rate must be a number in [0, 1), got nan"),
    ("POLA_b0", dict(num_heads=(1, 0, 2, 3)), "num_heads must be a positive integer"),
]


@pytest.mark.parametrize("name, kwargs, message", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_create_model_refuses_broken_sizes(name, kwargs, message):
    with pytest.raises(ValueError) as info:
        timm.create_model(name, **kwargs)
    assert message in str(info.value)


def test_multihead_attention_refuses_zero_heads():
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
        PolaMultiheadAttention(64, 0)


# --- issue 38: every constructor validates its arguments in one line, and inputs out of range are named ----------

CONSTRUCTOR_CASES = [
    ("pola_deit_tiny_patch16_224", dict(in_chans=0), "in_chans must be a positive integer"),
    ("pola_deit_tiny_patch16_224", dict(img_size=7), "img_size must be an integer of at least patch_size 16, got 7"),
    ("pola_deit_tiny_patch16_224", dict(num_classes=-1), "num_classes must be an integer >= 0 (0: no classifier)"),
    ("POLA_b0", dict(projection=0), "projection must be a positive integer"),
    ("pola_lm_tiny", dict(vocab_size=0), "vocab_size must be a positive integer"),
    ("pola_lm_tiny", dict(context=0), "context must be a positive integer"),
    ("pola_sr_light_x2", dict(window_size=0), "window_size must be a positive integer"),
    ("pola_dit_s_2", dict(num_classes=-1, input_size=8, depth=1), "num_classes must be an integer >= 0"),
]


@pytest.mark.parametrize("name, kwargs, message", CONSTRUCTOR_CASES, ids=[f"{c[0]}-{c[1]}" for c in CONSTRUCTOR_CASES])
def test_constructors_refuse_nonsense_sizes(name, kwargs, message):
    with pytest.raises(ValueError) as info:
        timm.create_model(name, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("layer", ["PolaSequenceAttention", "PacsSequenceAttention", "PolaCausalSelfAttention",
                                   "PacsCausalSelfAttention", "EluCausalSelfAttention", "SoftmaxCausalSelfAttention"])
def test_sequence_layers_refuse_zero_heads(layer):
    import polaformer.layers

    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):  # was a ZeroDivisionError
        getattr(polaformer.layers, layer)(64, 0)


@pytest.mark.parametrize("layer", ["PolaCausalSelfAttention", "PacsCausalSelfAttention", "EluCausalSelfAttention",
                                   "SoftmaxCausalSelfAttention"])
def test_a_causal_layer_on_no_token_returns_no_token(layer):
    import torch

    import polaformer.layers

    module = getattr(polaformer.layers, layer)(16, 2)
    assert module(torch.zeros(2, 0, 16)).shape == (2, 0, 16)
    out, cache = module.step(torch.randn(2, 3, 16))
    empty, same = module.step(torch.zeros(2, 0, 16), cache)  # a cache goes on unchanged
    assert empty.shape == (2, 0, 16)
    torch.testing.assert_close(module.step(torch.ones(2, 1, 16), same)[0], module.step(torch.ones(2, 1, 16), cache)[0])


def test_token_ids_labels_and_timesteps_out_of_range_are_named():
    import torch

    lm = timm.create_model("pola_lm_tiny", context=8)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\), got 300"):
        lm(torch.tensor([[1, 300]]))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\), got 300"):
        lm.generate(torch.tensor([[300]]), 2)
    dit = timm.create_model("pola_dit_s_2", input_size=8, depth=1, num_classes=10).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 3])
    assert dit(x, t, y).shape == (2, 8, 8, 8)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\], got 11"):  # 10: the null class
        dit(x, t, torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="timesteps must be >= 0, got -5"):
        dit(x, torch.tensor([-5, 2]), y)
