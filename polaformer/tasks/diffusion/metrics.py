"""Scores of generated images with local networks only: a digits classifier (accuracy of class-conditioned
samples; its hidden features for FID) and torchmetrics' FID on those features or on an Inception network
whose weights file the user has (torchmetrics' default downloads it)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.config import ConfigError
from .data import digits_images

__all__ = ["DigitsClassifier", "class_accuracy", "feature_network", "frechet_distance", "train_digits_classifier"]


class DigitsClassifier(nn.Module):
    """A two-layer perceptron on 8×8 grey images in [-1, 1] (larger ones are average-pooled to 8×8)."""

    num_features = 128  # read by torchmetrics' FID instead of running a dummy image

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, self.num_features)
        self.out = nn.Linear(self.num_features, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 1 or x.shape[-1] % 8 or x.shape[-2] != x.shape[-1]:
            raise ValueError(f"the digits classifier reads (B, 1, 8k, 8k) images, got {tuple(x.shape)}")
        return F.relu(self.hidden(F.adaptive_avg_pool2d(x.float(), 8).flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))


class _Features(nn.Module):
    """torchmetrics' FID calls the feature network's forward: the classifier's hidden layer."""

    def __init__(self, classifier: DigitsClassifier):
        super().__init__()
        self.classifier = classifier
        self.num_features = classifier.num_features

    def forward(self, x):
        return self.classifier.features(x)


@functools.lru_cache(maxsize=4)
def train_digits_classifier(image_size: int = 16, steps: int = 300, seed: int = 0) -> DigitsClassifier:
    """The classifier trained (full batch, Adam, seeded) on the digits training split at ``image_size``; made
    once per process and setting (a frozen module, shared)."""
    x, y, _, _ = digits_images(image_size)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = DigitsClassifier()
    torch.random.set_rng_state(generator_state)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # products this small only lose time to thread hand-offs
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval().requires_grad_(False)


def feature_network(spec: str, image_size: int, channels: int) -> tuple[nn.Module, bool]:
    """``(network, inception)`` for FID: ``digits`` (the digits classifier's hidden features) or the path of
    an Inception-v3 weights file for torch-fidelity's network (the FID of the literature)."""
    if spec == "digits":
        if channels != 1:
            raise ConfigError(f"the digits feature network reads grey images, these have {channels} channels")
        return _Features(train_digits_classifier(image_size)), False
    if not Path(spec).is_file():
        problem = "not a regular file" if Path(spec).exists() else "not found"
        raise ConfigError(f"FID features: give 'digits' or an Inception weights file; {problem}: {spec}")
    try:
        from torchmetrics.image.fid import NoTrainInceptionV3
        network = NoTrainInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(spec))
    except ModuleNotFoundError as e:
        raise ConfigError(f"Inception FID needs torch-fidelity (pip install torch-fidelity): {e}") from None
    except (RuntimeError, OSError, KeyError) as e:
        raise ConfigError(f"cannot load Inception weights from {spec}: {str(e).splitlines()[0]}") from None
    network.num_features = 2048
    return network, True


@torch.no_grad()
def frechet_distance(real: torch.Tensor, fake: torch.Tensor, network: nn.Module, inception: bool = False,
                     batch_size: int = 256) -> float:
    """FID between two image sets in [-1, 1] (N, C, S, S) on ``network``'s features (torchmetrics)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    if min(len(real), len(fake)) < 2:
        raise ValueError(f"FID needs at least 2 images per set, got {len(real)} real and {len(fake)} generated")
    metric = FrechetInceptionDistance(feature=network, reset_real_features=True)
    for images, is_real in ((real, True), (fake, False)):
        for chunk in images.split(batch_size):
            if inception:  # torch-fidelity's network takes RGB bytes
                chunk = ((chunk.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).expand(-1, 3, -1, -1)
            metric.update(chunk, real=is_real)
    return float(metric.compute())


@torch.no_grad()
def class_accuracy(classifier: DigitsClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of ``images`` the classifier assigns to ``labels``."""
    return (classifier(images).argmax(1) == labels).float().mean().item()
