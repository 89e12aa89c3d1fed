"""Class-conditional PolaDiT training as a step-based task of the one engine (:mod:`polaformer.engine.loop`), and
sampling from its checkpoints.

Pixel mode trains on the images themselves; latent mode on ``AutoencoderKL`` latents (a local folder,
``data.vae``) scaled by 0.18215, as the official DiT. AdamW without weight decay, a weight EMA (sampling uses
it), the loss of :func:`~.gaussian.diffusion_loss`; every ``eval_every`` steps the validation loss on fixed
noise and steps, ``best.pth`` (lowest EMA validation loss) and ``last.pth``.
"""
from __future__ import annotations

import timm
import torch
from torch import nn
from tqdm import tqdm

from ... import models  # noqa: F401  (registers pola_dit_*)
from ...engine.config import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE_INT,
    SEED,
    Config,
    ConfigError,
    check_settings,
    configure,
    fraction,
    unit,
)
from ...engine.device import resolve_device
from ...engine.distributed import all_reduce_sum
from ...engine.loop import Engine, StepOutput, train
from ...engine.steps import StepTask, check_train_options, load_task_model, saved_config, step_settings, train_defaults
from ...limits import check_batch_memory
from .data import LATENT_SCALE, NoisedImages, load_images, load_vae, vae_downsampling
from .gaussian import SAMPLERS, VARIANCES, diffusion_loss, make_scheduler, sample

__all__ = ["RULES", "DiffusionTask", "check_diffusion_config", "check_sample_request", "diffusion_config", "generate",
           "load_diffusion_model", "train_diffusion"]

BEST = "best.pth"

# the range of every numeric setting besides the engine options (engine/config.py checks them, naming the key)
SIZE_OF_MODEL = COUNT.but(note="0: the named model's")
RULES = {
    "model.hidden_size": SIZE_OF_MODEL, "model.depth": SIZE_OF_MODEL, "model.num_heads": SIZE_OF_MODEL,
    "model.patch_size": SIZE_OF_MODEL, "model.class_dropout_prob": unit(),
    "data.image_size": POSITIVE_INT, "data.channels": POSITIVE_INT, "data.valid_fraction": fraction(),
    "data.seed": SEED,
    "diffusion.train_timesteps": POSITIVE_INT, "diffusion.beta_start": fraction(), "diffusion.beta_end": fraction(),
    "train.eval_samples": POSITIVE_INT,
    "sample.steps": POSITIVE_INT, "sample.cfg_scale": NON_NEGATIVE.but(note="1: no guidance"),
}


def diffusion_config(path=None, opts=(), overrides=None, *, check: bool = True) -> Config:
    """The defaults (a tiny model on digits, pixel space), then a YAML file, then ``KEY VALUE`` overrides, then
    ``overrides`` (``{'train.lr': 1e-4}``, from command-line flags); checked (:func:`check_diffusion_config`)
    unless ``check`` is false (a caller that hands it to :func:`train_diffusion`, which checks it)."""
    cfg = Config({
        # hidden_size / depth / num_heads / patch_size 0: those of the named model
        "model": {"name": "pola_dit_s_2", "attention": "pacs", "hidden_size": 64, "depth": 4, "num_heads": 4,
                  "patch_size": 0, "learn_sigma": True, "class_dropout_prob": 0.1},
        # name: 'digits' or a root/<class>/<image> folder; vae: a local AutoencoderKL folder (latent mode)
        "data": {"name": "digits", "image_size": 16, "channels": 1, "latent": False, "vae": "",
                 "valid_fraction": 0.1, "seed": 0},
        "diffusion": {"train_timesteps": 1000, "beta_start": 1e-4, "beta_end": 0.02},
        "train": train_defaults("diffusion", steps=2000, batch_size=64, eval_every=500, lr=1e-3, weight_decay=0.0,
                                             ema_decay=0.999, clip_grad_norm=1.0, eval_samples=256),
        # variance: of a model without a learned one; guide_all_channels: guidance on every ε channel instead of
        # the official first three output channels
        "sample": {"sampler": "ddim", "steps": 50, "cfg_scale": 2.0, "variance": "fixed_large",
                   "guide_all_channels": False},
    })
    return configure(cfg, path, opts, overrides, check=check_diffusion_config if check else None)


