"""pola_sr_light_x*: the official PolaFormer++ SR class's keys, shapes and parameter counts, its float64 outputs on a
tiny configuration, the official test's partition of large images, and tiled inference. The data files come from
scripts/make_sr_reference.py.

Tolerances (tests/README.md, tests/tolerances.py): the float64 fixture at 1e-10, far above reorder_rtol(n, float64)
through the model's convs and windows (a few hundred terms per sum)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from polaformer.models.pola_sr import PolaSR, chop_upscale, tiled_upscale

DATA = Path(__file__).resolve().parents[1] / "data"
MANIFEST = json.loads((DATA / "pola_sr_manifest.json").read_text())
CHOP = json.loads((DATA / "pola_sr_chop.json").read_text())["cases"]


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_official_keys_shapes_and_parameter_count(scale):
    official = MANIFEST[f"x{scale}"]
    with torch.device("meta"):
        model = timm.create_model(f"pola_sr_light_x{scale}")
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == official["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == official["parameters"]
    assert official["parameters"] == {2: 923_852, 3: 930_347, 4: 939_440}[scale]


@pytest.mark.numerics
def test_float64_outputs_equal_the_official_class():
    path = DATA / "pola_sr_reference.safetensors"
    with safe_open(str(path), "pt") as f:
        config = json.loads(f.metadata()["config"])
    reference = load_file(path)
    model = PolaSR(**config).double().eval()
    model.load_state_dict({k.removeprefix("state."): v for k, v in reference.items() if k.startswith("state.")},
                          strict=True)
    x = reference["input"]
    assert x.shape[-1] % config["window_size"]  # the mirror padding and the crop are exercised
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference["output"], rtol=1e-10, atol=1e-10)


class PieceProbe(torch.nn.Module):
    """A stand-in network, as the reference script's: records each piece (where it was cut, from its first
    pixel, its size, and the sums of what it holds) and answers with its number and each output pixel's row and
    column within the piece."""

    def __init__(self, scale: int):
        super().__init__()
        self.scale, self.reads = scale, []

    def forward(self, piece):
        self.reads.append([int(piece[0, 0, 0, 0]), int(piece[0, 1, 0, 0]), *piece.shape[-2:],
                           float(piece[0, 0].sum()), float(piece[0, 1].sum())])
        h, w = piece.shape[-2] * self.scale, piece.shape[-1] * self.scale
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack([torch.full((h, w), len(self.reads) - 1), rows, cols])[None].to(piece.dtype)


def coordinates(h: int, w: int) -> torch.Tensor:
    """A (1, 3, h, w) image whose pixels hold their row and column."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([rows, cols, torch.zeros_like(rows)])[None].double()


@pytest.mark.parametrize("case", CHOP, ids=lambda c: "{}x{}-x{}".format(*c["size"], c["scale"]))
def test_chop_partitions_as_the_official_test(case):
    """Pieces read from the same windows of the same reflect-padded image, in the same order, and the merged
    output takes the same pixels of each (the official MambaIRv2LightModel.test, recorded in
    tests/data/pola_sr_chop.json)."""
    (h, w), scale = case["size"], case["scale"]
    probe = PieceProbe(scale)
    out = chop_upscale(probe, coordinates(h, w), scale)[0]
    assert probe.reads == case["reads"]
    expected = torch.full((3, h * scale, w * scale), -1.0, dtype=torch.float64)
    for number, write in enumerate(case["writes"]):
        (top, left, height, width), (row, col) = write["window"], write["from"]
        expected[0, top:top + height, left:left + width] = number
        expected[1, top:top + height, left:left + width] = torch.arange(row, row + height)[:, None].double()
        expected[2, top:top + height, left:left + width] = torch.arange(col, col + width).double()
    assert torch.equal(out, expected)


def test_chop_keeps_a_small_image_whole_and_runs_the_model_on_pieces():
    model = PolaSR(upscale=2, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4).eval()
    lr = torch.rand(1, 3, 9, 6)
    with torch.no_grad():
        torch.testing.assert_close(chop_upscale(model, lr, 2), model(lr))
    upsample = torch.nn.Upsample(scale_factor=2, mode="nearest")
    lr = torch.rand(2, 3, 203, 17)
    torch.testing.assert_close(chop_upscale(upsample, lr, 2), upsample(lr))


def test_tiles_reassemble_a_pixelwise_model_exactly():
    upsample = torch.nn.Upsample(scale_factor=3, mode="nearest")
    lr = torch.rand(2, 3, 37, 50)
    out = tiled_upscale(upsample, lr, scale=3, tile=16, overlap=4)
    torch.testing.assert_close(out, upsample(lr))


def test_one_tile_is_one_call_and_sizes_are_restored():
    model = PolaSR(upscale=2, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4).eval()
    lr = torch.rand(1, 3, 9, 6)
    with torch.no_grad():
        full = model(lr)
    assert full.shape == (1, 3, 18, 12)
    torch.testing.assert_close(tiled_upscale(model, lr, 2, tile=16, overlap=4), full)
    assert tiled_upscale(model, lr, 2, tile=4, overlap=1).shape == full.shape


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="embed_dim must be divisible by 8"):
        PolaSR(embed_dim=12)
    with pytest.raises(ValueError, match="upscale must be a positive integer"):
        PolaSR(upscale=0)
    model = PolaSR(upscale=2, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4)
    with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, H, W\)"):
        model(torch.rand(1, 1, 8, 8))
    with pytest.raises(ValueError, match="overlap must be in"):
        tiled_upscale(model, torch.rand(1, 3, 8, 8), 2, tile=8, overlap=8)
    with pytest.raises(ValueError, match="no downloadable weights"):
        timm.create_model("pola_sr_light_x2", pretrained=True)


def test_trains_one_step():
    model = PolaSR(upscale=2, embed_dim=8, depths=(2,), num_heads=(2,), window_size=4)
    lr, hr = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 16, 16)
    F.l1_loss(model(lr), hr).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.0.residual_group.layers.0.assm.attn.s1"].abs().sum() > 0
