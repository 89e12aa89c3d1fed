"""timm conformance: the checks of timm's own tests/test_models.py, on the smallest model of each family.

The full suite (timm's test file against every model) is run by scripts/timm_conformance (docs/timm.md);
these are the same checks, written with timm's public API, at sizes that fit in CI.

Tolerances (tests/README.md, tests/tolerances.py): transforms and traced outputs exactly equal (the same kernels in
one order); the evaluation's mean loss over 2 images at 1e-6 absolute, float32's rounding of a cross-entropy of 2
terms of about 7 (u·n·|loss| ≈ 1e-6).
"""
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_model_data_config
from timm.layers import get_channel_dim
from timm.models import FeatureInfo
from timm.models._features_fx import create_feature_extractor, get_graph_node_names
from torchvision import transforms

import polaformer.models  # noqa: F401  (registers the zoo with timm)
from polaformer.data.folder import build_transform
from polaformer.finetune import load_for_finetune
from polaformer.tasks.classification.config import default_config
from polaformer.tasks.classification.evaluation import eval_transform, evaluate_folder_checkpoint

# The smallest variant of each family and the (C, H, W) input it is checked at.
SMALLEST = {
    "pola_deit_digits": (1, 8, 8),
    "pola_pvt_tiny": (3, 64, 64),
    "pola_pvt_v2_b0": (3, 64, 64),
    "pola_swin_t": (3, 64, 64),
    "POLA_b0": (3, 64, 64),
}
NAMES = list(SMALLEST)


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    """(name, model with 42 classes in eval mode, one input image), built once per model."""
    torch.manual_seed(0)
    name = request.param
    return name, timm.create_model(name, num_classes=42).eval(), torch.randn(1, *SMALLEST[name])


def feature_dim(model):
    return get_channel_dim(getattr(model, "output_fmt", "NCHW"))


def test_forward_backward_every_parameter_gets_a_gradient(case):
    name, model, _ = case
    try:
        out = model.train()(torch.randn(2, *SMALLEST[name]))
        out.mean().backward()
        assert out.shape == (2, 42) and torch.isfinite(out).all()
        assert [n for n, p in model.named_parameters() if p.grad is None] == []
    finally:
        model.eval().zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", NAMES)
def test_unpooled_pooled_and_headless_sizes(name):
    with torch.device("meta"):  # shapes only
        model = timm.create_model(name).eval()
        x = torch.empty(2, *SMALLEST[name])
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert feats.shape[-1 if feats.ndim == 3 else feature_dim(model)] == model.num_features
        assert pre.shape == (2, model.head_hidden_size)
        assert timm.create_model(name, num_classes=0)(x).shape == pre.shape
        unpooled = timm.create_model(name, num_classes=0, global_pool="")(x)
        assert unpooled.shape == feats.shape  # no head, no pooling: the unpooled features
        model.reset_classifier(0)
        assert model.num_classes == 0 and model(x).shape == pre.shape
        model.reset_classifier(0, "")
        assert model(x).shape == feats.shape


def test_reset_classifier_follows_the_model_device_and_dtype(case):
    name, _, _ = case
    model = timm.create_model(name, device="meta", dtype=torch.float64)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    model.reset_classifier(3)
    head = list(model.get_classifier().parameters())
    assert head and all(p.device.type == "meta" and p.dtype == torch.float64 for p in head)


@pytest.mark.parametrize("name", NAMES)
def test_features_only_default_and_custom_indices(name):
    with torch.device("meta"):  # shapes only
        features = timm.create_model(name, features_only=True).eval()
        x = torch.empty(2, *SMALLEST[name])
        maps = features(x)
    expected = 3 if name.startswith("pola_deit") else 4  # a ViT returns its last three blocks, as timm's
    assert len(maps) == len(features.feature_info.channels()) == expected
    for m, chans, reduction in zip(maps, features.feature_info.channels(), features.feature_info.reduction()):
        assert m.shape == (2, chans, x.shape[-2] // reduction, x.shape[-1] // reduction)
    with torch.device("meta"):
        picked = timm.create_model(name, features_only=True, out_indices=(1, 2))
        channels = [m.shape[1] for m in picked(x)]
    assert channels == picked.feature_info.channels() == features.feature_info.channels()[1:3]


def _eager_outputs(model, modules, x):
    """Outputs of the named modules in an eager forward (a ModuleList's: its last module's)."""
    seen = {}
    hooks = []
    for name in modules:
        module = model.get_submodule(name)
        if isinstance(module, torch.nn.ModuleList):
            module = module[-1]
        hooks.append(module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o)))
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def test_fx_feature_extraction_matches_the_eager_model(case):
    name, model, x = case
    modules = [info["module"] for info in model.feature_info]
    _, eval_nodes = get_graph_node_names(model)
    extractor = create_feature_extractor(model, {**{m: m for m in modules}, eval_nodes[-1]: "out"})
    with torch.no_grad():
        traced = extractor(x)
        out, eager = _eager_outputs(model, modules, x)
    # bit-identical, as timm's own test_model_forward_fx requires: the traced graph runs the same kernels
    torch.testing.assert_close(traced["out"], out, rtol=0, atol=0)
    for m in modules:
        torch.testing.assert_close(traced[m], eager[m], rtol=0, atol=0, msg=m)


def test_fx_traced_model_trains():
    torch.manual_seed(0)
    model = timm.create_model("POLA_b0", num_classes=5, **SMALL["POLA_b0"]).train()
    train_nodes, _ = get_graph_node_names(model)
    fx = create_feature_extractor(model, {train_nodes[-1]: "out"})
    fx(torch.randn(2, 3, 64, 64))["out"].mean().backward()
    assert all(p.grad is not None for p in fx.parameters())