def check_diffusion_config(cfg: Config) -> None:
    """Every setting in its range (:data:`RULES`), the names known, the schedule rising, a batch that fits."""
    check_settings(cfg, RULES)
    check_train_options(cfg, "diffusion")
    d = cfg.diffusion
    if d.beta_start > d.beta_end:
        raise ConfigError(f"diffusion.beta_start ({d.beta_start}) must not exceed diffusion.beta_end ({d.beta_end}): "
                          "the noise schedule rises")
    size = cfg.data.image_size
    check_batch_memory(cfg.train.batch_size, cfg.data.channels, size, size, "cpu", ConfigError,
                       what=f"a batch of train.batch_size images of data.image_size {size}")
    if cfg.model.attention not in models.pola_dit.ATTENTIONS:
        raise ConfigError(f"model.attention must be one of {', '.join(models.pola_dit.ATTENTIONS)}, "
                          f"got {cfg.model.attention!r}")
    if cfg.sample.sampler not in SAMPLERS:
        raise ConfigError(f"sample.sampler must be one of {', '.join(SAMPLERS)}, got {cfg.sample.sampler!r}")
    if cfg.sample.variance not in VARIANCES:
        raise ConfigError(f"sample.variance must be one of {', '.join(VARIANCES)}, got {cfg.sample.variance!r}")
    if cfg.data.latent and not cfg.data.vae:
        raise ConfigError("latent mode needs a local AutoencoderKL folder: set data.vae")


def model_geometry(cfg: Config, vae=None) -> tuple[int, int]:
    """``(input_size, in_channels)`` of the model: the images, or their latents."""
    size, channels = cfg.data.image_size, cfg.data.channels
    if cfg.data.latent:
        factor = vae_downsampling(vae)
        if size % factor:
            raise ConfigError(f"data.image_size {size} is not a multiple of the VAE's downsampling {factor}")
        return size // factor, vae.config.latent_channels
    return size, channels


def build_model(cfg: Config, num_classes: int, input_size: int, in_channels: int) -> nn.Module:
    m = cfg.model
    sizes = {k: m[k] for k in ("hidden_size", "depth", "num_heads", "patch_size") if m[k]}
    try:
        return timm.create_model(m.name, input_size=input_size, in_channels=in_channels, num_classes=num_classes,
                                 learn_sigma=m.learn_sigma, class_dropout_prob=m.class_dropout_prob,
                                 attention=m.attention, **sizes)
    except (RuntimeError, ValueError) as e:  # timm's unknown model, a size that does not fit
        raise ConfigError(f"cannot build model {m.name!r}: {str(e).splitlines()[0]}") from None


def _scheduler(cfg: Config):
    d = cfg.diffusion
    return make_scheduler(d.train_timesteps, d.beta_start, d.beta_end)


