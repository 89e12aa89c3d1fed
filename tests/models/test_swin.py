"""Pola-Swin against the official manifests and reference vectors, plus the timm API and other input sizes.

Tolerances (tests/README.md, tests/tolerances.py): the float64 vectors and masks at 1e-10 to 1e-12, far above
reorder_rtol(n, float64) for windows of 49 tokens and these channel counts; the reference vectors' own stated
tolerances are in their records."""

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import load_vector, official_state_dict
from polaformer.compat import from_official
from polaformer.layers import WindowAttention
from polaformer.models.swin import PolaSwinBlock, PolaSwinTransformer, block_attn_types, shifted_window_mask
from zoo_helpers import load_manifest

VARIANTS = ["pola_swin_t", "pola_swin_s", "pola_swin_b", "pola_swin_b_384"]
VECTORS = ["swin_tiny_cfg", "swin_official_layout_cfg"]
SMALL = dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=(1, 2, 2, 4))  # LLSS, global linear windows


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_official_load_manifest(name):
    man = load_manifest(name)
    with torch.device("meta"):
        model = timm.create_model(name).eval()
        official = from_official(man)
        x = torch.empty(1, 3, man["img_size"], man["img_size"])
        with FlopCounterMode(display=False) as counter:
            model(x)
    expected = {key: shape for key, shape, _ in man["state_dict"]}
    for m in (model, official):
        assert {k: list(v.shape) for k, v in m.state_dict().items()} == expected
        assert count(m) == man["num_params"]
        assert sum(b.numel() for b in m.buffers()) == man["num_buffer_elements"]
    gmacs = counter.get_total_flops() / 2 / 1e9
    assert abs(gmacs / man["flops_fvcore_style_gmacs"] - 1) < 0.01
    for r in man["resolved_blocks"]:
        blk = model.layers[r["stage"]].blocks[r["block"]]
        assert type(blk.attn).__name__ == r["attn_class"]
        assert (blk.window_size, blk.shift_size) == (r["window_size"], r["shift_size"])
        assert blk.input_resolution == tuple(r["input_resolution"])


def _intermediates(model, x, names):
    """Outputs of the named submodules (as (B, L, C)) plus the pooled ``forward_features``."""
    out = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: out.__setitem__(n, o))
             for n in names if n != "forward_features"]
    logits = model(x)
    out["forward_features"] = model.forward_head(model.forward_features(x), pre_logits=True)
    for h in hooks:
        h.remove()
    return logits, out


@pytest.mark.numerics
@pytest.mark.parametrize("case", VECTORS)
def test_reproduces_official_vector(case):
    record, tensors = load_vector(case)
    model = from_official(record)
    sd = official_state_dict(tensors)
    fresh = model.state_dict()
    for key, value in sd.items():  # index tables and masks are made, not loaded
        if key.endswith(("relative_position_index", "attn_mask")):
            if key.endswith("index"):
                assert fresh[key].dtype == torch.int64
            assert torch.equal(fresh[key].to(value.dtype), value), key
    model = model.double()
    model.load_state_dict(sd, strict=True)
    model.eval()
    with torch.no_grad():
        out, inter = _intermediates(model, tensors["input"], record["intermediates"])
    tol = record["tolerance_hint"]
    assert (out - tensors["output"]).abs().max() <= tol * max(1.0, record["output_abs_max"])
    for name in record["intermediates"]:
        ref = tensors[f"intermediate.{name}"]
        assert (inter[name].reshape(ref.shape) - ref).abs().max() <= tol * max(1.0, ref.abs().max().item()), name


def test_attention_mask_buffer_used_by_softmax_blocks_only():
    """As officially: shifted softmax blocks apply the stored mask, linear blocks roll but ignore it."""
    for case, key, matters in [("swin_official_layout_cfg", "layers.2.blocks.1.attn_mask", True),
                               ("swin_tiny_cfg", "layers.0.blocks.1.attn_mask", False)]:
        record, tensors = load_vector(case)
        model = from_official(record).double()
        model.load_state_dict(official_state_dict(tensors), strict=True)
        model.eval()
        with torch.no_grad():
            model.get_submodule(key.rsplit(".", 1)[0]).attn_mask.zero_()
            changed = (model(tensors["input"]) - tensors["output"]).abs().max() > 1e-6
        assert changed == matters, case


