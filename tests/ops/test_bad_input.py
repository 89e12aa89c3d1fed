"""Bad input through the API: data folders with link loops and high-bit-depth images, empty batches,
the attention op's boundary, models and checkpoints described wrongly. (The command line's cases
are in test_cli_errors.py.)"""
import logging
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from torch import nn

import polaformer.models  # noqa: F401  (registers the zoo with timm)
from polaformer.checkpoint import CorruptCheckpointError, check_weight_values, load_checkpoint
from polaformer.data.folder import ImageFolderDataset, to_rgb
from polaformer.engine import ModelBuildError, create_model, create_model_from_checkpoint
from polaformer.finetune import load_for_finetune
from polaformer.ops import pacs_linear_attention, pola_linear_attention

# --- data folders ------------------------------------------------------------------------------

def _images(folder, count, value=0):
    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(np.full((8, 8, 3), value + i, dtype=np.uint8)).save(folder / f"{i}.png")


def test_link_loops_and_links_across_classes_and_splits(tmp_path, caplog):
    for split in ("train", "val"):
        for c in ("a", "b"):
            _images(tmp_path / split / c, 3)
    os.symlink(".", tmp_path / "train" / "a" / "self")  # a loop: followed 40 levels deep before
    os.symlink("../b", tmp_path / "train" / "a" / "to_b")  # into another class: b's images are b's
    os.symlink(tmp_path / "val" / "b", tmp_path / "train" / "b" / "from_val")  # leaves the split
    with caplog.at_level(logging.WARNING, logger="polaformer.data.folder"):
        dataset = ImageFolderDataset(str(tmp_path / "train"))
    paths = [os.path.relpath(path, tmp_path / "train") for path, _ in dataset.samples]
    assert paths == ["a/0.png", "a/1.png", "a/2.png", "b/0.png", "b/1.png", "b/2.png",
                     "b/from_val/0.png", "b/from_val/1.png", "b/from_val/2.png"]
    assert dataset.targets.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "skipped 2 symbolic links" in messages
    assert "1 symbolic links lead outside this split" in messages and str(tmp_path / "val" / "b") in messages


def test_sixteen_bit_and_float_images_keep_their_range(tmp_path):
    ramp16 = (np.arange(256, dtype=np.uint16).reshape(16, 16) * 257)  # 0 .. 65535
    Image.fromarray(ramp16).save(tmp_path / "ramp16.png")
    ramp_float = (np.arange(256, dtype=np.float32).reshape(16, 16) / 255)  # 0 .. 1
    Image.fromarray(ramp_float, mode="F").save(tmp_path / "ramp.tiff")
    expected = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for name in ("ramp16.png", "ramp.tiff"):
        image = Image.open(tmp_path / name)
        assert image.mode in ("I;16", "I", "F")
        rgb = np.asarray(to_rgb(image))
        assert rgb.shape == (16, 16, 3) and (rgb == expected[..., None]).all(), name
    wide = Image.fromarray(np.array([[-5.0, 5.0]], dtype=np.float32), mode="F")  # outside [0, 1]: its own range
    assert np.asarray(to_rgb(wide))[0, :, 0].tolist() == [0, 255]
    assert np.asarray(to_rgb(Image.new("RGB", (2, 2), (1, 2, 3))))[0, 0].tolist() == [1, 2, 3]


# --- empty batches -----------------------------------------------------------------------------

FAMILIES = {
    "pola_deit_tiny_patch16_224": dict(depth=1, img_size=32, patch_size=8, embed_dim=16, num_heads=2),
    "pola_pvt_tiny": dict(img_size=64, depths=[1, 1, 1, 1], embed_dims=[16, 16, 16, 16], num_heads=[1, 1, 1, 1]),
    "pola_pvt_v2_b0": dict(depths=[1, 1, 1, 1]),
    "pola_swin_t": dict(img_size=64, window_size=2, depths=[1, 1, 1, 1], embed_dim=16, num_heads=[1, 1, 1, 1]),
    "POLA_b0": dict(),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_empty_batch_gives_empty_outputs_of_the_right_shape(name):
    model = timm.create_model(name, num_classes=7, **FAMILIES[name])
    size = FAMILIES[name].get("img_size", 64)
    one = torch.randn(1, 3, size, size)
    with torch.no_grad():
        model.eval()
        features, (final, maps) = model.forward_features(one), model.forward_intermediates(one)
    model.train()
    logits = model(one[:0])
    assert logits.shape == (0, 7) and model.training
    logits.sum().backward()  # an empty loss still back-propagates (to zero gradients)
    assert model.forward_features(one[:0]).shape == (0, *features.shape[1:])
    empty_final, empty_maps = model.forward_intermediates(one[:0])
    assert empty_final.shape == (0, *final.shape[1:])
    assert [m.shape[1:] for m in empty_maps] == [m.shape[1:] for m in maps] and all(len(m) == 0 for m in empty_maps)


# --- the attention op's boundary ---------------------------------------------------------------

def _qkv(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 5, 4, generator=g, dtype=dtype), torch.randn(2, 3, 6, 4, generator=g, dtype=dtype),
            torch.randn(2, 3, 6, 8, generator=g, dtype=dtype))


