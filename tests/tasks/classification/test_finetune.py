"""Fine-tuning loads: 224 -> 384 (Pola-Swin-B-384 recipe), new class counts, PVT and DeiT tables.

Tolerances (tests/README.md, tests/tolerances.py): the resampled tables at 1e-5: float32 interpolation of constant
rows; the resampled models against the models that resample the same tables themselves, float32 at 1e-5: the same
computation but for the tables' own rounding, probable_rtol of the reductions of these small models."""
import logging

import pytest
import timm
import torch

import polaformer.models  # noqa: F401  (registers the zoo with timm)
from polaformer.checkpoint import ArchitectureMismatchError, LoadResult, MissingWeightsError
from polaformer.finetune import load_for_finetune, resample_position_table, resample_relative_position_bias
from polaformer.layers.window_attention import relative_position_index

SWIN_SMALL = dict(depths=(1, 1, 2, 1), embed_dim=32, num_heads=(1, 2, 4, 8))  # stage 3 has a shifted block
PVT_SMALL = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 2))
DEIT_SMALL = dict(depth=1, embed_dim=48, num_heads=2, key_pos_encoding=True)


def build(name, seed, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model(name, **kwargs).eval()


def save_official(model, path, **extra):
    """The authors' layout: a dict with 'model' (and PolaFormer++'s 'state_dict_ema')."""
    torch.save({"model": model.state_dict(), "epoch": 299, "max_accuracy": 83.5, **extra}, path)
    return path


def assert_same_shape_tensors_equal(model, source_state, skip=()):
    loaded = model.state_dict()
    compared = 0
    for key, value in source_state.items():
        if key in loaded and loaded[key].shape == value.shape and not key.endswith(skip):
            assert torch.equal(loaded[key], value), key
            compared += 1
    return compared


@pytest.fixture(scope="module")
def swin_pair(tmp_path_factory):
    """A reduced Pola-Swin-B at 224 saved in official format, and a 384 model loaded from it."""
    source = build("pola_swin_b", 0, **SWIN_SMALL)
    with torch.no_grad():  # a constant per head, to check that resampling keeps constants constant
        for i, block in enumerate(source.layers[3].blocks):
            table = block.attn.relative_position_bias_table
            table.copy_(torch.arange(table.shape[1], dtype=table.dtype).expand_as(table) + 0.5 * i)
    path = save_official(source, tmp_path_factory.mktemp("swin") / "pola_swin_b_224.pth")
    target = build("pola_swin_b_384", 1, **SWIN_SMALL)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    result = load_for_finetune(target, path)
    return source, target, fresh, result


def test_swin_224_to_384_keeps_every_fitting_tensor(swin_pair):
    source, target, _, result = swin_pair
    assert isinstance(result, LoadResult) and result.entry == "model" and result.epoch == 299
    assert result.max_accuracy == pytest.approx(83.5)
    compared = assert_same_shape_tensors_equal(target, source.state_dict())
    assert compared > 30
    assert result.missing_keys == [] and result.unexpected_keys == [] and result.reinitialised == []


def test_swin_bias_tables_resampled_to_the_12x12_windows(swin_pair):
    source, target, _, result = swin_pair
    tables = [k for k in target.state_dict() if k.endswith("relative_position_bias_table")]
    assert len(tables) == 3
    for key in tables:
        assert result.resampled[key] == ((13 * 13, source.state_dict()[key].shape[1]),
                                         (23 * 23, target.state_dict()[key].shape[1]))
        assert key in result.mismatched_keys
        expected = resample_relative_position_bias(source.state_dict()[key], (12, 12))
        assert torch.equal(target.state_dict()[key], expected)
    for i, block in enumerate(target.layers[3].blocks):  # the constant tables stay constant per head
        table = block.attn.relative_position_bias_table
        heads = torch.arange(table.shape[1], dtype=table.dtype) + 0.5 * i
        torch.testing.assert_close(table, heads.expand_as(table), rtol=0, atol=1e-5)


def test_swin_layout_buffers_come_from_the_model(swin_pair):
    _, target, fresh, result = swin_pair
    buffers = [k for k in fresh if k.endswith(("relative_position_index", "attn_mask"))]
    assert sorted(result.from_model) == sorted(buffers)
    assert "layers.2.blocks.1.attn_mask" in buffers
    for key in buffers:
        assert torch.equal(target.state_dict()[key], fresh[key]), key
    assert torch.equal(target.layers[2].blocks[0].attn.relative_position_index, relative_position_index(12, 12))


def test_swin_key_positional_encodings_resampled_like_the_224_model_runs_at_384(swin_pair):
    source, target, _, result = swin_pair
    # The linear stages are global: at 384 their key grids are 96x96 and 48x48.
    for stage, grid in ((0, 96), (1, 48)):
        key = f"layers.{stage}.blocks.0.attn.positional_encoding"
        assert result.resampled[key][1] == (1, grid * grid, 32 * 2 ** stage)
        expected = source.layers[stage].blocks[0].attn._key_positions((grid, grid))
        assert torch.equal(target.state_dict()[key], expected)


def test_swin_384_forward(swin_pair):
    _, target, _, _ = swin_pair
    with torch.no_grad():
        out = target(torch.randn(1, 3, 384, 384))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_new_number_of_classes_keeps_the_fresh_head(tmp_path, caplog):
    source = build("pola_swin_b", 0, **SWIN_SMALL)
    path = save_official(source, tmp_path / "in1k.pth")
    target = build("pola_swin_b", 1, num_classes=7, **SWIN_SMALL)
    head = {k: v.clone() for k, v in target.head.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="polaformer.finetune"):
        result = load_for_finetune(target, path)
    assert sorted(result.reinitialised) == ["head.bias", "head.weight"]
    assert sorted(result.mismatched_keys) == ["head.bias", "head.weight"] and not result.resampled
    for name, value in target.head.state_dict().items():
        assert torch.equal(value, head[name])
    assert assert_same_shape_tensors_equal(target, source.state_dict()) == len(source.state_dict()) - 2
    assert "new classifier, freshly initialised: head.weight, head.bias" in caplog.text


def test_headless_model_and_headless_file(tmp_path):
    source = build("pola_pvt_tiny", 0, **PVT_SMALL)
    path = save_official(source, tmp_path / "pvt.pth")
    headless = build("pola_pvt_tiny", 1, num_classes=0, **PVT_SMALL)
    result = load_for_finetune(headless, path)  # the file's head is dropped, not "unexpected"
    assert result.unexpected_keys == [] and result.missing_keys == []
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}
    torch.save(state, tmp_path / "backbone.pth")
    target = build("pola_pvt_tiny", 2, num_classes=5, **PVT_SMALL)
    result = load_for_finetune(target, tmp_path / "backbone.pth")
    assert sorted(result.reinitialised) == ["head.bias", "head.weight"] and result.entry is None


