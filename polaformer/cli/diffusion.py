"""``polaformer diffusion``: train / sample / fid for class-conditional PolaDiT models (docs/diffusion.md). Errors
(bad options, missing VAE folders, unusable checkpoints or image folders) reach the one handler of
:func:`polaformer.cli.main`."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.config import ConfigError
from .common import (
    add_command_group,
    add_overwrite,
    add_train_options,
    flag_values,
    positive_int,
    print_summary,
    train_into,
)

__all__ = ["add_diffusion_parser"]


def add_diffusion_parser(commands) -> None:
    sub = add_command_group(commands, "diffusion", "class-conditional diffusion transformers (PolaDiT)",
                            "Train PolaDiT on digits or an image folder, sample with classifier-free guidance, "
                            "score with FID. See docs/diffusion.md.")

    train = sub.add_parser("train", help="train one model (step-based, resumable, EMA)")
    train.add_argument("--config", metavar="FILE", help="YAML file over the defaults (model, data, diffusion, "
                                                        "train, sample keys)")
    train.add_argument("--model", help="timm name, e.g. pola_dit_s_2 (model.name)")
    train.add_argument("--attention", choices=("pacs", "softmax"), help="model.attention")
    train.add_argument("--data", help="'digits' or a root/<class>/<image> folder (data.name)")
    train.add_argument("--vae", metavar="DIR", help="a local AutoencoderKL folder: train on its latents")
    add_train_options(train, "diffusion train", (
        ("image_size", positive_int, "image side in pixels"), ("channels", positive_int, "image channels")),
        output="runs/diffusion/MODEL-ATTENTION",
        opts_example="train.ema_decay 0.99 sample.steps 100")
    train.set_defaults(handler=cmd_diffusion_train)

    sample = sub.add_parser("sample", help="draw class-conditional samples from a checkpoint (EMA weights)")
    sample.add_argument("--checkpoint", required=True, metavar="FILE")
    sample.add_argument("--output", required=True, metavar="FILE",
                        help="a .png grid (a row per class) or a .safetensors file of images and labels")
    sample.add_argument("--classes", type=int, nargs="+", help="class indices (default: all)")
    add_overwrite(sample, "a file at --output")
    _sampling_flags(sample)
    sample.set_defaults(handler=cmd_diffusion_sample)

    fid = sub.add_parser("fid", help="FID of a checkpoint's samples against its held-out images")
    fid.add_argument("--checkpoint", required=True, metavar="FILE")
    fid.add_argument("--features", default="digits",
                     help="'digits' (the digits classifier's features) or an Inception-v3 weights file")
    _sampling_flags(fid)
    fid.set_defaults(handler=cmd_diffusion_fid)


def _sampling_flags(parser) -> None:
    parser.add_argument("--per-class", type=positive_int, default=10, help="samples per class")
    parser.add_argument("--sampler", help="ddpm or ddim (default: the checkpoint's sample.sampler)")
    parser.add_argument("--steps", type=positive_int, help="sampling steps (default: sample.steps)")
    parser.add_argument("--cfg-scale", type=float, help="classifier-free guidance (1: none; default: sample.cfg_scale)")
    parser.add_argument("--guide-all-channels", action="store_true", default=None,
                        help="guide every ε channel (default: the official first three output channels)")
    parser.add_argument("--variance", choices=("fixed_large", "fixed_small"),
                        help="variance of a model without a learned one (default: sample.variance, the official "
                             "fixed_large)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")


def cmd_diffusion_train(args: argparse.Namespace) -> int:
    from ..tasks.diffusion import diffusion_config, train_diffusion

    opts = list(args.opts)
    if args.vae:
        opts += ["data.latent", "true", "data.vae", args.vae]
    cfg = diffusion_config(args.config, opts, flag_values("diffusion train", args), check=False)  # checked there
    output, summary = train_into(train_diffusion, cfg, args, f"runs/diffusion/{cfg.model.name}-{cfg.model.attention}")
    print_summary(f"valid loss (EMA): {summary['best_valid_loss']:.4f} ({cfg.model.name}, {cfg.model.attention}, "
                  f"{summary['parameters']} parameters, {summary['steps']} steps, {summary['wall_time_s']:.0f}s) "
                  f"-> {output}")
    return 0


def _generate(args, loaded):
    import torch

    from ..engine.device import resolve_device
    from ..tasks.diffusion import generate
    from ..tasks.diffusion.train import check_sample_request

    model, cfg, vae = loaded
    classes = getattr(args, "classes", None) or list(range(model.num_classes))
    bad = [c for c in classes if not 0 <= c < model.num_classes]
    if bad:
        raise ConfigError(f"classes must be in 0..{model.num_classes - 1}, got {bad}")
    check_sample_request(model, len(classes) * args.per_class, resolve_device(args.device))  # before the labels
    labels = torch.tensor(classes).repeat_interleave(args.per_class)
    images = generate(model, cfg, labels, vae, sampler=args.sampler, steps=args.steps, cfg_scale=args.cfg_scale,
                      variance=args.variance, guide_all_channels=args.guide_all_channels, seed=args.seed,
                      device=args.device)
    return images, labels, cfg


def cmd_diffusion_sample(args: argparse.Namespace) -> int:
    from ..engine.output import claim_outputs
    from ..tasks.diffusion.data import save_samples

    output = Path(args.output)
    if output.suffix not in (".png", ".safetensors"):
        raise ConfigError(f"--output must end in .png or .safetensors, got {output.name}")
    claim_outputs([output], args.overwrite)
    from ..tasks.diffusion import load_diffusion_model

    images, labels, _ = _generate(args, load_diffusion_model(args.checkpoint))
    save_samples(images, labels, output, per_row=args.per_class)
    print(f"{len(images)} samples -> {output}")
    return 0


def cmd_diffusion_fid(args: argparse.Namespace) -> int:
    from ..tasks.diffusion import (
        class_accuracy,
        feature_network,
        frechet_distance,
        load_diffusion_model,
        train_digits_classifier,
    )
    from ..tasks.diffusion.data import load_images

    loaded = load_diffusion_model(args.checkpoint)
    cfg = loaded[1]
    network, inception = feature_network(args.features, cfg.data.image_size, cfg.data.channels)
    images, labels, _ = _generate(args, loaded)
    _, _, real, _, _ = load_images(cfg.data)
    score = frechet_distance(real, images, network, inception)
    line = f"FID ({args.features} features): {score:.3f} ({len(images)} samples, {len(real)} held-out images)"
    if cfg.data.name == "digits":
        line += f"; class accuracy {class_accuracy(train_digits_classifier(cfg.data.image_size), images, labels):.3f}"
    print(line)
    return 0
