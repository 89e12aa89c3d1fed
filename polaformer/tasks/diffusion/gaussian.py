"""Gaussian diffusion of the DiT: the training loss on diffusers' schedule (ε MSE plus the variational bound
that trains the learned-range variance, as improved DDPM) and class-conditional sampling with classifier-free
guidance by the official respaced sampler (DDPM or DDIM, :class:`RespacedDiffusion`).

diffusers has no variational-bound loss, so :func:`vlb_terms` writes it out from the scheduler's ``betas`` and
``alphas_cumprod``: the KL between the true posterior q(x_{t-1} | x_t, x_0) and the model's Gaussian, in bits
per dimension, and at t = 0 the negative log-likelihood of x_0 under a Gaussian discretised into 256 bins.

Sampling follows the official DiT code (``create_diffusion``, ``p_sample_loop``, ``ddim_sample_loop``,
``forward_with_cfg``) rather than diffusers' schedulers, whose defaults differ from it: a model without a
learned variance samples with the fixed-large variance (the betas), DDIM takes the stride of the DDIM paper and
ends at ᾱ = 1, and guidance moves the first three output channels only. The alternatives are options
(``variance="fixed_small"``, ``guide_all_channels=True``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...data.noised import make_scheduler

__all__ = ["GUIDED_CHANNELS", "SAMPLERS", "VARIANCES", "RespacedDiffusion", "diffusion_loss", "make_scheduler",
           "respaced_timesteps", "sample", "vlb_terms"]

SAMPLERS = ("ddpm", "ddim")
VARIANCES = ("fixed_large", "fixed_small")  # of models without a learned variance: the betas, or the posterior's
GUIDED_CHANNELS = 3  # the official forward_with_cfg guides model_out[:, :3] (its comment: for reproducibility)


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


def respaced_timesteps(steps: int, train_timesteps: int = 1000, ddim: bool = False) -> list[int]:
    """The original steps a respaced sampler visits, ascending, as the official ``space_timesteps``.

    DDPM (``create_diffusion(str(steps))``): ``steps`` spread evenly over 0..T−1 with rounding (250 steps:
    0, 4, 8, …, 995, 999). DDIM (``"ddim{steps}"``): the fixed stride of the DDIM paper, ``range(0, T, s)`` with
    the smallest stride ``s`` that gives exactly ``steps`` (50 steps: 0, 20, …, 980); a count no integer stride
    gives is an error, as there.
    """
    if not 1 <= steps <= train_timesteps:
        raise ValueError(f"sampling steps must be in 1..{train_timesteps}, got {steps}")
    if ddim:
        counts = {len(range(0, train_timesteps, s)): s for s in range(train_timesteps - 1, 0, -1)}
        if steps not in counts:
            nearest = sorted(counts, key=lambda n: (abs(n - steps), n))[:2]
            raise ValueError(f"DDIM takes the official 'ddimN' stride: no integer stride gives {steps} of "
                             f"{train_timesteps} steps (nearest: {', '.join(map(str, sorted(nearest)))})")
        return list(range(0, train_timesteps, counts[steps]))
    stride = (train_timesteps - 1) / (steps - 1) if steps > 1 else 1.0
    kept, position = [], 0.0
    for _ in range(steps):  # accumulated, and rounded half to even, as the official loop
        kept.append(round(position))
        position += stride
    return kept


class RespacedDiffusion:
    """The DiT's linear schedule respaced to ``steps`` steps, with the official sampler's tables in float64.

    ``timesteps`` lists the original steps (what the model is given), ascending; index ``i`` of the methods is
    a position in it. The respaced betas are ``1 − ᾱ_i / ᾱ_{i−1}`` of the kept steps. ``learn_sigma``: the
    model's second half of channels interpolates the log-variance between the posterior's and beta; otherwise
    ``variance`` is ``fixed_large`` (beta, the official default) or ``fixed_small`` (the posterior's, the
    official ``sigma_small``).
    """

    def __init__(self, steps: int, *, ddim: bool = False, learn_sigma: bool = True, variance: str = "fixed_large",
                 train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 clip_sample: bool = False):
        if variance not in VARIANCES:
            raise ValueError(f"unknown variance {variance!r} (known: {', '.join(VARIANCES)})")
        self.timesteps = respaced_timesteps(steps, train_timesteps, ddim)
        self.learn_sigma, self.clip_sample = learn_sigma, clip_sample
        full = torch.cumprod(1 - torch.linspace(beta_start, beta_end, train_timesteps, dtype=torch.float64), 0)
        kept = full[self.timesteps]
        betas = 1 - kept / torch.cat([kept.new_ones(1), kept[:-1]])
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])  # 1 before the first step: DDIM ends at x_0
        posterior = betas * (1 - prev) / (1 - alphas_cumprod)
        first = posterior[1:2] if len(posterior) > 1 else betas[:1]  # step 0 adds no noise: any finite value
        self.tables = {
            "sqrt_recip": (1 / alphas_cumprod).sqrt(), "sqrt_recipm1": (1 / alphas_cumprod - 1).sqrt(),
            "sqrt_prev": prev.sqrt(), "sqrt_one_minus_prev": (1 - prev).sqrt(),
            "coef_start": betas * prev.sqrt() / (1 - alphas_cumprod),
            "coef_t": (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod),
            "log_beta": betas.log(), "log_posterior": torch.cat([first, posterior[1:]]).log(),
            "log_fixed": torch.cat([first, posterior[1:] if variance == "fixed_small" else betas[1:]]).log(),
        }

    def _at(self, name: str, i: int, like: torch.Tensor) -> torch.Tensor:
        return self.tables[name][i].to(like.dtype)  # in the sample's precision (the official's are float32)

    def p_mean_variance(self, out: torch.Tensor, i: int, x: torch.Tensor):
        """``(mean, log_variance, x0)`` of p(x_{t−1} | x_t) at index ``i`` for the model output ``out``."""
        channels = x.shape[1]
        eps = out[:, :channels]
        if self.learn_sigma:
            frac = (out[:, channels:] + 1) / 2
            log_variance = frac * self._at("log_beta", i, x) + (1 - frac) * self._at("log_posterior", i, x)
        else:
            log_variance = self._at("log_fixed", i, x).expand_as(x)
        x0 = self._at("sqrt_recip", i, x) * x - self._at("sqrt_recipm1", i, x) * eps
        if self.clip_sample:
            x0 = x0.clamp(-1, 1)
        return self._at("coef_start", i, x) * x0 + self._at("coef_t", i, x) * x, log_variance, x0

    def ddpm_step(self, out: torch.Tensor, i: int, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        mean, log_variance, _ = self.p_mean_variance(out, i, x)
        return mean if i == 0 else mean + torch.exp(0.5 * log_variance) * noise

    def ddim_step(self, out: torch.Tensor, i: int, x: torch.Tensor) -> torch.Tensor:
        """Deterministic DDIM (η = 0), ε re-derived from the (clipped) x_0 as the official."""
        _, _, x0 = self.p_mean_variance(out, i, x)
        eps = (self._at("sqrt_recip", i, x) * x - x0) / self._at("sqrt_recipm1", i, x)
        return x0 * self._at("sqrt_prev", i, x) + self._at("sqrt_one_minus_prev", i, x) * eps


@torch.no_grad()
def sample(model: nn.Module, labels: torch.Tensor, shape: tuple[int, ...], *, sampler: str = "ddpm",
           steps: int = 250, cfg_scale: float = 1.0, clip_sample: bool = False, train_timesteps: int = 1000,
           beta_start: float = 1e-4, beta_end: float = 0.02, variance: str = "fixed_large",
           guide_all_channels: bool = False, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw one image (or latent) of ``shape`` (C, S, S) per label with ``steps`` respaced steps, as the official
    ``p_sample_loop`` (``ddpm``) or ``ddim_sample_loop`` (``ddim``, η = 0) with ``clip_denoised=clip_sample``.

    With ``cfg_scale`` != 1 each step also runs the null class (the model needs one) and moves the output to
    ``uncond + cfg_scale · (cond − uncond)`` on its first three channels, as the official ``forward_with_cfg``
    (the rest, a fourth latent channel's ε and a learned variance included, are the conditional ones);
    ``guide_all_channels`` moves every ε channel instead (the usual guidance, the variance still conditional).
    ``variance`` is that of a model without a learned one (:data:`VARIANCES`).

    ``noise`` (steps + 1, N, C, S, S): the starting sample, then the noise of each step in the order they run
    (DDIM reads only the first); drawn from ``generator`` where not given.
    """
    null = getattr(model, "null_class", None)
    if cfg_scale != 1.0 and null is None:
        raise ValueError("classifier-free guidance needs a model trained with class dropout (a null class)")
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r} (known: {', '.join(SAMPLERS)})")
    diffusion = RespacedDiffusion(steps, ddim=sampler == "ddim", learn_sigma=getattr(model, "learn_sigma", False),
                                  variance=variance, train_timesteps=train_timesteps, beta_start=beta_start,
                                  beta_end=beta_end, clip_sample=clip_sample)
    size = (len(labels), *shape)
    if noise is not None and tuple(noise.shape) != (steps + 1, *size):
        raise ValueError(f"noise must have shape {(steps + 1, *size)}, got {tuple(noise.shape)}")

    def draw(k: int) -> torch.Tensor:
        return (noise[k] if noise is not None else torch.randn(size, generator=generator)).to(device)

    labels = labels.to(device)
    x = draw(0)
    guided = shape[0] if guide_all_channels else GUIDED_CHANNELS
    for k, i in enumerate(reversed(range(len(diffusion.timesteps))), start=1):
        t = torch.full((len(labels),), diffusion.timesteps[i], device=device)
        if cfg_scale != 1.0:
            cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]),
                                 torch.cat([labels, torch.full_like(labels, null)])).chunk(2)
            mixed = uncond[:, :guided] + cfg_scale * (cond[:, :guided] - uncond[:, :guided])
            out = torch.cat([mixed, cond[:, guided:]], dim=1)
        else:
            out = model(x, t, labels)
        if sampler == "ddim":
            x = diffusion.ddim_step(out, i, x)
        else:
            x = diffusion.ddpm_step(out, i, x, draw(k) if i > 0 else None)
    return x
