"""`polaformer eval --data-path` on a generated ImageNet-layout folder, and `polaformer throughput`.

Tolerances: the printed loss has 4 decimals (5e-5), plus float32 rounding of a mean cross-entropy over a few images
(below 1e-5): 1.5e-4 and 1e-4 absolute; the accuracies are printed counts."""
import json
import math
import re

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms

import polaformer.models  # noqa: F401  (registers the zoo with timm)
from polaformer.cli import main

MODEL = "pola_deit_tiny_patch16_224"
KWARGS = dict(depth=1, img_size=32, patch_size=8, embed_dim=48, num_heads=2)
MODEL_ARGS = ["--model", MODEL, *[a for k, v in KWARGS.items() for a in ("--model-kwarg", f"{k}={v}")]]
CLASSES = ["ant", "bee", "cat", "dog", "eel", "fox"]  # 6 classes, so that top-5 is not trivially 100%
LINE = re.compile(
    r"^val top-1: (?P<top1>[\d.]+)% \(top-5: (?P<top5>[\d.]+)%, loss: (?P<loss>[\d.]+); (?P<images>\d+) images"
    r"(?:, (?P<skipped>\d+) unreadable skipped)?; (?P<rest>.*)\) <- (?P<path>.+)$"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """DIR/val/<class>/ with a JPEG and a PNG per class (one not square), and one corrupt file."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    for i, name in enumerate(CLASSES):
        class_dir = root / "val" / name
        class_dir.mkdir(parents=True)
        size = (40, 32) if i == 0 else (32, 32)
        for ext in ("JPEG", "png"):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(class_dir / f"{name}_{ext.lower()}.{ext}")
    (root / "val" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


def build(seed):
    torch.manual_seed(seed)
    return timm.create_model(MODEL, num_classes=len(CLASSES), **KWARGS).eval()


@pytest.fixture(scope="module")
def models():
    return {"raw": build(0), "ema": build(1)}


@pytest.fixture(scope="module")
def official_checkpoint(models, tmp_path_factory):
    """PolaFormer++'s layout: raw weights in 'model', EMA weights in 'state_dict_ema'."""
    path = tmp_path_factory.mktemp("ckpt") / "ckpt_epoch_299.pth"
    torch.save({"model": models["raw"].state_dict(), "state_dict_ema": models["ema"].state_dict(),
                "epoch": 299, "max_accuracy": 1.0, "max_accuracy_e": 2.0}, path)
    return path


def direct_metrics(model, folder):
    """Top-1/top-5/loss computed here, image by image, without the package's data code."""
    transform = transforms.Compose([
        transforms.Resize((32, 32), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    images, targets = [], []
    for label, name in enumerate(CLASSES):
        for path in sorted((folder / "val" / name).iterdir()):
            if path.name == "broken.jpg":
                continue
            images.append(transform(Image.open(path).convert("RGB")))
            targets.append(label)
    images, targets = torch.stack(images), torch.tensor(targets)
    with torch.no_grad():
        logits = model(images)
    top5 = logits.topk(5, dim=1).indices
    return {
        "top1": 100.0 * (top5[:, 0] == targets).float().mean().item(),
        "top5": 100.0 * (top5 == targets[:, None]).any(dim=1).float().mean().item(),
        "loss": F.cross_entropy(logits, targets).item(),
        "images": len(targets),
    }


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_eval(capsys, checkpoint, folder, *extra, model_args=MODEL_ARGS):
    code, out, err = run_main(
        ["eval", *model_args, "--checkpoint", str(checkpoint), "--data-path", str(folder),
         "--batch-size", "5", "--workers", "0", "--device", "cpu", *extra],
        capsys,
    )
    assert code == 0, err
    match = LINE.match(out.strip())
    assert match, out
    return match, err


def assert_matches(match, expected):
    assert match["top1"] == f"{expected['top1']:.3f}"
    assert match["top5"] == f"{expected['top5']:.3f}"
    assert math.isclose(float(match["loss"]), expected["loss"], abs_tol=1.5e-4)
    assert int(match["images"]) == expected["images"] == 2 * len(CLASSES)


def test_eval_prints_the_direct_metrics_of_the_ema_weights(official_checkpoint, folder, models, capsys):
    match, err = run_eval(capsys, official_checkpoint, folder)
    assert_matches(match, direct_metrics(models["ema"], folder))  # 'auto' prefers the EMA weights
    assert match["skipped"] == "1" and "broken.jpg" in err
    assert "'state_dict_ema' weights" in match["rest"] and "epoch 299" in match["rest"]
    assert match["path"] == str(official_checkpoint)


@pytest.mark.parametrize("weights", ["ema", "raw"])
def test_weights_selects_the_model(weights, official_checkpoint, folder, models, capsys):
    match, _ = run_eval(capsys, official_checkpoint, folder, "--weights", weights)
    assert_matches(match, direct_metrics(models[weights], folder))
    assert ("'model' weights" if weights == "raw" else "'state_dict_ema' weights") in match["rest"]


def test_engine_checkpoint_names_its_model(models, folder, tmp_path, capsys):
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": models["raw"].state_dict(), "model_ema": models["ema"].state_dict(), "arch": MODEL,
                "model_kwargs": KWARGS, "num_classes": len(CLASSES), "epoch": 3}, path)
    match, _ = run_eval(capsys, path, folder, "--weights", "raw", model_args=[])
    assert_matches(match, direct_metrics(models["raw"], folder))
    code, _, err = run_main(["eval", "--model", "pola_pvt_tiny", "--checkpoint", str(path),
                             "--data-path", str(folder)], capsys)
    assert code == 2 and "'pola_deit_tiny_patch16_224', not the requested 'pola_pvt_tiny'" in err


def test_official_config_names_the_model_and_the_eval_size(models, folder, tmp_path, capsys):
    """The authors' files store their yacs config: MODEL.NAME, DATA.IMG_SIZE and TEST.CROP are used."""
    path = tmp_path / "official.pth"
    config = {"MODEL": {"TYPE": "pola_deit", "NAME": MODEL}, "DATA": {"IMG_SIZE": 64, "INTERPOLATION": "bicubic"},
              "TEST": {"CROP": False}}
    torch.save({"model": models["raw"].state_dict(), "config": config, "epoch": 9}, path)
    kwargs = [a for k, v in KWARGS.items() for a in ("--model-kwarg", f"{k}={v}")]
    match, err = run_eval(capsys, path, folder, model_args=kwargs)
    assert "64px" in match["rest"] and "64x64 bicubic, no crop" in err
    resized, _ = run_eval(capsys, path, folder, "--img-size", "32", "--crop-pct", "1", model_args=kwargs)
    assert_matches(resized, direct_metrics(models["raw"], folder))


def test_crop_pct_and_img_size(official_checkpoint, folder, models, capsys):
    same, _ = run_eval(capsys, official_checkpoint, folder, "--crop-pct", "1.0")
    assert_matches(same, direct_metrics(models["ema"], folder))  # at 32 px: a plain resize either way
    larger, _ = run_eval(capsys, official_checkpoint, folder, "--img-size", "64", "--crop-pct", "0.875")
    assert int(larger["images"]) == 12 and "64px" in larger["rest"]


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"polaformer( \w+)?: error: ", lines[0]), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("missing data path", ["data folder not found"]),
        ("no val folder", ["no val folder in"]),
        ("missing checkpoint", ["checkpoint not found"]),
        ("no model name", ["does not name its architecture: give --model NAME"]),
        ("no ema weights", ["has no EMA weights"]),
        ("other class count", ["has 1000 classes but", "has 6 class folders"]),
        ("other architecture", ["does not fit PolaDeiT", "shape mismatches"]),
        ("folder option without folder", ["--weights needs --data-path DIR"]),
        ("grey model", ["takes 1-channel images"]),
    ],
)
def test_eval_user_errors(case, fragments, official_checkpoint, folder, tmp_path, capsys):
    checkpoint, data, model_args, extra = str(official_checkpoint), str(folder), MODEL_ARGS, []
    if case == "missing data path":
        data = str(tmp_path / "nowhere")
    elif case == "no val folder":
        (tmp_path / "train").mkdir()
        data = str(tmp_path)
    elif case == "missing checkpoint":
        checkpoint = str(tmp_path / "missing.pth")
    elif case == "no model name":
        model_args = []
    elif case == "no ema weights":
        torch.save({"model": build(0).state_dict()}, tmp_path / "raw_only.pth")
        checkpoint, extra = str(tmp_path / "raw_only.pth"), ["--weights", "ema"]
    elif case == "other class count":
        torch.manual_seed(0)
        torch.save({"model": timm.create_model(MODEL, num_classes=1000, **KWARGS).state_dict()}, tmp_path / "in1k.pth")
        checkpoint = str(tmp_path / "in1k.pth")
    elif case == "other architecture":
        torch.save({"model": build(0).state_dict()}, tmp_path / "wide.pth")
        model_args = [*MODEL_ARGS, "--model-kwarg", "mlp_ratio=2"]
        checkpoint = str(tmp_path / "wide.pth")
    elif case == "folder option without folder":
        code, out, err = run_main(["eval", "--checkpoint", checkpoint, "--weights", "ema"], capsys)
        return assert_one_line_error(code, out, err, *fragments)
    elif case == "grey model":
        model_args = ["--model", "pola_deit_digits"]
    code, out, err = run_main(
        ["eval", *model_args, "--checkpoint", checkpoint, "--data-path", data, "--workers", "0", *extra], capsys
    )
    assert_one_line_error(code, out, err, *fragments)


