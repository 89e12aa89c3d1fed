"""The super-resolution task: the Y-channel metrics against the protocol's formulas, image pairs from folders and
the embedded photos, aligned training patches, the official evaluation protocol and checkpoint entry, and
'polaformer sr train|eval|upscale' end to end with its one-line errors.

Tolerances (tests/README.md): the metrics against the protocol's formulas in float64 at 1e-9 absolute (sums of a few
thousand pixels: reorder_rtol(n, float64) = 2.2e-16·n of scores below 100). The eval command scores the weights the
training scored; PSNR-Y agrees at pytest.approx's 1e-6 unless a uint8 output pixel flips, which needs the float output
within float32 rounding (about 1e-7) of a rounding boundary."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import correlate

from cli_helpers import error_line, quiet, run_main
from polaformer.models.pola_sr import PolaSR
from polaformer.tasks.sr import (
    RandomPatches,
    bicubic_downscale,
    folder_pairs,
    load_sr_model,
    model_upscaler,
    photo_pairs,
    rgb_to_y,
    sr_config,
    sr_metrics,
)
from polaformer.tasks.sr.data import ImagePair, embedded_photo

TINY = ["--opts", "model.embed_dim", "8", "model.depths", "[1]", "model.num_heads", "[2]", "model.window_size", "8",
        "data.repeats", "4"]
CHOP = json.loads((Path(__file__).resolve().parents[1] / "data" / "pola_sr_chop.json").read_text())["cases"]


def embedded_photo_crop(name: str, height: int, width: int) -> torch.Tensor:
    photo = embedded_photo(name)
    top, left = (photo.shape[1] - height) // 2, (photo.shape[2] - width) // 2
    return photo[:, top:top + height, left:left + width].contiguous()


def protocol_psnr_ssim(sr: np.ndarray, hr: np.ndarray, border: int) -> tuple[float, float]:
    """basicsr's calculate_psnr/calculate_ssim with test_y_channel, written out: Y of uint8 RGB in [16, 235],
    border crop, an 11x11 Gaussian (sigma 1.5) over the valid region."""
    def y(img):
        img = img[border:-border, border:-border].astype(np.float64) / 255
        return 16 + img @ np.array([65.481, 128.553, 24.966])

    a, b = y(sr), y(hr)
    psnr = 20 * np.log10(255 / np.sqrt(np.mean((a - b) ** 2)))
    g = np.exp(-(np.arange(11) - 5) ** 2 / (2 * 1.5 ** 2))
    window = np.outer(g, g) / np.outer(g, g).sum()

    def blur(x):
        return correlate(x, window, mode="constant")[5:-5, 5:-5]

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2, blur(a * b) - mu_a * mu_b
    ssim = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return psnr, ssim.mean()


def test_metrics_follow_the_protocol():
    hr = embedded_photo_crop("chelsea", 64, 80)
    noisy = (hr.int() + torch.randint(-12, 13, hr.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 255)
    sr = noisy.to(torch.uint8)
    scores = sr_metrics(sr, hr, crop_border=3)
    psnr, ssim = protocol_psnr_ssim(sr.permute(1, 2, 0).numpy(), hr.permute(1, 2, 0).numpy(), 3)
    assert scores["psnr_y"] == pytest.approx(psnr, abs=1e-9)
    assert scores["ssim_y"] == pytest.approx(ssim, abs=1e-9)
    white, black = torch.full((3, 1, 1), 255, dtype=torch.uint8), torch.zeros((3, 1, 1), dtype=torch.uint8)
    assert rgb_to_y(white).item() == pytest.approx(235.0) and rgb_to_y(black).item() == 16.0
    with pytest.raises(ValueError, match="uint8"):
        sr_metrics(sr.float(), hr, 3)


def test_patches_stay_aligned_through_flips_and_rotations():
    lr = torch.randint(0, 256, (3, 10, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    hr = lr.repeat_interleave(3, -1).repeat_interleave(3, -2)  # each LR pixel a 3x3 HR block
    patches = RandomPatches([ImagePair("blocks", hr, lr)], scale=3, patch_size=18, repeats=20)
    assert len(patches) == 20
    torch.manual_seed(0)
    for i in range(20):
        lr_patch, hr_patch = patches[i]
        assert lr_patch.shape == (3, 6, 6) and hr_patch.shape == (3, 18, 18)
        torch.testing.assert_close(hr_patch[:, ::3, ::3], lr_patch)
    with pytest.raises(Exception, match="smaller than the LR patch"):
        RandomPatches([ImagePair("blocks", hr, lr)], scale=3, patch_size=36)


def write_folders(root, scale=2, size=(40, 56), photos=("astronaut", "coffee", "rocket")):
    """An HR folder of photo crops and an LR folder of their x``scale`` bicubic images (DIV2K names)."""
    hr_dir, lr_dir = root / "HR", root / "LR"
    hr_dir.mkdir(parents=True)
    lr_dir.mkdir()
    for i, name in enumerate(photos):
        hr = embedded_photo_crop(name, *size)
        Image.fromarray(hr.permute(1, 2, 0).numpy()).save(hr_dir / f"{i:04d}.png")
        Image.fromarray(bicubic_downscale(hr, scale).permute(1, 2, 0).numpy()).save(lr_dir / f"{i:04d}x{scale}.png")
    return hr_dir, lr_dir


def test_folder_pairs_and_photos(tmp_path):
    hr_dir, lr_dir = write_folders(tmp_path)
    paired, degraded = folder_pairs(hr_dir, 2, lr_dir), folder_pairs(hr_dir, 2)
    assert [p.name for p in paired] == ["0000", "0001", "0002"]
    for a, b in zip(paired, degraded):
        assert torch.equal(a.lr, b.lr) and torch.equal(a.hr, b.hr) and a.lr.shape == (3, 20, 28)
    odd = Image.open(hr_dir / "0000.png").crop((0, 0, 55, 39))
    odd.save(hr_dir / "0000.png")  # HR sides not multiples of the scale are cropped to 2x the LR image
    assert folder_pairs(hr_dir, 2)[0].hr.shape == (3, 38, 54)
    photos = photo_pairs("valid", 4)
    assert [p.name for p in photos] == ["chelsea", "coffee", "flower"]
    assert all(p.hr.shape[-2:] == (4 * p.lr.shape[-2], 4 * p.lr.shape[-1]) for p in photos)


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "cannot read image"),
    ("empty", "no images in"),
    ("missing_lr", "no LR image for 0001.png"),
    ("mismatch", "not a x2 pair (scale mismatch?)"),
])
def test_bad_folders_are_one_line_errors(tmp_path, capsys, damage, message):
    hr_dir, lr_dir = write_folders(tmp_path)
    if damage == "corrupt":
        (hr_dir / "0002.png").write_bytes(b"not a png")
    elif damage == "empty":
        for p in lr_dir.iterdir():
            p.unlink()
    elif damage == "missing_lr":
        (lr_dir / "0001x2.png").unlink()
    else:
        Image.open(lr_dir / "0001x2.png").resize((10, 10)).save(lr_dir / "0001x2.png")
    code, _, err = run_main(["sr", "train", "--scale", "2", "--train-hr", hr_dir, "--train-lr", lr_dir,
                             "--output", tmp_path / "run", "--steps", "1"], capsys)
    assert code == 2 and message in error_line(err)


def test_train_eval_upscale_end_to_end(tmp_path, capsys):
    hr_dir, lr_dir = write_folders(tmp_path)
    run = tmp_path / "run"
    with quiet():
        assert run_main(["sr", "train", "--scale", "2", "--train-hr", hr_dir, "--valid-hr", hr_dir, "--valid-lr",
                         lr_dir, "--patch-size", "32", "--steps", "4", "--batch-size", "2", "--eval-every", "2",
                         "--output", run, *TINY], capsys)[0] == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 4 and len(metrics["history"]) == 2 and 5 < metrics["bicubic_psnr_y"] < 60

    code, out, _ = run_main(["sr", "eval", "--checkpoint", run / "best.pth", "--hr", hr_dir, "--lr", lr_dir,
                             "--json", tmp_path / "scores.json"], capsys)
    assert code == 0 and out.startswith("x2 on 3 images: PSNR-Y")
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["model"]["psnr_y"] == pytest.approx(metrics["best_psnr_y"])  # the same images, pieces and weights

    code, out, _ = run_main(["sr", "eval", "--checkpoint", run / "best.pth", "--hr", hr_dir, "--lr", lr_dir,
                             "--tile", "16", "--overlap", "4"], capsys)
    assert code == 0 and out.startswith("x2 on 3 images: PSNR-Y")
    code, out, _ = run_main(["sr", "upscale", "--checkpoint", run / "best.pth", lr_dir / "0001x2.png",
                             "--output", tmp_path / "up"], capsys)
    assert code == 0 and Image.open(tmp_path / "up" / "0001x2_x2.png").size == (56, 40)

    code, _, err = run_main(["sr", "eval", "--checkpoint", run / "best.pth", "--scale", "3", "--hr", hr_dir], capsys)
    assert code == 2 and "scale mismatch: " in error_line(err)
    code, _, err = run_main(["sr", "upscale", "--checkpoint", run / "last.pth", hr_dir / "missing.png",
                             "--output", tmp_path / "up"], capsys)
    assert code == 2 and "cannot read image" in error_line(err)


def test_official_weights_load_by_scale(tmp_path, capsys):
    official = PolaSR(upscale=2).state_dict()
    torch.save({"params": official}, tmp_path / "official_x2.pth")
    hr_dir, _ = write_folders(tmp_path, size=(32, 32), photos=("astronaut",))
    code, out, _ = run_main(["sr", "eval", "--official", tmp_path / "official_x2.pth", "--scale", "2",
                             "--hr", hr_dir], capsys)
    assert code == 0 and "x2 on 1 image:" in out
    code, _, err = run_main(["sr", "eval", "--official", tmp_path / "official_x2.pth", "--scale", "3",
                             "--hr", hr_dir], capsys)
    assert code == 2 and "upsample.0.weight" in error_line(err)
    code, _, err = run_main(["sr", "eval", "--official", tmp_path / "official_x2.pth", "--hr", hr_dir], capsys)
    assert code == 2 and "--official needs --scale" in error_line(err)


def test_official_loads_what_the_official_test_config_loads(tmp_path, capsys):
    """basicsr's test loads 'params' (path.param_key_g) even where the file also holds 'params_ema', and strips a
    DDP model's 'module.' prefix; --param-key picks another entry."""
    raw = PolaSR(upscale=2).state_dict()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in raw.items()}
    torch.save({"params": raw, "params_ema": ema}, tmp_path / "both.pth")
    torch.save({"params": {f"module.{k}": v for k, v in raw.items()}}, tmp_path / "ddp.pth")
    torch.save({"params_ema": ema}, tmp_path / "ema_only.pth")
    for path, key, expected in (("both.pth", "params", raw), ("ddp.pth", "params", raw),
                                ("both.pth", "params_ema", ema), ("ema_only.pth", "params_ema", ema)):
        model, _ = load_sr_model(tmp_path / path, official_scale=2, param_key=key)
        loaded = model.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), (path, key)
    hr_dir, _ = write_folders(tmp_path, size=(32, 32), photos=("astronaut",))
    code, out, err = run_main(["sr", "eval", "--official", tmp_path / "ddp.pth", "--scale", "2", "--hr", hr_dir],
                              capsys)
    assert code == 0 and "x2 on 1 image:" in out, err
    code, _, err = run_main(["sr", "eval", "--official", tmp_path / "ema_only.pth", "--scale", "2", "--hr", hr_dir],
                            capsys)
    assert code == 2 and "no 'params' entry (it holds params_ema); name the entry to load with --param-key" in \
        error_line(err)