def test_pvt_224_to_256_matches_the_224_model_run_at_256(tmp_path):
    source = build("pola_pvt_tiny", 0, **PVT_SMALL)
    path = save_official(source, tmp_path / "pvt.pth")
    target = build("pola_pvt_tiny", 1, img_size=256, **PVT_SMALL)
    result = load_for_finetune(target, path)
    for i, grid in enumerate((64, 32, 16, 8), start=1):
        assert result.resampled[f"pos_embed{i}"][1] == (1, grid * grid, PVT_SMALL["embed_dims"][i - 1])
        assert f"block{i}.0.attn.positional_encoding" in result.resampled
    assert len(result.resampled) == 8
    assert_same_shape_tensors_equal(target, source.state_dict())
    x = torch.randn(2, 3, 256, 256)
    with torch.no_grad():  # the tables are resampled exactly as the 224 model resamples them at 256
        torch.testing.assert_close(target(x), source(x), rtol=1e-5, atol=1e-5)


def test_pvt_v2_224_to_256_key_tables(tmp_path):
    source = build("pola_pvt_v2_b0", 0, **PVT_SMALL)
    path = save_official(source, tmp_path / "pvt_v2.pth")
    target = build("pola_pvt_v2_b0", 1, img_size=256, **PVT_SMALL)
    result = load_for_finetune(target, path)
    assert sorted(result.resampled) == [f"block{i}.0.attn.positional_encoding" for i in range(1, 5)]
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=1e-5, atol=1e-5)