def test_power_as_a_number_or_0d_tensor_equals_the_broadcast_tensor():
    q, k, v = _qkv()
    full = pola_linear_attention(q, k, v, torch.full((3, 1, 4), 2.5, dtype=torch.float64))
    for power in (2.5, torch.tensor(2.5, dtype=torch.float64)):
        torch.testing.assert_close(pola_linear_attention(q, k, v, power), full, rtol=0, atol=0)


@pytest.mark.parametrize("power, error, message", [
    (torch.full((2, 3, 5, 4), 2.0), ValueError, "power must broadcast to (B, H, 1, d) = (2, 3, 1, 4)"),
    (torch.full((7,), 2.0), ValueError, "got (7,)"),
    (torch.full((1, 1, 1, 1, 4), 2.0), ValueError, "power must broadcast"),
    (torch.tensor(0.5), ValueError, "power must be >= 1 everywhere"),
    (torch.tensor([1.5, 1.5, 0.9, 2.0]), ValueError, "minimum of 0.9"),
    (torch.tensor(float("nan")), ValueError, "power must be finite, got NaN or infinite values"),
    (torch.tensor([2.0, float("inf"), 2.0, 2.0]), ValueError, "power must be finite"),
    (torch.tensor(2), TypeError, "power must be a floating-point tensor, got torch.int64"),
    ("2", TypeError, "power must be a tensor, got str"),
])
def test_bad_power_is_refused_at_the_boundary(power, error, message):
    q, k, v = _qkv(torch.float32)
    with pytest.raises(error) as info:
        pola_linear_attention(q, k, v, power)
    assert message in str(info.value)


@pytest.mark.parametrize("eps", [float("nan"), -1e-6, float("inf")])
@pytest.mark.parametrize("grad", [False, True])  # the native no-gradient forward and the torch autograd path
def test_bad_eps_is_refused(eps, grad):
    q, k, v = _qkv(torch.float32)
    q.requires_grad_(grad)
    with pytest.raises(ValueError, match=f"eps must be a finite number >= 0, got {eps}"):
        pola_linear_attention(q, k, v, 2.0, eps)


@pytest.mark.parametrize("eps", [float("nan"), -1.0])
def test_bad_eps_is_refused_by_pacs_too(eps):
    """The docs promised it of both ops; PaCS computed with it (a NaN output, or a negative normaliser)."""
    q, k, v = _qkv(torch.float32)
    temps = torch.rand(1, 3, 1, 2 * q.shape[-1])
    with pytest.raises(ValueError, match=f"eps must be a finite number >= 0, got {eps}"):
        pacs_linear_attention(q, k, v, temps, temps, eps=eps)


@pytest.mark.parametrize("power", [float("nan"), float("inf")])
def test_non_finite_power_is_refused_on_the_native_path(power):
    q, k, v = _qkv(torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="power must be finite"):
        pola_linear_attention(q, k, v, torch.full((4,), power))


def test_integer_inputs_are_refused():
    q, k, v = (t.round().long() for t in _qkv())
    with pytest.raises(TypeError, match="q must be a floating-point tensor, got torch.int64"):
        pola_linear_attention(q, k, v, 2.0)
    temp = torch.full((8,), 0.5)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        pacs_linear_attention(q, k, v, temp, temp)


# --- models and checkpoints described wrongly ---------------------------------------------------

@pytest.mark.parametrize("arch, kwargs, message", [
    (42, {}, "unknown model 42"),
    ("pola_deit_digits", {"embed_dim": -5}, "embed_dim must be positive, got -5"),
    ("pola_deit_digits", {"depth": 10**9}, "for its weights"),
    ("pola_pvt_tiny", {"img_size": 10**6}, "for its weights"),
    ("pola_deit_digits", {"num_heads": 3}, "cannot build model"),  # 64 channels in 3 heads
])
def test_create_model_refuses_before_allocating(arch, kwargs, message):
    with pytest.raises(ModelBuildError, match=message.replace("(", r"\(")):
        create_model(arch, 10, **kwargs)