def test_forward_intermediates_match_forward_features(case):
    _, model, x = case
    info = FeatureInfo(model.feature_info, len(model.feature_info))
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
    assert [t.shape[1] for t in intermediates] == info.channels()


def test_output_fmt():
    with torch.device("meta"):
        assert timm.create_model("pola_swin_t").output_fmt == "NHWC"  # (B, H, W, C) features, as timm's Swin
        feats = timm.create_model("pola_swin_t").forward_features(torch.empty(1, 3, 64, 64))
        assert feats.shape == (1, 2, 2, 768)
        for name in ("pola_pvt_tiny", "pola_pvt_v2_b0", "POLA_b0"):
            assert getattr(timm.create_model(name), "output_fmt", "NCHW") == "NCHW"


@pytest.mark.parametrize("name", NAMES)
def test_timm_training_arguments_are_accepted(name):
    """timm's train.py always passes drop_rate (and drop_path_rate); unknown arguments are refused."""
    with torch.device("meta"):
        timm.create_model(name, drop_rate=0.1, drop_path_rate=0.1)
        with pytest.raises(TypeError):
            timm.create_model(name, not_a_model_arg=1)


def test_polapp_takes_img_size():
    with torch.device("meta"):
        model = timm.create_model("POLA_b0", img_size=288)
        assert model(torch.empty(1, 3, 288, 288)).shape == (1, 1000)


@pytest.mark.parametrize("i", range(6))
def test_lower_case_aliases_are_deprecation_aliases(i):
    assert f"pola_b{i}" not in timm.list_models("pola*")
    with torch.device("meta"), pytest.warns(UserWarning, match=f"deprecated model name pola_b{i} to current POLA_b{i}"):
        model = timm.create_model(f"pola_b{i}")
    assert model.pretrained_cfg["architecture"] == f"POLA_b{i}"


# Small widths, so that a 288 model and a 224 checkpoint are quick to build.
SMALL = {
    "pola_deit_tiny_patch16_224": dict(depth=1, embed_dim=48, num_heads=2, key_pos_encoding=True),
    "pola_pvt_tiny": dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 2)),
    "pola_pvt_v2_b0": dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(1, 2, 2, 2)),
    "pola_swin_t": dict(depths=(1, 1, 2, 1), embed_dim=32, num_heads=(1, 2, 4, 8)),
    "POLA_b0": dict(embed_dims=(16, 24, 32, 48), depths=(1, 2, 2, 1), num_heads=(1, 1, 2, 3), projection=64),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_pretrained_file_made_at_224_loads_at_288(name, tmp_path):
    """``pretrained=True`` with a 224 file at img_size 288: tables resampled (as ``load_for_finetune``), strict."""
    torch.manual_seed(0)
    path = tmp_path / "model_224.pth"
    torch.save({"model": timm.create_model(name, **SMALL[name]).state_dict()}, path)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=288,
                              **SMALL[name]).eval()
    reference = timm.create_model(name, img_size=288, **SMALL[name])
    result = load_for_finetune(reference, path)
    assert bool(result.resampled) == (name != "POLA_b0")  # PolaFormer++ has no position tables
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 288, 288))).all()


def official_eval(size, crop):
    """The official evaluation transform, written out: square bicubic resize, centre crop, normalise."""
    resize = int(256 / 224 * size) if crop else size
    return transforms.Compose([
        transforms.Resize((resize, resize), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(size),
        transforms.ToTensor(),
        transforms.Normalize(timm.data.IMAGENET_DEFAULT_MEAN, timm.data.IMAGENET_DEFAULT_STD),
    ])


@pytest.mark.parametrize("name", ["pola_deit_tiny_patch16_224", "pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t",
                                  "pola_swin_b_384", "POLA_b0"])
def test_eval_transform_is_timms_data_config_and_the_official_one(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8))
    ours = eval_transform(model)(image)  # what `polaformer eval --data-path` applies
    timms = create_transform(**resolve_model_data_config(model))(image)
    size = model.pretrained_cfg["input_size"][-1]
    crop = model.pretrained_cfg["crop_pct"] < 1  # Pola-Swin-B-384 is evaluated without a crop
    torch.testing.assert_close(ours, timms, rtol=0, atol=0)
    torch.testing.assert_close(ours, official_eval(size, crop)(image), rtol=0, atol=0)
    cfg = default_config()
    cfg.DATA.IMG_SIZE, cfg.TEST.CROP = size, crop
    torch.testing.assert_close(build_transform(cfg, is_train=False)(image), ours, rtol=0, atol=0)  # training's


def test_polaformer_eval_scores_what_timms_pipeline_feeds(tmp_path):
    """`polaformer eval --data-path` at a model's own size: the loss of timm's data config, image by image."""
    torch.manual_seed(0)
    model = timm.create_model("pola_pvt_v2_b0", num_classes=2, depths=(1, 1, 1, 1)).eval()
    torch.save({"model": model.state_dict()}, tmp_path / "model.pth")
    rng = np.random.default_rng(0)
    images = []
    for label, (name, size) in enumerate([("a", (300, 500)), ("b", (257, 311))]):
        (tmp_path / "data" / "val" / name).mkdir(parents=True)
        image = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        image.save(tmp_path / "data" / "val" / name / "image.png")
        images.append((image, label))
    result = evaluate_folder_checkpoint(tmp_path / "model.pth", tmp_path / "data", model="pola_pvt_v2_b0",
                                        model_kwargs=dict(depths=(1, 1, 1, 1)), device="cpu")
    pipeline = create_transform(**resolve_model_data_config(model))
    with torch.no_grad():
        logits = model(torch.stack([pipeline(image) for image, _ in images]))
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([label for _, label in images])).item()
    assert result.metrics["loss"] == pytest.approx(expected, abs=1e-6)
