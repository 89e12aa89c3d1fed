"""Pola-PVT against the official manifests and vectors, and as a timm model."""
import pytest
import timm
import torch

import polaformer.models  # noqa: F401
from zoo_helpers import capture, check_manifest, check_vector


@pytest.mark.parametrize("name", ["pola_pvt_tiny", "pola_pvt_small", "pola_pvt_medium", "pola_pvt_large"])
def test_matches_official_manifest(name):
    check_manifest(name)


def _pvt_intermediates(model, x):
    # patch embeddings and blocks emit (B, N, C) tokens, as the vectors store them
    found = capture(model, ["patch_embed1", "block1.0", "block2.0", "block3.1", "block4.0"], x)
    found["forward_features"] = model.forward_head(model.forward_features(x), pre_logits=True)
    return found


@pytest.mark.parametrize("case", ["pvt_tiny_cfg", "pvt_tiny_cfg_sr1", "pvt_tiny_cfg_mixed_LS"])
def test_reproduces_official_vector(case):
    check_vector(case, _pvt_intermediates)


def small(**kwargs):
    args = dict(embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 3, 4), mlp_ratios=(2, 2, 2, 2), depths=(1, 1, 1, 1))
    args.update(kwargs)
    return timm.create_model("pola_pvt_tiny", **args)


@pytest.mark.parametrize("la_sr_ratios", ["1111", "8421"])
def test_features_only_any_divisible_size(la_sr_ratios):
    model = timm.create_model("pola_pvt_tiny", features_only=True, embed_dims=(16, 32, 48, 64),
                              num_heads=(1, 2, 3, 4), mlp_ratios=(2, 2, 2, 2), depths=(1, 1, 1, 1),
                              la_sr_ratios=la_sr_ratios)
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    for h, w in [(224, 224), (256, 320)]:
        feats = model(torch.randn(1, 3, h, w))
        assert [f.shape for f in feats] == [
            (1, c, h // r, w // r) for c, r in zip((16, 32, 48, 64), (4, 8, 16, 32))
        ]


def test_full_size_forward_and_api():
    model = timm.create_model("pola_pvt_tiny").eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    assert {"pos_embed1", "block1.0.attn.power", "block4.1.attn.scale",
            "block2.0.attn.positional_encoding"} <= model.no_weight_decay()
    model.reset_classifier(3)
    assert model.get_classifier().out_features == 3


def test_grad_checkpointing_and_resampled_tables_train():
    model = small(num_classes=4)
    model.set_grad_checkpointing(True)
    out = model(torch.randn(2, 3, 96, 64))  # not the construction size: tables are resampled
    out.sum().backward()
    assert model.pos_embed1.grad is not None and model.block1[0].attn.positional_encoding.grad is not None


def test_bad_sizes_raise_clear_errors():
    model = small()
    with pytest.raises(ValueError, match="image size 31x96 is smaller than the total stride 32"):
        model(torch.randn(1, 3, 31, 96))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 64, 64))