def test_checkpoint_with_wrong_metadata_via_the_api(tmp_path):
    from polaformer.engine import read_run_checkpoint

    model = create_model("pola_deit_digits", 10)
    good = {"model": model.state_dict(), "arch": "pola_deit_digits", "model_kwargs": {}, "num_classes": 10}
    for change, message in [({"arch": 42}, "'arch' must be a model name"),
                            ({"model_kwargs": "depth=2"}, "'model_kwargs' must be a dict"),
                            ({"num_classes": -1}, "'num_classes' must be an integer >= 0")]:
        path = tmp_path / "bad.pth"
        torch.save({**good, **change}, path)
        with pytest.raises(CorruptCheckpointError, match=message):
            read_run_checkpoint(path)
    complex_weights = {**good["model"], "head.weight": good["model"]["head.weight"].to(torch.complex64)}
    with pytest.raises(CorruptCheckpointError, match="'head.weight' is complex64"):
        create_model_from_checkpoint({**good, "model": complex_weights}, "x.pth")


def test_non_finite_weights_are_refused_unless_allowed():
    expected = {"w": torch.zeros(3), "index": torch.zeros(3, dtype=torch.long)}
    found = {"w": torch.tensor([0.0, float("inf"), 1.0]), "index": torch.tensor([0, 1, 2])}  # int index: fine
    with pytest.raises(CorruptCheckpointError, match="weight 'w' holds NaN or infinite values; allow_nonfinite=True "
                                                     r"\(--allow-nonfinite of `polaformer eval`\) loads it anyway\)$"):
        check_weight_values(expected, found, "x.pth", allow_nonfinite=False)
    check_weight_values(expected, found, "x.pth", allow_nonfinite=True)


def test_a_loader_without_the_nonfinite_switch_names_none(tmp_path):
    # fine-tuning and task checkpoints have no allow_nonfinite: their refusal must not point to one
    model = nn.Linear(3, 2)
    path = tmp_path / "inf.pth"
    torch.save({"model": {"weight": torch.full((2, 3), float("inf")), "bias": torch.zeros(2)}}, path)
    with pytest.raises(CorruptCheckpointError, match=r"weight 'weight' holds NaN or infinite values\)$"):
        load_for_finetune(model, path)
    with pytest.raises(CorruptCheckpointError, match="allow_nonfinite=True"):
        load_checkpoint(model, path)


# --- issue 51: the causal step checks its state; sizes out of range are named ---------------------

def _pola_state(batch=2, heads=2, head_dim=4):
    from polaformer.ops import causal_pola_step

    q = torch.randn(batch, heads, 1, head_dim)
    return causal_pola_step(q, q, torch.randn(batch, heads, 1, head_dim), 2.0)[1]


STATE_CASES = [
    ("another batch", dict(batch=3), ValueError,
     "state.kv[0] is (2, 2, 8, 2), these tokens (batch 3, 2 heads, head_dim 4, value head_dim 4) continue from "
     "(3, 2, 8, 2): pass the state of these sequences, or None to start new ones"),
    ("other heads", dict(heads=3), ValueError, "these tokens (batch 2, 3 heads, head_dim 4, value head_dim 4)"),
    ("another head_dim", dict(head_dim=6), ValueError, "state.kv[0] is (2, 2, 8, 2), these tokens (batch 2, 2 heads, "
                                                       "head_dim 6, value head_dim 6) continue from (2, 2, 12, 3)"),
]


@pytest.mark.parametrize("name, shape, error, message", STATE_CASES, ids=[c[0] for c in STATE_CASES])
@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_the_causal_step_refuses_the_state_of_other_sequences(op, name, shape, error, message):
    """A state carried to tokens of another batch, other heads or sizes failed deep in the recurrence
    ('The size of tensor a (2) must match...'); now one line naming the state's shape and the tokens'."""
    from polaformer.ops import causal_pacs_linear_attention, causal_pacs_step, causal_pola_step

    size = dict(batch=2, heads=2, head_dim=4) | shape
    q = torch.randn(size["batch"], size["heads"], 1, size["head_dim"])
    with pytest.raises(error) as info:
        if op == "pola":
            causal_pola_step(q, q, q, 2.0, _pola_state())
        else:
            temps = torch.ones(1, size["heads"], 1, 2 * size["head_dim"])
            causal_pacs_step(q, q, q, temps, temps, state=_pola_state())
    assert message in str(info.value)
    if op == "pacs":  # the chunked form's initial_state, the same check
        q = torch.randn(size["batch"], size["heads"], 5, size["head_dim"])
        with pytest.raises(error, match="pass the state of these sequences"):
            causal_pacs_linear_attention(q, q, q, temps, temps, initial_state=_pola_state())


