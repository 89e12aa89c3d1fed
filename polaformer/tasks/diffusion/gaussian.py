"""Gaussian diffusion of the DiT on diffusers' schedulers: the training loss (ε MSE plus the variational bound
that trains the learned-range variance, as improved DDPM) and class-conditional sampling with classifier-free
guidance (DDPM with the learned variance, or DDIM).

diffusers has no variational-bound loss, so :func:`vlb_terms` writes it out from the scheduler's ``betas`` and
``alphas_cumprod``: the KL between the true posterior q(x_{t-1} | x_t, x_0) and the model's Gaussian, in bits
per dimension, and at t = 0 the negative log-likelihood of x_0 under a Gaussian discretised into 256 bins.
"""
from __future__ import annotations

import math

import torch
from diffusers import DDIMScheduler, DDPMScheduler
from torch import nn

__all__ = ["SAMPLERS", "diffusion_loss", "make_scheduler", "sample", "vlb_terms"]

SAMPLERS = ("ddpm", "ddim")


def make_scheduler(kind: str = "ddpm", train_timesteps: int = 1000, beta_start: float = 1e-4,
                   beta_end: float = 0.02, learn_sigma: bool = True, clip_sample: bool = False):
    """The DiT's schedule (linear betas) as a diffusers scheduler; ``ddpm`` takes the learned-range variance."""
    common = dict(num_train_timesteps=train_timesteps, beta_start=beta_start, beta_end=beta_end,
                  beta_schedule="linear", clip_sample=clip_sample, prediction_type="epsilon")
    if kind == "ddpm":  # respaced steps spread over 0..T-1 with rounding, as the official sampler's
        return DDPMScheduler(**common, variance_type="learned_range" if learn_sigma else "fixed_small",
                             timestep_spacing="linspace")
    if kind == "ddim":
        return DDIMScheduler(**common, set_alpha_to_one=False)
    raise ValueError(f"unknown sampler {kind!r} (known: {', '.join(SAMPLERS)})")


def _at(values: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values[t]`` shaped to broadcast over ``like`` (B, ...)."""
    return values.to(like.device, like.dtype)[t].reshape(-1, *([1] * (like.dim() - 1)))


def _standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    # the tanh approximation improved DDPM's bound is defined with
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _discretised_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) per element for data in [-1, 1] quantised to 256 levels, under N(mean, exp(log_scale)²)."""
    centred = x - mean
    inv_std = torch.exp(-log_scale)
    cdf_plus = _standard_normal_cdf(inv_std * (centred + 1.0 / 255.0))
    cdf_minus = _standard_normal_cdf(inv_std * (centred - 1.0 / 255.0))
    log_cdf_plus = cdf_plus.clamp(min=1e-12).log()
    log_one_minus_cdf_minus = (1.0 - cdf_minus).clamp(min=1e-12).log()
    log_delta = (cdf_plus - cdf_minus).clamp(min=1e-12).log()
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_minus, log_delta))


def vlb_terms(scheduler, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
              var_values: torch.Tensor) -> torch.Tensor:
    """Per-sample variational-bound term in bits per dimension, (B,), for predicted noise ``eps`` and variance
    interpolation ``var_values`` in [-1, 1] (between the posterior variance and beta_t, in log space)."""
    c = scheduler.config  # the linear schedule again in float64 (diffusers keeps float32)
    # made on x_t's device: tables copied from the host would wait for the device at every step
    betas = torch.linspace(c.beta_start, c.beta_end, c.num_train_timesteps, dtype=torch.float64, device=x_t.device)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
    posterior_var = betas * (1 - prev) / (1 - alphas_cumprod)
    posterior_log_var = torch.log(torch.cat([posterior_var[1:2], posterior_var[1:]]))  # t = 0 has variance 0
    coef_start = betas * prev.sqrt() / (1 - alphas_cumprod)
    coef_t = (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod)

    true_mean = _at(coef_start, t, x_t) * x_start + _at(coef_t, t, x_t) * x_t
    true_log_var = _at(posterior_log_var, t, x_t)
    pred_start = _at((1 / alphas_cumprod).sqrt(), t, x_t) * x_t - _at((1 / alphas_cumprod - 1).sqrt(), t, x_t) * eps
    pred_mean = _at(coef_start, t, x_t) * pred_start + _at(coef_t, t, x_t) * x_t
    frac = (var_values + 1) / 2
    pred_log_var = frac * _at(betas.log(), t, x_t) + (1 - frac) * true_log_var

    kl = 0.5 * (-1.0 + pred_log_var - true_log_var + torch.exp(true_log_var - pred_log_var)
                + (true_mean - pred_mean) ** 2 * torch.exp(-pred_log_var))
    nll = -_discretised_log_likelihood(x_start, pred_mean, 0.5 * pred_log_var)
    per_dim = torch.where((t == 0).reshape(-1, *([1] * (x_t.dim() - 1))), nll, kl)
    return per_dim.flatten(1).mean(1) / math.log(2.0)


