"""PolaFormer++ (official POLA_b0..b5): structure against the manifests, the reference vector, timm API.

The GMACs against the official fvcore count at 1%: the two counters differ in what they count (fvcore counts some
normalisations and elementwise steps that torch's FlopCounterMode leaves out), not in rounding."""

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import polaformer.models  # noqa: F401  (registers the models)
from conftest import load_vector, official_state_dict
from polaformer.compat import from_official
from polaformer.models import PolaFormerPP
from zoo_helpers import load_manifest

VARIANTS = [f"POLA_b{i}" for i in range(6)]
# A small model: the stage layout of the official ones at toy widths.
TINY = dict(embed_dims=(16, 24, 32, 48), depths=(1, 2, 2, 1), num_heads=(1, 1, 2, 3), projection=64)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_official_load_manifest(name):
    record = load_manifest(name)
    with torch.device("meta"):
        model = timm.create_model(name)
        with pytest.warns(UserWarning, match=f"deprecated model name {name.lower()} to current {name}"):
            alias = timm.create_model(name.lower())
        official = from_official(record)
    expected = {key: shape for key, shape, _ in record["state_dict"]}
    for m in (model, alias, official):
        assert {k: list(v.shape) for k, v in m.state_dict().items()} == expected
        assert num_params(m) == record["num_params"]
    assert sum(b.numel() for b in model.buffers()) == record["num_buffer_elements"]
    assert model.pretrained_cfg["architecture"] == name


@pytest.mark.parametrize("name", VARIANTS)
def test_gmacs_match_official(name):
    record = load_manifest(name)
    size = record["img_size"]
    with torch.device("meta"):
        model = timm.create_model(name).eval()
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(torch.empty(1, 3, size, size))
    gmacs = counter.get_total_flops() / 2 / 1e9
    assert gmacs == pytest.approx(record["flops_fvcore_style_gmacs"], rel=0.01)


def test_reference_vector_with_intermediates():
    record, tensors = load_vector("polapp_tiny_cfg")
    model = from_official(record).double()
    state = official_state_dict(tensors)
    for key, value in model.state_dict().items():  # RoPE tables are built, not loaded
        if key.endswith(".angle"):
            assert torch.equal(value, state[key].double()), key
    model.load_state_dict(state, strict=True)
    model.eval()
    # The official forward_features ends with the pooling, ours before it.
    module_of = {name: name for name in record["intermediates"]} | {"forward_features": "global_pool"}
    modules = dict(model.named_modules())
    seen = {}
    for name, module in module_of.items():
        modules[module].register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
    with torch.no_grad():
        out = model(tensors["input"])
    tol = record["tolerance_hint"]
    assert (out - tensors["output"]).abs().max() <= tol * max(1.0, record["output_abs_max"])
    for name, shape in record["intermediates"].items():
        ref = tensors[f"intermediate.{name}"]
        assert list(seen[name].shape) == shape, name
        assert (seen[name] - ref).abs().max() <= tol * max(1.0, ref.abs().max().item()), name


def test_block_types_follow_official_flags():
    model = from_official(load_manifest("POLA_b3"))
    kinds = ["".join(blk.block_type for blk in stage.blocks) for stage in model.layers]
    assert kinds == ["lll", "lllll", "v" * 9, "vvv"]
    assert model.layers[1].blocks[0].attn.s1.shape == (1, 2, 1, 128)
    assert model.layers[3].downsample is None and model.layers[2].downsample.reduction.stride == (2, 2)


@pytest.mark.parametrize("size", [(224, 224), (256, 320)])
def test_features_only_strides_and_channels(size):
    with torch.device("meta"):
        model = timm.create_model("POLA_b0", features_only=True)
        feats = model(torch.empty(1, 3, *size))
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    assert model.feature_info.channels() == [32, 64, 128, 384]
    assert [tuple(f.shape) for f in feats] == [
        (1, c, size[0] // r, size[1] // r) for c, r in zip([32, 64, 128, 384], [4, 8, 16, 32])
    ]


def test_features_match_forward_intermediates_on_real_values():
    model = timm.create_model("POLA_b0", **TINY).eval()
    features = timm.create_model("POLA_b0", features_only=True, out_indices=(1, 2), **TINY).eval()
    result = features.model.load_state_dict(model.state_dict(), strict=False)
    assert not result.missing_keys  # pruned away: stage 4, stage 3's PatchMerging and the head
    assert {k.split(".")[0] for k in result.unexpected_keys} == {"layers", "proj", "norm", "head"}
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(model.forward_head(final), model(x))
        picked = features(x)
    assert [tuple(f.shape) for f in inter] == [(2, 16, 16, 24), (2, 24, 8, 12), (2, 32, 4, 6), (2, 48, 2, 3)]
    torch.testing.assert_close(picked, inter[1:3])
    assert len(features.model.layers) == 3 and features.model.layers[-1].downsample is None


def test_full_size_forward_at_non_square_size():
    model = timm.create_model("POLA_b0").eval()
    with torch.no_grad():
        feats = model.forward_features(torch.randn(1, 3, 256, 320))
        assert feats.shape == (1, 2048, 8, 10)
        assert model.forward_head(feats, pre_logits=True).shape == (1, 2048)
        assert torch.isfinite(model.forward_head(feats)).all()


def test_clear_errors():
    model = timm.create_model("POLA_b0", **TINY)
    with pytest.raises(ValueError, match="image size 0x48 is smaller than one pixel"):
        model.forward_intermediates(torch.randn(1, 3, 0, 48))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="stage 1: 3 block types for depth 2"):
        PolaFormerPP(block_types=("l", "lll", "v", "v"), **TINY)
    with pytest.raises(ValueError, match="'l' .* or 'v'"):
        PolaFormerPP(block_types=("l", "x", "v", "v"), **TINY)


def test_classifier_api():
    model = timm.create_model("POLA_b0", num_classes=7, **TINY).eval()
    x = torch.randn(2, 3, 64, 64)
    assert model(x).shape == (2, 7)
    assert model.get_classifier().weight.shape == (7, 64, 1, 1)
    model.reset_classifier(3, global_pool="max")
    assert model(x).shape == (2, 3)
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 64, 2, 2)


def test_no_weight_decay_and_group_matcher():
    model = timm.create_model("POLA_b0", **TINY)
    skip = model.no_weight_decay()
    assert {"layers.0.blocks.0.attn.s1", "layers.1.blocks.1.attn.s2"} <= skip
    # The official optimizer decays the 4-D layerscale gammas and conv weights.
    assert not any("gamma" in name or "qkv" in name or "pos" in name for name in skip)
    groups = timm.models.group_parameters(model, model.group_matcher())
    assert groups[0] == [name for name, _ in model.named_parameters() if name.startswith("patch_embed")]
    assert len(groups) == 1 + sum(TINY["depths"]) + 3 + 1  # stem, blocks, PatchMergings, classifier


def test_grad_checkpointing_gives_the_same_gradients():
    model = timm.create_model("POLA_b0", drop_path_rate=0.0, **TINY).eval()
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)
