"""Images for diffusion training, as the diffusion task and the conversion of a DiT read them: the digits in
[-1, 1] at a model's size, each training image drawn with a step and noise, and the DiT's noise schedule."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..engine.config import ConfigError
from ..engine.distributed import SampleDraws
from .digits import digits_split

__all__ = ["DIGITS_MAX", "NoisedImages", "digits_images", "make_scheduler"]

DIGITS_MAX = 16.0  # the digits' pixel values are 0..16


def digits_images(image_size: int = 16):
    """``(train_x, train_y, test_x, test_y)``: the fixed digits split, (N, 1, S, S) in [-1, 1], bilinearly
    upsampled from 8×8 to ``image_size`` (a multiple of 8)."""
    if image_size < 8 or image_size % 8:
        raise ConfigError(f"digits images are 8x8: data.image_size must be a multiple of 8, got {image_size}")
    x_train, y_train, x_test, y_test = digits_split()

    def prepare(x):
        x = torch.from_numpy(x).unsqueeze(1) / DIGITS_MAX * 2 - 1
        if image_size != 8:
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return x.clamp(-1, 1)

    return prepare(x_train), torch.from_numpy(y_train), prepare(x_test), torch.from_numpy(y_test)


class NoisedImages(SampleDraws, Dataset):
    """``(image, label, timestep, noise)``: each training image with a uniform step below ``timesteps`` and
    standard normal noise of ``noise_shape`` (the model's input: the image's, or its latent's), and with
    ``posterior`` a second such draw, the VAE posterior's sample (the diffusion task's ``encode``); all drawn from
    (``seed``, epoch, index) (:class:`~polaformer.engine.distributed.SampleDraws`): the same for any process count."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, timesteps: int, noise_shape: tuple, seed: int = 0,
                 posterior: bool = False):
        super().__init__(seed)
        self.images, self.labels, self.timesteps, self.noise_shape = images, labels, timesteps, tuple(noise_shape)
        self.posterior = posterior

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        generator = self.generator(index)
        t = torch.randint(0, self.timesteps, (), generator=generator)
        draws = [torch.randn(self.noise_shape, generator=generator) for _ in range(1 + self.posterior)]
        return self.images[index], self.labels[index], t, *draws


def make_scheduler(train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) :
    """The DiT's schedule (linear betas) as a diffusers scheduler, whose ``add_noise`` and ``config`` the training
    loss uses. Sampling does not step it (:func:`polaformer.tasks.diffusion.sample`: diffusers' samplers are not the
    official ones)."""
    from diffusers import DDPMScheduler  # the diffusion extra: only diffusion runs pay for its import

    return DDPMScheduler(num_train_timesteps=train_timesteps, beta_start=beta_start, beta_end=beta_end,
                         beta_schedule="linear", prediction_type="epsilon")