def diffusion_loss(model: nn.Module, scheduler, x_start: torch.Tensor, labels: torch.Tensor,
                   t: torch.Tensor | None = None, noise: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Per-sample ``mse`` (of ε), ``vb`` (0 without a learned variance) and ``loss = mse + vb``, each (B,).

    ``t`` and ``noise`` are drawn (uniform steps, standard normal) where not given. The bound trains only the
    variance output: it sees the predicted ε detached, as in improved DDPM.
    """
    b = x_start.shape[0]
    if t is None:
        t = torch.randint(0, scheduler.config.num_train_timesteps, (b,), generator=generator).to(
            x_start.device, non_blocking=True)
    if noise is None:
        noise = torch.randn(x_start.shape, generator=generator, dtype=x_start.dtype).to(
            x_start.device, non_blocking=True)
    x_t = scheduler.add_noise(x_start, noise, t)
    out = model(x_t, t, labels)
    channels = x_start.shape[1]
    eps = out[:, :channels]
    loss_dtype = torch.promote_types(eps.dtype, torch.float32)  # float32 at least, under autocast too
    mse = (eps.to(loss_dtype) - noise.to(loss_dtype)).pow(2).flatten(1).mean(1)
    if out.shape[1] == 2 * channels:
        vb = vlb_terms(scheduler, x_start.double(), x_t.double(), t, eps.detach().double(),
                       out[:, channels:].double()).to(mse.dtype)
    else:
        vb = torch.zeros_like(mse)
    return {"mse": mse, "vb": vb, "loss": mse + vb}


@torch.no_grad()
def sample(model: nn.Module, labels: torch.Tensor, shape: tuple[int, ...], *, sampler: str = "ddpm",
           steps: int = 250, cfg_scale: float = 1.0, clip_sample: bool = False, train_timesteps: int = 1000,
           beta_start: float = 1e-4, beta_end: float = 0.02, generator: torch.Generator | None = None,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw one image (or latent) of ``shape`` (C, S, S) per label with ``steps`` respaced steps.

    With ``cfg_scale`` != 1 each step also runs the null class and moves ε to
    ``uncond + cfg_scale · (cond − uncond)`` on all channels (the model needs a null class); the learned
    variance, if any, is the conditional one.
    """
    null = getattr(model, "null_class", None)
    if cfg_scale != 1.0 and null is None:
        raise ValueError("classifier-free guidance needs a model trained with class dropout (a null class)")
    if steps < 1 or steps > train_timesteps:
        raise ValueError(f"sampling steps must be in 1..{train_timesteps}, got {steps}")
    learn_sigma = getattr(model, "learn_sigma", False)
    scheduler = make_scheduler(sampler, train_timesteps, beta_start, beta_end, learn_sigma, clip_sample)
    scheduler.set_timesteps(steps)
    labels = labels.to(device)
    x = torch.randn((len(labels), *shape), generator=generator).to(device)
    channels = shape[0]
    for t in scheduler.timesteps:
        steps_in = torch.full((len(labels),), int(t), device=device)
        if cfg_scale != 1.0:
            out = model(torch.cat([x, x]), torch.cat([steps_in, steps_in]),
                        torch.cat([labels, torch.full_like(labels, null)]))
            cond, uncond = out.chunk(2)
            eps = uncond[:, :channels] + cfg_scale * (cond[:, :channels] - uncond[:, :channels])
            out = torch.cat([eps, cond[:, channels:]], dim=1)
        else:
            out = model(x, steps_in, labels)
        if sampler == "ddim":
            out = out[:, :channels]
        x = scheduler.step(out, t, x, generator=generator).prev_sample
    return x