def test_throughput_prints_images_per_second(capsys):
    code, out, err = run_main(
        ["throughput", "--model", "pola_deit_digits", "--batch-size", "4", "--iters", "3", "--warmup", "1",
         "--device", "cpu"], capsys,
    )
    assert code == 0, err
    match = re.match(r"^throughput: ([\d.]+) images/s \(pola_deit_digits, batch 4, 1x8x8, ", out)
    assert match and float(match.group(1)) > 0, out


def test_throughput_amp_and_model_kwargs(capsys):
    code, out, err = run_main(
        ["throughput", *MODEL_ARGS, "--batch-size", "2", "--iters", "2", "--warmup", "0", "--amp", "--device", "cpu"],
        capsys,
    )
    assert code == 0, err
    assert ", 3x32x32, " in out and out.strip().endswith("cpu, amp)")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["throughput", "--model", "no_such_model"], "unknown model 'no_such_model'"),
        (["throughput"], "the following arguments are required: --model"),
        (["throughput", "--model", "pola_deit_digits", "--iters", "0"], "must be a positive integer"),
        (["throughput", "--model", "pola_deit_digits", "--warmup", "-1"], "--warmup must be >= 0"),
    ],
)
def test_throughput_user_errors(argv, fragment, capsys):
    code, out, err = run_main(argv, capsys)
    assert_one_line_error(code, out, err, fragment)


