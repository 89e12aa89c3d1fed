"""``polaformer sr``: train / eval / upscale with the PaCS super-resolution model (docs/super_resolution.md).
Errors (bad options, unusable images or checkpoints) reach the one handler of :func:`polaformer.cli.main`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import (
    add_command_group,
    add_overwrite,
    add_train_options,
    flag_values,
    positive_int,
    print_summary,
    train_into,
)

__all__ = ["add_sr_parser"]


def add_sr_parser(commands) -> None:
    sub = add_command_group(commands, "sr", "single-image super-resolution with PaCS attention (x2/x3/x4)",
                            "Super-resolution with the PolaFormer++ lightSR model. Data: a folder of HR images (LR "
                            "made by bicubic downscaling), HR and LR folders, or 'photos' (those of scikit-image and "
                            "scikit-learn). See docs/super_resolution.md.")

    train = sub.add_parser("train", help="train a model (step-based, resumable); reports PSNR-Y/SSIM-Y")
    train.add_argument("--config", metavar="FILE", help="YAML file over the defaults (model, data, train, eval keys)")
    add_train_options(train, "sr train", (
        ("scale", positive_int, "upscaling factor"), ("train_hr", str, "HR training images: a folder or 'photos'"),
        ("train_lr", str, "LR training images: a folder (default: bicubic from HR)"),
        ("valid_hr", str, "HR validation images: a folder or 'photos'"), ("valid_lr", str, "LR validation images"),
        ("patch_size", positive_int, "training patch side in HR pixels")),
        output="runs/sr/xSCALE", opts_example="eval.mode tile data.repeats 10")
    train.set_defaults(handler=cmd_sr_train)

    evaluate = sub.add_parser("eval", help="PSNR-Y/SSIM-Y of a model against bicubic upsampling")
    _add_weights(evaluate)
    evaluate.add_argument("--hr", default="photos", metavar="DIR", help="HR folder or 'photos' (held-out photos)")
    evaluate.add_argument("--lr", default="", metavar="DIR", help="LR folder (default: bicubic from HR)")
    evaluate.add_argument("--json", metavar="FILE", help="also write the scores of every image here")
    add_overwrite(evaluate, "a --json file")
    evaluate.set_defaults(handler=cmd_sr_eval)

    upscale = sub.add_parser("upscale", help="upscale image files, written as PNG")
    _add_weights(upscale)
    upscale.add_argument("images", nargs="+", metavar="IMAGE", help="low-resolution image files")
    upscale.add_argument("--output", required=True, metavar="DIR",
                         help="folder for NAME_xSCALE.png (NAME_xSCALE-2.png... for later images of the same name)")
    add_overwrite(upscale, "images in --output")
    upscale.set_defaults(handler=cmd_sr_upscale)


def _add_weights(parser) -> None:
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", metavar="FILE", help="a checkpoint of 'polaformer sr train'")
    weights.add_argument("--official", metavar="FILE",
                         help="the authors' basicsr file or a state dict; needs --scale")
    parser.add_argument("--scale", type=positive_int, help="the scale of --official (checked against --checkpoint)")
    parser.add_argument("--param-key", default="params", metavar="KEY",
                        help="the entry of --official to load (default: params, what the official test configs "
                             "load; params_ema for the EMA weights)")
    parser.add_argument("--tile", type=positive_int,
                        help="tiled inference with LR tiles of this side (eval.mode tile, eval.tile; default: the "
                             "official test's partition of images of 200 pixels and more)")
    parser.add_argument("--overlap", type=int, help="LR pixels shared by neighbouring tiles (eval.overlap)")


def _model(args: argparse.Namespace):
    from ..engine.config import ConfigError
    from ..tasks.sr import load_sr_model

    if args.official and args.scale is None:
        raise ConfigError("--official needs --scale (2, 3 or 4 for the authors' lightSR models)")
    model, cfg = load_sr_model(args.checkpoint or args.official, official_scale=args.scale if args.official else None,
                               param_key=args.param_key)
    if args.checkpoint and args.scale is not None and args.scale != cfg.model.scale:
        raise ConfigError(f"scale mismatch: {args.checkpoint} is a x{cfg.model.scale} model, --scale asks for "
                          f"x{args.scale}")
    for flag, key in (("tile", "tile"), ("overlap", "overlap")):
        if getattr(args, flag) is not None:
            cfg.eval.merge({key: getattr(args, flag), "mode": "tile"}, source="the command line")
    if not 0 <= cfg.eval.overlap < cfg.eval.tile:
        raise ConfigError(f"--overlap must be in [0, tile), got {cfg.eval.overlap} with tile {cfg.eval.tile}")
    return model, cfg


def cmd_sr_train(args: argparse.Namespace) -> int:
    from ..tasks.sr import sr_config, train_sr

    cfg = sr_config(args.config, args.opts, flag_values("sr train", args), check=False)  # train_sr checks it
    output, summary = train_into(train_sr, cfg, args, f"runs/sr/x{cfg.model.scale}")
    print_summary(f"valid PSNR-Y {summary['best_psnr_y']:.2f} dB, SSIM-Y {summary['best_ssim_y']:.4f} (bicubic "
                  f"{summary['bicubic_psnr_y']:.2f} dB, {summary['bicubic_ssim_y']:.4f}; x{cfg.model.scale}, "
                  f"{summary['parameters']} parameters, {summary['steps']} steps, {summary['wall_time_s']:.0f}s) "
                  f"-> {output}")
    return 0


def cmd_sr_eval(args: argparse.Namespace) -> int:
    from ..engine.output import claim_outputs, write_output
    from ..tasks.sr import bicubic_upscale, evaluate_sr, model_upscaler, sr_pairs

    if args.json:
        claim_outputs([args.json], args.overwrite, "--json")
    model, cfg = _model(args)
    scale = cfg.model.scale
    pairs = sr_pairs(args.hr, args.lr, scale, "valid")
    result = evaluate_sr(model_upscaler(model, cfg, progress=True), pairs, scale)
    bicubic = evaluate_sr(lambda lr: bicubic_upscale(lr, scale), pairs, scale)
    images = f"{len(pairs)} image" + ("s" if len(pairs) > 1 else "")
    print(f"x{scale} on {images}: PSNR-Y {result['psnr_y']:.2f} dB, SSIM-Y {result['ssim_y']:.4f} "
          f"(bicubic {bicubic['psnr_y']:.2f} dB, {bicubic['ssim_y']:.4f})")
    if args.json:
        text = json.dumps({"scale": scale, "model": result, "bicubic": bicubic}, indent=1) + "\n"
        write_output(args.json, lambda f: f.write(text.encode()))
    return 0


def cmd_sr_upscale(args: argparse.Namespace) -> int:
    from ..engine.output import claim_outputs, distinct_names
    from ..tasks.sr import model_upscaler, read_image, save_image, to_uint8

    model, cfg = _model(args)
    upscale = model_upscaler(model, cfg, progress=True)
    images = [(Path(path), read_image(Path(path))) for path in args.images]  # every input read before any output
    stems = [f"{path.stem}_x{cfg.model.scale}" for path, _ in images]
    targets = claim_outputs(distinct_names(stems, args.output, ".png"), args.overwrite)
    for (path, lr), target in zip(images, targets):
        save_image(to_uint8(upscale(lr[None].float() / 255)[0]), target)
        print(f"{path} ({lr.shape[-1]}x{lr.shape[-2]}) -> {target}")
    return 0