def test_evaluation_is_the_official_partition_by_default():
    """Images of 200 pixels and more run in the pieces of the official test (tests/data/pola_sr_chop.json);
    eval.mode tile (or --tile) runs our overlapping tiles instead."""
    case = next(c for c in CHOP if c["size"] == [431, 90])
    shapes = []

    def model(piece):
        shapes.append(list(piece.shape[-2:]))
        return F.interpolate(piece, scale_factor=case["scale"], mode="nearest")

    lr = torch.rand(1, 3, *case["size"])
    model_upscaler(model, sr_config(opts=["model.scale", str(case["scale"])]))(lr)
    assert shapes == [read[2:4] for read in case["reads"]]
    shapes.clear()
    model_upscaler(model, sr_config(opts=["model.scale", str(case["scale"]), "eval.mode", "tile"]))(lr)
    assert shapes == [[192, 90], [192, 90], [192, 90]]


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    code, _, err = run_main(["sr", "train", "--output", tmp_path / "run", "--opts", "eval.overlap", "300"], capsys)
    assert code == 2 and "eval.overlap must be in [0, eval.tile)" in error_line(err)
    hr_dir, _ = write_folders(tmp_path, size=(32, 32), photos=("astronaut",))
    code, _, err = run_main(["sr", "train", "--train-hr", hr_dir, "--valid-hr", hr_dir, "--patch-size", "32",
                             "--output", tmp_path / "run", "--opts", "model.embed_dim", "12"], capsys)
    assert code == 2 and "embed_dim must be divisible by 8" in error_line(err, logs_allowed=True)