class DiffusionTask(StepTask):
    name = "diffusion"
    best_files = {BEST: "neg_valid_loss"}
    resume_may_change = ("train.steps", "train.eval_every", "train.eval_samples", "train.num_workers", "sample")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.vae = load_vae(cfg.data.vae) if cfg.data.latent else None
        train_x, train_y, valid_x, valid_y, self.num_classes = load_images(cfg.data)
        keep = cfg.train.eval_samples
        self.valid_x, self.valid_y = valid_x[:keep], valid_y[:keep]
        self.input_size, self.in_channels = model_geometry(cfg, self.vae)
        self.scheduler = _scheduler(cfg)
        shape, steps = (self.in_channels, self.input_size, self.input_size), cfg.diffusion.train_timesteps
        self.train_set = NoisedImages(train_x, train_y, steps, shape, cfg.train.seed, posterior=self.vae is not None)
        # the same steps, noise (and latent samples) at every evaluation, each image's whatever the process count
        generator = torch.Generator().manual_seed(1234)
        n = len(self.valid_x)
        self.valid_t = torch.randint(0, steps, (n,), generator=generator)
        self.valid_draws = [torch.randn((n, *shape), generator=generator) for _ in range(1 + (self.vae is not None))]

    def encode(self, images: torch.Tensor, posterior: torch.Tensor | None = None) -> torch.Tensor:
        """The images, or in latent mode their scaled latents: the VAE posterior's sample mean + std x
        ``posterior`` (standard normal, drawn with the image)."""
        if self.vae is None:
            return images
        with torch.no_grad():
            self.vae.to(images.device)
            latent = self.vae.encode(images).latent_dist
            return (latent.mean + latent.std * posterior) * LATENT_SCALE

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        return build_model(self.cfg, self.num_classes, self.input_size, self.in_channels)

    def start_message(self, engine: Engine) -> str:
        mode = f"latents {self.in_channels}x{self.input_size}x{self.input_size}" if self.vae else "pixels"
        return self.opening(engine, f"{self.cfg.model.name} ({self.cfg.model.attention}, {mode})",
                            f"{len(self.train_set)} images")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # constant, as the official

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        images, labels, t, noise, *posterior = (x.to(device, non_blocking=True) for x in batch)
        terms = diffusion_loss(model, self.scheduler, self.encode(images, *posterior), labels, t=t, noise=noise)
        # the sum stays on the device: the engine reads it with the loss
        return StepOutput(terms["loss"].mean(), len(images), {"mse": terms["mse"].detach().sum()})

    @torch.no_grad()
    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        """The mean losses of the validation images; each process takes every K-th and the sums are added."""
        was_training = model.training
        model.eval()
        ctx, device = engine.ctx, engine.device
        mine = slice(ctx.rank, None, ctx.world_size)
        totals = {"mse": 0.0, "vb": 0.0, "loss": 0.0}
        parts = (self.valid_x, self.valid_y, self.valid_t, *self.valid_draws)
        for images, labels, t, noise, *posterior in zip(*(x[mine].split(256) for x in parts)):
            latents = self.encode(images.to(device), *(p.to(device) for p in posterior))
            terms = diffusion_loss(model, self.scheduler, latents, labels.to(device), t=t.to(device),
                                   noise=noise.to(device))
            for key in totals:
                totals[key] += terms[key].sum().item()
        model.train(was_training)
        sums = all_reduce_sum(list(totals.values()), ctx, device)
        return {key: value / max(len(self.valid_x), 1) for key, value in zip(totals, sums)}

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        chosen = results.get("ema", results["model"])
        return {"step": engine.num_updates, "train_loss": train["loss"], "valid_loss": results["model"]["loss"],
                "valid_mse": results["model"]["mse"], "ema_valid_loss": chosen["loss"],
                "neg_valid_loss": -chosen["loss"], "elapsed_s": engine.elapsed}

    def describe(self, record: dict, improved: bool) -> str:
        return self.evaluation_line(record, improved, f"train loss {record['train_loss']:.4f}, valid "
                                                      f"{record['valid_loss']:.4f} "
                                                      f"(EMA {record['ema_valid_loss']:.4f})")

    def summary(self, engine: Engine) -> dict:
        return self.run_summary(engine, {"model": self.cfg.model.name, "attention": self.cfg.model.attention},
                                {"best_valid_loss": -engine.best.get("neg_valid_loss", -float("inf"))})

    def metadata(self, engine: Engine) -> dict:
        return {"num_classes": self.num_classes}


