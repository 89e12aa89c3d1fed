"""PolaDiT against a softmax DiT of the same size and an untrained model on scikit-learn's digits (docs/diffusion.md).

    python scripts/diffusion_demo.py --output runs/diffusion_demo --grid docs/diffusion_samples.png
    # or train each model apart (on a GPU, say), then sample and score where you like:
    python scripts/diffusion_demo.py --output runs/diffusion_demo --train-only pacs    # and softmax
    python scripts/diffusion_demo.py --output runs/diffusion_demo --reuse --grid docs/diffusion_samples.png

Trains both class-conditional models in pixel space (16×16, two processes of one thread each), draws
``--per-class`` samples of every digit with DDIM and classifier-free guidance from the EMA weights, and scores
them with the digits classifier (accuracy of the asked class) and an FID on that classifier's hidden features
against the held-out digits. Prints a Markdown table and writes ``results.json`` into the output folder.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from polaformer.tasks.diffusion import (
    class_accuracy,
    diffusion_config,
    digits_images,
    feature_network,
    frechet_distance,
    generate,
    load_diffusion_model,
    train_diffusion,
    train_digits_classifier,
)
from polaformer.tasks.diffusion.train import build_model


def _opts(args, attention: str) -> list[str]:
    return ["model.attention", attention, "model.hidden_size", str(args.dim), "model.depth", str(args.depth),
            "model.num_heads", str(args.heads), "model.patch_size", str(args.patch), "train.steps", str(args.steps),
            "train.eval_every", str(args.eval_every or max(1, args.steps // 4)),
            "train.batch_size", str(args.batch_size),
            "sample.steps", str(args.sample_steps), "sample.cfg_scale", str(args.cfg_scale),
            "train.ema_decay", str(args.ema), "train.lr", str(args.lr)]


def _train(args, attention: str) -> None:
    cfg = diffusion_config(opts=_opts(args, attention))
    train_diffusion(cfg, Path(args.output) / attention, overwrite=True, show_progress=False, device=args.device)


def _train_and_sample(args, attention: str) -> dict:
    torch.set_num_threads(1)
    cfg = diffusion_config(opts=_opts(args, "pacs" if attention == "untrained" else attention))
    labels = torch.arange(10).repeat_interleave(args.per_class)
    if attention == "untrained":
        torch.manual_seed(0)
        model, seconds = build_model(cfg, 10, cfg.data.image_size, 1).eval(), 0.0
    else:
        folder = Path(args.output) / attention
        if not args.reuse:
            _train(args, attention)
        model, cfg, _ = load_diffusion_model(folder / "last.pth", ema=args.weights == "ema")
        seconds = json.loads((folder / "metrics.json").read_text())["wall_time_s"]
    images = generate(model, cfg, labels, seed=1, device=args.device)
    return {"attention": attention, "train_s": seconds, "images": images,
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _grid(rows: list[torch.Tensor], path: Path, per_row: int) -> None:
    """One block per model: a row per digit, ``per_row`` samples each, 2× enlarged, a gap between blocks."""
    blocks = []
    for images in rows:
        pixels = ((images[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        side = pixels.shape[-1]
        by_digit = pixels.reshape(10, -1, side, side)[:, :per_row]
        blocks.append(np.concatenate([np.concatenate(list(row), axis=1) for row in by_digit], axis=0))
        blocks.append(np.full((10 * side, 4), 255, np.uint8))
    image = Image.fromarray(np.concatenate(blocks[:-1], axis=1))
    image.resize((image.width * 2, image.height * 2), Image.NEAREST).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/diffusion_demo")
    parser.add_argument("--grid", type=Path, default=None, help="PNG of samples (PolaDiT | softmax | untrained)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=50)
    parser.add_argument("--sample-steps", type=int, default=50)
    parser.add_argument("--cfg-scale", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: a quarter)")
    parser.add_argument("--ema", type=float, default=0.999, help="EMA decay of the weights")
    parser.add_argument("--weights", choices=("ema", "raw"), default="ema", help="which weights sample")
    parser.add_argument("--reuse", action="store_true", help="sample and score the runs already in --output")
    parser.add_argument("--train-only", choices=("pacs", "softmax"), help="train this model alone, then stop")
    parser.add_argument("--device", default="cpu", help="where training and sampling run ('cuda' on a GPU)")
    args = parser.parse_args()
    if args.train_only:
        _train(args, args.train_only)
        return

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:  # CUDA-safe
        jobs = [pool.submit(_train_and_sample, args, a) for a in ("pacs", "softmax")]
        runs = [_train_and_sample(args, "untrained")] + [job.result() for job in jobs]
    runs = [runs[1], runs[2], runs[0]]

    classifier = train_digits_classifier(16)
    features, _ = feature_network("digits", 16, 1)
    _, _, test_x, test_y = digits_images(16)
    labels = torch.arange(10).repeat_interleave(args.per_class)
    results = [{"model": r["attention"], "parameters": r["parameters"], "train_s": round(r["train_s"], 1),
                "class_accuracy": class_accuracy(classifier, r["images"], labels),
                "fid_digits_features": frechet_distance(test_x, r["images"], features)} for r in runs]
    real = {"model": "held-out digits", "class_accuracy": class_accuracy(classifier, test_x, test_y)}
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "results.json").write_text(json.dumps({"args": vars(args) | {"grid": str(args.grid)},
                                                                "results": results, "real": real}, indent=2))
    print("| model | trainable parameters | class accuracy | FID (classifier features) | train time (s) |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['model']} | {r['parameters']} | {r['class_accuracy']:.3f} | {r['fid_digits_features']:.2f} "
              f"| {r['train_s']} |")
    print(f"| held-out digits | | {real['class_accuracy']:.3f} | 0 | |")
    if args.grid:
        _grid([r["images"] for r in runs], args.grid, per_row=10)


if __name__ == "__main__":
    main()
