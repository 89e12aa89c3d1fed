"""Every hierarchical model of the zoo as a timm feature backbone, at 224 and at a non-square size."""
import pytest
import timm
import torch

import polaformer.models  # noqa: F401

HIERARCHICAL = [n for n in timm.list_models(["pola_pvt*", "pola_swin*", "POLA_b*"])]


def test_zoo_is_complete():
    expected = {f"pola_pvt_{s}" for s in ("tiny", "small", "medium", "large")}
    expected |= {f"pola_pvt_v2_b{i}" for i in range(6)} | {f"POLA_b{i}" for i in range(6)}
    expected |= {"pola_swin_t", "pola_swin_s", "pola_swin_b", "pola_swin_b_384"}
    assert expected <= set(HIERARCHICAL)


@pytest.mark.parametrize("name", HIERARCHICAL)
def test_features_only_every_model(name):
    with torch.device("meta"):
        model = timm.create_model(name, features_only=True)
        for h, w in [(224, 224), (256, 320)]:
            feats = model(torch.empty(1, 3, h, w))
            assert [tuple(f.shape[-2:]) for f in feats] == [(h // r, w // r) for r in (4, 8, 16, 32)]
            assert [f.shape[1] for f in feats] == model.feature_info.channels()
    assert model.feature_info.reduction() == [4, 8, 16, 32]
