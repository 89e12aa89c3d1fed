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


# --- issue 51: MLP ratios, and sizes checked against memory at every family's entry point -------------------

RATIO_CASES = [
    ("pola_deit_tiny_patch16_224", dict(mlp_ratio=0, depth=1), "mlp_ratio must be a finite number > 0"),
    ("pola_pvt_tiny", dict(mlp_ratios=[4, 0, 4, 4]), "mlp_ratios must be a finite number > 0"),
    ("pola_pvt_v2_b0", dict(mlp_ratios=[8, 8, float("nan"), 4]), "mlp_ratios must be a finite number > 0"),
    ("pola_swin_t", dict(mlp_ratio=-1.0), "mlp_ratio must be a finite number > 0"),
    ("POLA_b0", dict(mlp_ratios=(3.5, 0, 3.5, 3.5)), "mlp_ratios must be a finite number > 0"),
    ("pola_dit_s_2", dict(mlp_ratio=0, input_size=8, depth=1), "mlp_ratio must be a finite number > 0"),
    ("pola_lm_tiny", dict(mlp_ratio=0), "mlp_ratio must be a finite number > 0"),
    ("pola_sr_light_x2", dict(mlp_ratio=float("inf")), "mlp_ratio must be a finite number > 0"),
]


@pytest.mark.parametrize("name, kwargs, message", RATIO_CASES, ids=[f"{c[0]}-{c[1]}" for c in RATIO_CASES])
def test_an_mlp_of_no_width_is_refused(name, kwargs, message):
    """mlp_ratio=0 built a model whose MLPs had no hidden unit, without a word (a negative ratio failed in
    nn.Linear)."""
    with pytest.raises(ValueError) as info:
        timm.create_model(name, **kwargs)
    assert message in str(info.value)


MEMORY_CASES = [
    ("pola_deit_tiny_patch16_224", dict(depth=10**9)),
    ("pola_deit_tiny_patch16_224", dict(depth=10**5)),  # 192 wide: 4.4e10 weights, though 10**5 x 32² would fit
    ("pola_swin_t", dict(embed_dim=10**6)),
    ("pola_lm_tiny", dict(depth=10**8)),
    ("pola_dit_s_2", dict(depth=10**8)),
    ("POLA_b0", dict(depths=(1, 1, 10**9, 1))),
]


@pytest.mark.parametrize("name, kwargs", MEMORY_CASES, ids=[f"{c[0]}-{c[1]}" for c in MEMORY_CASES])
def test_every_family_checks_its_sizes_against_memory_before_building(name, kwargs, monkeypatch):
    """timm.create_model('pola_deit_tiny_patch16_224', depth=10**9) ended in a MemoryError, or the kernel's
    out-of-memory killer; the entry point now estimates the blocks' weights from the sizes asked over the
    variant's own (12·width² a block) first. Memory is fixed at 16 GiB so the case reads alike anywhere."""
    import polaformer.limits

    monkeypatch.setattr(polaformer.limits, "available_memory", lambda device="cpu": 16 * 2**30)
    with pytest.raises(ValueError, match=rf"^model '{name}' with \{{.*\}} needs at least .* GiB for its weights "
                                         r"\(.* parameters\), more than the 16 GiB of memory available$"):
        timm.create_model(name, **kwargs)
