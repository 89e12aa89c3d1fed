"""Pola-PVTv2 (no official code): structure, sizes near the paper's, timm features."""
import pytest
import timm
import torch

import polaformer.models  # noqa: F401

# paper Table 5 (Pola variants): params in millions
PAPER_PARAMS = {"pola_pvt_v2_b0": 3.4, "pola_pvt_v2_b1": 13.0}


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_sizes_near_paper(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    # FLatten's layout with a key table per block lands 5-12% above the paper, like the official PVT family
    assert 1.0 <= params / PAPER_PARAMS[name] < 1.12


@pytest.mark.parametrize("size", [(224, 224), (256, 320)])
def test_features_only(size):
    model = timm.create_model("pola_pvt_v2_b0", features_only=True, depths=(1, 1, 1, 1))
    h, w = size
    feats = model(torch.randn(1, 3, h, w))
    assert [tuple(f.shape) for f in feats] == [
        (1, c, h // r, w // r) for c, r in zip((32, 64, 160, 256), (4, 8, 16, 32))
    ]


def test_forward_backward_and_errors():
    model = timm.create_model("pola_pvt_v2_b0", depths=(1, 1, 1, 1), num_classes=5)
    out = model(torch.randn(2, 3, 64, 96))
    assert out.shape == (2, 5)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="not divisible by the total stride 32"):
        model(torch.randn(1, 3, 70, 64))
    assert "block1.0.attn.power" in model.no_weight_decay()