def test_real_full_size_model_runs_other_sizes():
    model = timm.create_model("pola_swin_t").eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 256, 320))  # global linear stages resample their key tables
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    first, shifted_softmax = model.layers[0].blocks[1], model.layers[2].blocks[1]
    assert first.layout(64, 80) == ((64, 80), (0, 0))
    assert shifted_softmax.layout(16, 20) == ((7, 7), (3, 3))
    assert model.layers[3].blocks[0].layout(8, 10) == ((7, 7), (0, 0))


@pytest.mark.parametrize("size", [(224, 224), (256, 320)])
def test_features_only(size):
    model = timm.create_model("pola_swin_t", features_only=True, **SMALL).eval()
    assert model.feature_info.channels() == [16, 32, 64, 128]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    with torch.no_grad():
        feats = model(torch.randn(2, 3, *size))
    for f, c, r in zip(feats, [16, 32, 64, 128], [4, 8, 16, 32]):
        assert f.shape == (2, c, size[0] // r, size[1] // r)


def test_features_only_subset_and_intermediates():
    model = timm.create_model("pola_swin_t", features_only=True, out_indices=(1, 2), **SMALL).eval()
    assert len(model.model.layers) == 3 and model.model.layers[2].downsample is None
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert [f.shape[1:] for f in model(x)] == [(32, 8, 12), (64, 4, 6)]
    full = timm.create_model("pola_swin_t", **SMALL).eval()
    with torch.no_grad():
        final, inter = full.forward_intermediates(x, norm=True)
        torch.testing.assert_close(final, full.forward_features(x))
        torch.testing.assert_close(inter[-1], final.permute(0, 3, 1, 2))
        early = full.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
    assert len(early) == 1 and early[0].shape == (1, 16, 16, 24)


@pytest.mark.numerics
def test_padded_softmax_window_equals_attention_over_real_tokens():
    """A 7x7 window on a 5x6 grid: padding is masked, so the result is plain attention over the 30 real
    tokens with the bias of their offsets."""
    blk = PolaSwinBlock(8, (14, 14), 2, window_size=7, attn_type="S").eval()
    attn = blk.attn
    x = torch.randn(2, 5, 6, 8)
    rows, cols = torch.meshgrid(torch.arange(5), torch.arange(6), indexing="ij")
    pos = (rows * 7 + cols).flatten()
    bias = attn.relative_position_bias()[:, pos][:, :, pos]
    q, k, v = attn.qkv(x.reshape(2, 30, 8)).reshape(2, 30, 3, 2, 4).permute(2, 0, 3, 1, 4)
    ref = torch.softmax(q @ k.transpose(-2, -1) * attn.scale + bias, dim=-1) @ v
    ref = attn.proj(ref.transpose(1, 2).reshape(2, 30, 8))
    with torch.no_grad():
        torch.testing.assert_close(blk._attention(x).reshape(2, 30, 8), ref.detach())


@pytest.mark.numerics
def test_hard_mask_equals_official_additive_mask_forward_and_backward():
    """Separated pairs get weight 0 instead of exp(-100) (a float32 denormal, slow on x86): in float64 the
    block's output and every gradient agree with the official additive -100 mask to rounding."""
    torch.manual_seed(0)
    blk = PolaSwinBlock(16, (14, 14), 2, window_size=7, shift_size=3, attn_type="S").double()
    mask = blk._mask((14, 14), (7, 7), (3, 3), False, "cpu")
    assert torch.isneginf(mask).any() and not (mask.isfinite() & (mask != 0)).any()
    assert not torch.isneginf(mask).all(dim=-1).any()  # every token keeps itself
    x = torch.randn(2, 14, 14, 16, dtype=torch.float64, requires_grad=True)
    out = blk(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *blk.parameters()])
    official = blk.attn_mask.clone()
    blk._mask = lambda *args: official  # the official additive form
    ref = blk(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *blk.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grid,window,shift", [((14, 14), (7, 7), (3, 3)), ((10, 12), (7, 7), (3, 3)),
                                               ((5, 9), (4, 4), (0, 2)), ((6, 6), (4, 4), (0, 0))])
