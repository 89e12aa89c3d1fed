"""Pola-DeiT as a timm model."""
import pytest
import timm
import torch

import polaformer.models  # noqa: F401  (registers the models)
from polaformer.models import PolaDeiT

PAPER_DEIT_T_PARAMS = 6.1e6


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_deit_tiny_matches_paper_param_count():
    with torch.device("meta"):
        model = timm.create_model("pola_deit_tiny_patch16_224")
    assert abs(count(model) / PAPER_DEIT_T_PARAMS - 1) < 0.03


@pytest.mark.parametrize("name", ["pola_deit_tiny_patch16_224", "pola_deit_small_patch16_224",
                                  "pola_deit_base_patch16_224", "pola_deit_digits"])
def test_registered_with_timm(name):
    assert name in timm.list_models("pola_deit*")
    with torch.device("meta"):
        model = timm.create_model(name, num_classes=7)
    assert model.get_classifier().out_features == 7
    assert model.pretrained_cfg["architecture"] == name


def test_forward_api_and_any_divisible_size():
    model = timm.create_model("pola_deit_tiny_patch16_224", depth=2).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 197, 192)
        assert model.forward_head(feats, pre_logits=True).shape == (2, 192)
        assert model(x).shape == (2, 1000)
        assert model(torch.randn(1, 3, 160, 256)).shape == (1, 1000)  # position table resampled
    model.reset_classifier(5, global_pool="avg")
    assert model(x).shape == (2, 5)


def test_clear_errors_on_bad_images():
    model = timm.create_model("pola_deit_digits")
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        timm.create_model("pola_deit_tiny_patch16_224", depth=1)(torch.randn(1, 3, 100, 100))
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
        model(torch.randn(1, 3, 8, 8))


def test_grad_checkpointing_gives_the_same_gradients():
    model = timm.create_model("pola_deit_digits")
    x = torch.randn(4, 1, 8, 8)
    model(x).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_no_weight_decay_lists_tables_and_attention_temperatures():
    model = timm.create_model("pola_deit_digits")
    skip = model.no_weight_decay()
    assert {"pos_embed", "cls_token", "blocks.0.attn.power", "blocks.3.attn.scale"} <= skip
    assert "blocks.0.attn.qkvg.weight" not in skip
    assert isinstance(model, PolaDeiT)


def test_features_only_gives_block_maps_at_patch_stride():
    model = timm.create_model("pola_deit_tiny_patch16_224", depth=4, features_only=True, out_indices=(1, 3))
    feats = model(torch.randn(1, 3, 224, 320))
    assert [tuple(f.shape) for f in feats] == [(1, 192, 14, 20)] * 2
    assert model.feature_info.reduction() == [16, 16]
