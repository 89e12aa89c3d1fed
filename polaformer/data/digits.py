"""The embedded default data set: scikit-learn's handwritten digits.

1,797 real 8x8 grey-scale images (pixel values 0..16) of the digits 0-9. It ships inside
scikit-learn, so training and evaluation work offline and finish in about a minute on a CPU.
The train/test split is fixed (stratified, seeded) so that every run evaluates the same images.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

NUM_CLASSES = 10
IN_CHANS = 1
IMG_SIZE = 8
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def digits_split(test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED):
    """Return ``(x_train, y_train, x_test, y_test)`` as numpy arrays; images are (N, 8, 8) floats."""
    # scikit-learn takes about a second to import: only the commands that read the digits pay for it
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images.astype(np.float32),
        digits.target.astype(np.int64),
        test_size=test_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    return x_train, y_train, x_test, y_test


class DigitsDataset(Dataset):
    """(1, 8, 8) float images normalised with fixed statistics, optionally randomly shifted.

    With ``shift_prob`` > 0, that fraction of the images is moved by up to ``max_shift`` pixels in
    each direction (pad with the blank background, then crop): a cheap augmentation that matters
    on only 1,437 training images. Shifting every image slows a ViT's training down a lot, since
    the test digits are all centred; shifting half of them works best (measured with a tiny ViT).
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        mean: float,
        std: float,
        shift_prob: float = 0.0,
        max_shift: int = 1,
    ):
        self.images = torch.from_numpy(images).unsqueeze(1)  # raw 0..16 values, so padding with 0 is background
        self.labels = torch.from_numpy(labels)
        self.mean = mean
        self.std = std
        self.shift_prob = shift_prob
        self.max_shift = max_shift

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.shift_prob and torch.rand(()) < self.shift_prob:
            image = random_shift(image, self.max_shift)
        return (image - self.mean) / self.std, int(self.labels[index])


def random_shift(image: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Translate a (C, H, W) image by a random offset in ``[-max_shift, max_shift]`` per axis."""
    height, width = image.shape[-2:]
    padded = F.pad(image, (max_shift,) * 4)
    top, left = torch.randint(0, 2 * max_shift + 1, (2,)).tolist()
    return padded[..., top : top + height, left : left + width]


def digits_datasets(augment: bool = True, shift_prob: float = 0.5):
    """Return ``(train, test)`` datasets; normalisation statistics come from the train split only."""
    x_train, y_train, x_test, y_test = digits_split()
    mean, std = float(x_train.mean()), float(x_train.std())
    train = DigitsDataset(x_train, y_train, mean, std, shift_prob=shift_prob if augment else 0.0)
    test = DigitsDataset(x_test, y_test, mean, std)
    return train, test