def test_shifted_window_mask_by_brute_force(grid, window, shift):
    """Real tokens of a window attend to each other iff the roll did not wrap one of them; never to padding."""
    (h, w), (wh, ww), (sh, sw) = grid, window, shift
    hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
    mask = shifted_window_mask(grid, window, shift)
    assert mask.shape == (hp * wp // (wh * ww), wh * ww, wh * ww)
    n_cols = wp // ww
    for win in range(mask.shape[0]):
        origin = []  # unrolled coordinates of the window's tokens
        for t in range(wh * ww):
            r, c = (win // n_cols) * wh + t // ww, (win % n_cols) * ww + t % ww
            origin.append(((r + sh) % hp, (c + sw) % wp))
        for i, (ri, ci) in enumerate(origin):
            if ri >= h or ci >= w:
                continue
            for j, (rj, cj) in enumerate(origin):
                allowed = rj < h and cj < w and (ri < sh) == (rj < sh) and (ci < sw) == (cj < sw)
                assert mask[win, i, j].item() == (0.0 if allowed else -100.0)


def test_windowed_linear_stages_pad_and_clip():
    model = PolaSwinTransformer(img_size=64, embed_dim=8, depths=(2, 2, 2, 1), num_heads=(1, 2, 2, 4), window_size=7,
                                attn_type="LLLL", num_classes=3).eval()
    assert model.layers[0].blocks[1].layout(24, 32) == ((7, 7), (3, 3))  # padded to 28x35
    assert model.layers[1].blocks[1].layout(6, 16) == ((6, 7), (0, 3))  # clipped side, key table resampled
    with torch.no_grad():
        assert model(torch.randn(2, 3, 96, 128)).shape == (2, 3)


def test_clear_errors():
    model = timm.create_model("pola_swin_t", **SMALL)
    with pytest.raises(ValueError, match="image size 100x100 is not divisible by 32"):
        model(torch.randn(1, 3, 100, 100))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="attn_type"):
        PolaSwinTransformer(attn_type="LLX")
    with pytest.raises(ValueError, match="window"):
        WindowAttention(8, 4, 2)(torch.randn(1, 9, 8))


def test_mixed_attn_type():
    assert block_attn_types("LLMS3", (2, 2, 5, 2))[2] == ["L", "L", "L", "S", "S"]
    assert block_attn_types("LLSS", (1, 1, 2, 1)) == [["L"], ["L"], ["S", "S"], ["S"]]


def test_timm_api():
    for name in VARIANTS:
        assert name in timm.list_models("pola_swin*")
    model = timm.create_model("pola_swin_t", num_classes=7, **SMALL)
    assert model.pretrained_cfg["architecture"] == "pola_swin_t" and model.get_classifier().out_features == 7
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 2, 2, 128)
    assert model.forward_head(feats, pre_logits=True).shape == (2, 128)
    model.reset_classifier(0)
    assert model(x).shape == (2, 128)
    skip = model.no_weight_decay()
    assert {"layers.0.blocks.0.attn.positional_encoding", "layers.0.blocks.0.attn.power",
            "layers.1.blocks.1.attn.scale", "layers.2.blocks.0.attn.relative_position_bias_table"} <= skip
    assert not any("qkv" in n or "norm" in n for n in skip)
    groups = timm.models.group_parameters(model, model.group_matcher())
    assert "layers.0.downsample.reduction.weight" in groups[1]  # with the last block of stage 1
    with_ape = PolaSwinTransformer(img_size=64, ape=True, **SMALL).eval()
    assert "absolute_pos_embed" in with_ape.no_weight_decay()
    with torch.no_grad():
        assert with_ape(torch.randn(1, 3, 96, 64)).shape == (1, 1000)


def test_grad_checkpointing_gives_the_same_gradients():
    model = timm.create_model("pola_swin_t", num_classes=5, drop_path_rate=0.0, **SMALL)
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)