def test_a_folder_trained_model_evaluates_as_its_training_saw_it(tmp_path, capsys):
    """`polaformer train --data-path` normalises with the model's own mean/std, as `polaformer eval` does:
    vit_tiny's pretrained_cfg has 0.5/0.5 (not ImageNet's), and the final validation loss of the run is
    the loss `eval` prints for its checkpoint."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name, level in (("dark", 60), ("mid", 128), ("light", 200)):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(2):
                pixels = np.clip(rng.normal(level, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / name / f"{i}.png")
    tiny = [a for k, v in dict(patch_size=8, embed_dim=16, depth=1, num_heads=1, img_size=32).items()
            for a in ("--model-kwarg", f"{k}={v}")]
    code, _, err = run_main(["train", "--model", "vit_tiny_patch16_224", *tiny, "--data-path", str(tmp_path),
                             "--epochs", "1", "--batch-size", "3", "--output", str(tmp_path / "run"), "--opts",
                             "DATA.IMG_SIZE", "32", "DATA.NUM_WORKERS", "0"], capsys)
    assert code == 0, err
    trained = json.loads((tmp_path / "run" / "metrics.json").read_text())
    match, _ = run_eval(capsys, tmp_path / "run" / "last.pth", tmp_path, model_args=[])
    assert math.isclose(float(match["loss"]), trained["final_test_loss"], abs_tol=1e-4)