def test_deit_224_to_384_keeps_the_class_token_row(tmp_path):
    source = build("pola_deit_tiny_patch16_224", 0, **DEIT_SMALL)
    ema = build("pola_deit_tiny_patch16_224", 3, **DEIT_SMALL)
    path = save_official(source, tmp_path / "deit.pth", state_dict_ema=ema.state_dict())
    target = build("pola_deit_tiny_patch16_224", 1, img_size=384, **DEIT_SMALL)
    result = load_for_finetune(target, path, weights="raw")
    assert result.entry == "model"
    assert result.resampled["pos_embed"] == ((1, 1 + 14 * 14, 48), (1, 1 + 24 * 24, 48))
    assert result.resampled["blocks.0.attn.positional_encoding"] == ((1, 1 + 14 * 14, 48), (1, 1 + 24 * 24, 48))
    assert torch.equal(target.pos_embed[:, 0], source.pos_embed[:, 0])
    assert torch.equal(target.blocks[0].attn.positional_encoding[:, 0], source.blocks[0].attn.positional_encoding[:, 0])
    x = torch.randn(1, 3, 384, 384)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=1e-5, atol=1e-5)

    from_ema = build("pola_deit_tiny_patch16_224", 1, img_size=384, **DEIT_SMALL)
    assert load_for_finetune(from_ema, path).entry == "state_dict_ema"  # 'auto' prefers EMA
    assert torch.equal(from_ema.head.weight, ema.head.weight)


def test_resample_helpers():
    table = torch.randn(1, 1 + 4, 3)
    out = resample_position_table(table, (4, 4), num_prefix_tokens=1, mode="bilinear", antialias=False)
    assert out.shape == (1, 17, 3) and torch.equal(out[:, 0], table[:, 0])
    assert torch.equal(resample_position_table(table, (2, 2), num_prefix_tokens=1), table)
    assert resample_relative_position_bias(torch.randn(9, 2), (3, 4)).shape == (5 * 7, 2)
    with pytest.raises(ValueError, match="not a square grid"):
        resample_relative_position_bias(torch.randn(10, 2), (3, 3))


def test_other_architecture_is_refused_before_loading(tmp_path):
    source = build("pola_pvt_tiny", 0, **PVT_SMALL)
    path = save_official(source, tmp_path / "pvt.pth")
    target = build("pola_pvt_tiny", 1, **{**PVT_SMALL, "embed_dims": (16, 32, 64, 128)})
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ArchitectureMismatchError, match="outside the position tables") as error:
        load_for_finetune(target, path)
    assert "\n" not in str(error.value)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    result = load_for_finetune(target, path, strict=False)
    assert "block4.0.attn.qg.weight" in result.mismatched_keys
    assert "block4.0.attn.qg.weight" not in result.resampled
    assert torch.equal(target.patch_embed1.proj.weight, source.patch_embed1.proj.weight)


def test_missing_ema_weights(tmp_path):
    source = build("pola_pvt_tiny", 0, **PVT_SMALL)
    path = save_official(source, tmp_path / "pvt.pth")
    with pytest.raises(MissingWeightsError):
        load_for_finetune(build("pola_pvt_tiny", 0, **PVT_SMALL), path, weights="ema")