def train_diffusion(cfg: Config, output, **options) -> dict:
    """Train as ``cfg`` says into ``output``; returns ``metrics.json``'s contents. ``options``: resume, overwrite,
    device, show_progress, allow_changed (:func:`~polaformer.engine.steps.step_settings`)."""
    check_diffusion_config(cfg)
    return train(DiffusionTask(cfg), step_settings(cfg, output, **options))


def load_diffusion_model(path, ema: bool = True) -> tuple[nn.Module, Config, object]:
    """``(model, config, vae or None)`` from a checkpoint of :func:`train_diffusion`; the EMA weights where
    the checkpoint has them and ``ema``."""
    def rebuild(checkpoint):
        cfg = saved_config(checkpoint, diffusion_config(check=False), check_diffusion_config)
        vae = load_vae(cfg.data.vae) if cfg.data.latent else None
        input_size, in_channels = model_geometry(cfg, vae)
        return build_model(cfg, int(checkpoint["num_classes"]), input_size, in_channels), cfg, vae

    return load_task_model(path, DiffusionTask.name, "diffusion", rebuild, ema=ema)


def check_sample_request(model: nn.Module, count: int, device="cpu") -> None:
    """Refuse, before anything is allocated, ``count`` samples whose images alone exceed the memory available."""
    side = model.input_size
    check_batch_memory(count, model.in_channels, side, side, device, ConfigError, what=f"{count} samples")


@torch.no_grad()
def generate(model: nn.Module, cfg: Config, labels: torch.Tensor, vae=None, *, sampler: str | None = None,
             steps: int | None = None, cfg_scale: float | None = None, variance: str | None = None,
             guide_all_channels: bool | None = None, seed: int = 0, batch_size: int = 256,
             device="cpu") -> torch.Tensor:
    """Images in [-1, 1] (N, C, S, S), one per label; sampler settings default to ``cfg.sample`` (given ones are
    checked against the same ranges, :data:`RULES`)."""
    s = cfg.sample.clone().defrost()
    for key, value in (("sampler", sampler), ("steps", steps), ("cfg_scale", cfg_scale), ("variance", variance),
                       ("guide_all_channels", guide_all_channels)):
        if value is not None:
            s.merge({key: value}, source="the sampling options")
    for key in ("steps", "cfg_scale"):
        RULES[f"sample.{key}"].check(f"sample.{key}", s[key])
    SEED.check("the seed", seed)
    device = resolve_device(device)
    check_sample_request(model, len(labels), device)
    sampler, steps, cfg_scale = s.sampler, s.steps, s.cfg_scale
    variance, guide_all_channels = s.variance, s.guide_all_channels
    model = model.to(device)
    generator = torch.Generator().manual_seed(seed)
    shape = (model.in_channels, model.input_size, model.input_size)
    chunks = []
    progress = tqdm(total=len(labels) * steps, desc="sampling", unit="step", disable=None, leave=False)
    for part in labels.split(batch_size):
        try:
            out = sample(model, part, shape, sampler=sampler, steps=steps, cfg_scale=cfg_scale, variance=variance,
                         guide_all_channels=guide_all_channels, clip_sample=vae is None,
                         train_timesteps=cfg.diffusion.train_timesteps, beta_start=cfg.diffusion.beta_start,
                         beta_end=cfg.diffusion.beta_end, generator=generator, device=device)
        except ValueError as e:  # a sampler setting the model or schedule cannot take, before any step ran
            raise ConfigError(str(e)) from None
        if vae is not None:
            vae.to(device)
            out = vae.decode(out / LATENT_SCALE).sample
        if not torch.isfinite(out).all():  # clamped, NaN would be written as black images with exit 0
            raise ConfigError(f"sampling produced NaN or infinite values (sample.cfg_scale {cfg_scale:g}, "
                              f"{sampler} with {steps} steps): use a smaller --cfg-scale")
        chunks.append(out.clamp(-1, 1).cpu())
        progress.update(len(part) * steps)
    progress.close()
    return torch.cat(chunks)
