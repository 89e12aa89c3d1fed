"""Class-conditional image generation with PolaDiT (:mod:`polaformer.models.pola_dit`): Gaussian diffusion
(training on diffusers' schedule, sampling by the official respaced sampler), training on the one engine, sampling
with classifier-free guidance, FID and class accuracy with local networks (docs/diffusion.md)."""
from .data import LATENT_SCALE, digits_images, folder_images, load_vae
from .gaussian import (
    SAMPLERS,
    VARIANCES,
    RespacedDiffusion,
    diffusion_loss,
    make_scheduler,
    respaced_timesteps,
    sample,
    vlb_terms,
)
from .metrics import DigitsClassifier, class_accuracy, feature_network, frechet_distance, train_digits_classifier
from .train import DiffusionTask, diffusion_config, generate, load_diffusion_model, train_diffusion

__all__ = ["LATENT_SCALE", "SAMPLERS", "VARIANCES", "DiffusionTask", "DigitsClassifier", "RespacedDiffusion",
           "class_accuracy", "diffusion_config", "diffusion_loss", "digits_images", "feature_network", "folder_images",
           "frechet_distance", "generate", "load_diffusion_model", "load_vae", "make_scheduler", "respaced_timesteps",
           "sample", "train_diffusion", "train_digits_classifier", "vlb_terms"]
