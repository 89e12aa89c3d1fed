"""Train a small PaCS super-resolution model on crops of the photos that ship with scikit-image and scikit-learn,
then score it on the held-out photos against bicubic upsampling (docs/super_resolution.md).

    python scripts/sr_demo.py --output runs/sr_demo --figure docs/figures/sr_side_by_side.png
    # or train on a GPU and score here: --train-only there, --evaluate-only here

Prints the markdown table of the docs (PSNR-Y / SSIM-Y per held-out photo, border = scale) and writes a
side-by-side crop (LR nearest | bicubic | model | HR). A quiet 2-core CPU runs it in under ten minutes.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from polaformer.tasks.sr import (
    bicubic_upscale,
    evaluate_sr,
    load_sr_model,
    model_upscaler,
    photo_pairs,
    sr_config,
    train_sr,
)

# a small model: 2 groups of 2 layers, 24 channels; x2, 64-pixel HR patches
MODEL = ["model.scale", "2", "model.embed_dim", "24", "model.depths", "[2, 2]", "model.num_heads", "[2, 2]",
         "model.window_size", "8", "data.patch_size", "64", "data.repeats", "400"]
CROP = ("chelsea", 60, 150, 64)  # held-out photo, LR top, LR left, LR side of the figure's crop


def side_by_side(model, cfg, path: Path) -> None:
    name, top, left, side = CROP
    scale = cfg.model.scale
    pair = next(p for p in photo_pairs("valid", scale) if p.name == name)
    lr = pair.lr[None, :, top:top + side, left:left + side].float() / 255
    panels = {
        "LR (nearest)": F.interpolate(lr, scale_factor=scale, mode="nearest"),
        "bicubic": bicubic_upscale(lr, scale),
        "PaCS SR": model_upscaler(model, cfg)(lr),
        "HR": pair.hr[None, :, top * scale:(top + side) * scale, left * scale:(left + side) * scale].float() / 255,
    }
    size, label = side * scale, 16
    canvas = Image.new("RGB", (size * len(panels) + 4 * (len(panels) - 1), size + label), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (title, image) in enumerate(panels.items()):
        array = (image[0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        x = i * (size + 4)
        canvas.paste(Image.fromarray(array), (x, label))
        draw.text((x + 4, 2), title, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/sr_demo"))
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/sr_side_by_side.png"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="auto", help="where training runs ('auto': CUDA when available)")
    parser.add_argument("--train-only", action="store_true", help="train, then stop (score later here)")
    parser.add_argument("--evaluate-only", action="store_true", help="score and draw the run already in --output")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's line per evaluation

    if not args.evaluate_only:
        recipe = ["train.steps", str(args.steps), "train.eval_every", str(args.eval_every),
                  "train.batch_size", str(args.batch_size), "train.lr", str(args.lr)]
        train_sr(sr_config(opts=MODEL + recipe), args.output, overwrite=True, show_progress=False, device=args.device)
        if args.train_only:
            return
    history = [json.loads(line) for line in (args.output / "metrics.jsonl").read_text().splitlines()]
    model, cfg = load_sr_model(args.output / "best.pth")
    scale = cfg.model.scale
    pairs = photo_pairs("valid", scale)
    ours = evaluate_sr(model_upscaler(model, cfg), pairs, scale)
    bicubic = evaluate_sr(lambda lr: bicubic_upscale(lr, scale), pairs, scale)
    parameters = sum(p.numel() for p in model.parameters())
    best = max(history, key=lambda r: r["psnr_y"])
    (args.output / "demo.json").write_text(json.dumps({"model": ours, "bicubic": bicubic, "history": history,
                                                       "parameters": parameters}, indent=1))
    side_by_side(model, cfg, args.figure)

    print("| photo | bicubic PSNR-Y / SSIM-Y | PaCS SR PSNR-Y / SSIM-Y |\n| --- | --- | --- |")
    for name in ours["images"]:
        b, o = bicubic["images"][name], ours["images"][name]
        print(f"| {name} | {b['psnr_y']:.2f} / {b['ssim_y']:.4f} | {o['psnr_y']:.2f} / {o['ssim_y']:.4f} |")
    print(f"| mean | {bicubic['psnr_y']:.2f} / {bicubic['ssim_y']:.4f} | {ours['psnr_y']:.2f} / {ours['ssim_y']:.4f} |")
    print(f"\nx{scale}, {parameters} parameters, best of {history[-1]['step']} steps at step {best['step']}, "
          f"{history[-1]['elapsed_s']:.0f}s of training; figure: {args.figure} ({args.figure.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