@pytest.mark.parametrize("state, error, message", [
    ((1, 2), TypeError, "state must be the CausalState a previous call returned (or None), got tuple"),
    ("kv", TypeError, "got str"),
])
def test_the_causal_step_refuses_what_is_no_state(state, error, message):
    from polaformer.ops import causal_pola_step

    q = torch.randn(2, 2, 1, 4)
    with pytest.raises(error) as info:  # was: 'tuple' object has no attribute 'kv'
        causal_pola_step(q, q, q, 2.0, state)
    assert message in str(info.value)


def test_the_causal_step_refuses_a_state_of_wrong_parts():
    from polaformer.ops import CausalState, causal_pola_step

    q = torch.randn(2, 2, 1, 4)
    state = _pola_state()
    with pytest.raises(ValueError, match=r"state.kv must hold the two streams' tensors, got a tuple of 1"):
        causal_pola_step(q, q, q, 2.0, CausalState(state.kv[:1], state.key_sum, state.count))
    with pytest.raises(TypeError, match="state.count must be a floating-point tensor, got torch.int64"):
        causal_pola_step(q, q, q, 2.0, state._replace(count=state.count.long()))
    with pytest.raises(ValueError, match=r"state.key_sum is on meta, the tokens on cpu"):
        causal_pola_step(q, q, q, 2.0, state._replace(key_sum=state.key_sum.to("meta")))


def test_a_state_in_another_float_dtype_continues_in_the_compute_dtype():
    """A float32 state carried into float64 tokens (as a float64 model's first step from an empty cache) continues
    them exactly as the float64 state would."""
    from polaformer.ops import causal_pola_step

    q = torch.randn(2, 2, 1, 4, dtype=torch.float64)
    state = _pola_state()
    same = state._replace(kv=tuple(t.double() for t in state.kv), key_sum=state.key_sum.double(),
                          count=state.count.double())
    out, carried = causal_pola_step(q, q, q, 2.0, state)
    expected, _ = causal_pola_step(q, q, q, 2.0, same)
    assert carried.key_sum.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layer", ["PolaCausalSelfAttention", "PacsCausalSelfAttention"])
def test_a_causal_layer_step_checks_its_cache(layer):
    import polaformer.layers

    module = getattr(polaformer.layers, layer)(16, 2)
    _, cache = module.step(torch.randn(2, 1, 16))
    with pytest.raises(ValueError, match=r"cache.conv_tail is \(2, 3, 16\), these tokens \(batch 3\) continue from "
                                         r"\(3, 3, 16\): pass the cache of these sequences, or None"):
        module.step(torch.randn(3, 1, 16), cache)
    for wrong in (cache.attention, (1, 2)):  # the attention's state alone, or no cache at all
        with pytest.raises(TypeError, match="cache must be the CausalCache a previous step returned"):
            module.step(torch.randn(2, 1, 16), wrong)
    with pytest.raises(ValueError, match="cache.position must be an integer >= 0, got -1"):
        module.step(torch.randn(2, 1, 16), cache._replace(position=-1))
    without_conv = getattr(polaformer.layers, layer)(16, 2, kernel_size=0)
    _, cache = without_conv.step(torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match=r"state.kv\[0\] is \(2, 2, 16, 4\), these tokens \(batch 3"):
        without_conv.step(torch.randn(3, 1, 16), cache)  # the op's check, where no conv tail tells batches apart


def test_rope_1d_refuses_a_negative_length():
    from polaformer.ops import rope_1d

    with pytest.raises(ValueError, match=r"length must be an integer >= 0 \(a number of tokens\), got -1"):
        rope_1d(torch.ones(4), -1)  # torch.arange's 'upper bound and lower bound inconsistent with step sign'
    sin, cos = rope_1d(torch.ones(4), 0)
    assert sin.shape == cos.shape == (0, 4)


@pytest.mark.parametrize("size", [(0, 0), (0, 5), (7, 0)])
def test_pola_sr_on_an_image_of_no_pixel_gives_the_empty_upscaled_image(size):
    model = timm.create_model("pola_sr_light_x2", embed_dim=8, depths=(1,), num_heads=(2,), window_size=8)
    out = model(torch.zeros(1, 3, *size))  # a conv's 'Kernel size can't be greater than actual input size' before
    assert out.shape == (1, 3, 2 * size[0], 2 * size[1])
