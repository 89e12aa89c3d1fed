"""PSNR and SSIM on the Y channel, as the super-resolution papers report them.

The protocol (basicsr's ``calculate_psnr``/``calculate_ssim`` with ``test_y_channel``, after MATLAB): both
images as uint8 RGB, ``scale`` pixels cropped from every border, the BT.601 luma
``Y = 16 + (65.481·R + 128.553·G + 24.966·B) / 255`` in [16, 235] (not rounded), PSNR with a peak of 255, and
SSIM with an 11×11 Gaussian window of σ = 1.5 over the valid region only, constants (0.01·255)², (0.03·255)².
torchmetrics' SSIM does not fit: it pads the image by reflection and averages the SSIM map over the padded
border too, which moves the score in the third decimal; so both metrics are written out here, in float64.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["BT601_LUMA", "rgb_to_y", "sr_metrics", "to_uint8"]

BT601_LUMA = (65.481, 128.553, 24.966)
SSIM_WINDOW, SSIM_SIGMA = 11, 1.5


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """A float image in [0, 1] as the uint8 image a file would hold (clamped, rounded)."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def rgb_to_y(image: torch.Tensor) -> torch.Tensor:
    """(…, 3, H, W) uint8 RGB → (…, 1, H, W) float64 BT.601 luma in [16, 235]."""
    weights = torch.tensor(BT601_LUMA, dtype=torch.float64, device=image.device).view(3, 1, 1)
    return ((image.double() / 255 * weights).sum(-3, keepdim=True) + 16.0)


def sr_metrics(sr: torch.Tensor, hr: torch.Tensor, crop_border: int) -> dict[str, float]:
    """PSNR-Y (dB) and SSIM-Y of one (3, H, W) uint8 image against its reference."""
    if sr.shape != hr.shape:
        raise ValueError(f"the images differ in size: {tuple(sr.shape)} and {tuple(hr.shape)}")
    if sr.dtype != torch.uint8 or hr.dtype != torch.uint8:
        raise ValueError(f"the metrics take uint8 images (to_uint8), got {sr.dtype} and {hr.dtype}")
    h, w = sr.shape[-2:]
    if min(h, w) - 2 * crop_border < 11:
        raise ValueError(f"an image of {w}x{h} leaves no 11x11 SSIM window inside a border of {crop_border}")
    c = slice(crop_border, -crop_border if crop_border else None)
    sr_y, hr_y = rgb_to_y(sr[..., c, c])[None], rgb_to_y(hr[..., c, c])[None]
    mse = (sr_y - hr_y).pow(2).mean().item()
    psnr = math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)
    return {"psnr_y": psnr, "ssim_y": _ssim(sr_y, hr_y)}


def _ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM of two (1, 1, H, W) float64 images in [0, 255], Gaussian-weighted, valid region only."""
    offsets = torch.arange(SSIM_WINDOW, dtype=torch.float64) - SSIM_WINDOW // 2
    g = torch.exp(-offsets ** 2 / (2 * SSIM_SIGMA ** 2))
    window = (torch.outer(g, g) / g.sum() ** 2).to(a.device)[None, None]

    def blur(x):
        return F.conv2d(x, window)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    ssim = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return ssim.mean().item()
