"""The embedded digits data: a fixed stratified split, normalisation, augmentation."""
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from polaformer.data import DATASETS, UnknownDatasetError, get_data_spec
from polaformer.data.digits import DigitsDataset, digits_datasets, digits_split, random_shift


def test_split_is_deterministic():
    first, second = digits_split(), digits_split()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_split_sizes_and_types():
    x_train, y_train, x_test, y_test = digits_split()
    assert x_train.shape == (1437, 8, 8) and x_test.shape == (360, 8, 8)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert 0 <= x_train.min() and x_train.max() <= 16


def test_split_is_stratified_and_covers_every_image():
    _, y_train, _, y_test = digits_split()
    per_class = np.bincount(load_digits().target)
    test_counts = np.bincount(y_test, minlength=10)
    np.testing.assert_array_equal(np.bincount(y_train, minlength=10) + test_counts, per_class)
    # Each class keeps its 20% share of the test split, up to rounding.
    assert np.all(np.abs(test_counts - 0.2 * per_class) <= 1)


def test_other_seed_gives_other_split():
    assert not np.array_equal(digits_split(seed=0)[3], digits_split(seed=1)[3])


def test_datasets_are_normalised_with_train_statistics():
    train, test = digits_datasets(augment=False)
    images = torch.stack([train[i][0] for i in range(len(train))])
    assert abs(images.mean().item()) < 1e-4
    assert abs(images.std().item() - 1) < 1e-3
    assert (test.mean, test.std) == (train.mean, train.std)


def test_items_are_float_images_with_int_labels():
    train, test = digits_datasets()
    for dataset in (train, test):
        image, label = dataset[0]
        assert image.shape == (1, 8, 8) and image.dtype == torch.float32
        assert isinstance(label, int) and 0 <= label < 10


def test_test_split_is_never_augmented():
    _, test = digits_datasets(augment=True)
    assert test.shift_prob == 0
    torch.testing.assert_close(test[5][0], test[5][0], rtol=0, atol=0)


def test_augmentation_shifts_some_images_and_keeps_the_label():
    x_train, y_train, _, _ = digits_split()
    plain = DigitsDataset(x_train, y_train, mean=0.0, std=1.0)
    always = DigitsDataset(x_train, y_train, mean=0.0, std=1.0, shift_prob=1.0)
    torch.manual_seed(0)
    changed = sum(not torch.equal(always[i][0], plain[i][0]) for i in range(50))
    assert changed > 25  # 8 of the 9 offsets move the image (unless it is blank where it moves)
    assert always[3][1] == plain[3][1]


def test_random_shift_is_a_translation_padded_with_background():
    image = torch.zeros(1, 8, 8)
    image[0, 2:6, 3:5] = torch.arange(1.0, 9.0).reshape(4, 2)  # nothing on the border: shifts lose no pixel
    translations = [torch.roll(image, (dy, dx), dims=(1, 2)) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    torch.manual_seed(0)
    for _ in range(30):
        shifted = random_shift(image, 1)
        assert shifted.shape == image.shape
        assert any(torch.equal(shifted, t) for t in translations)


def test_registry():
    spec = get_data_spec("digits")
    assert (spec.num_classes, spec.in_chans, spec.img_size) == (10, 1, 8)
    assert "digits" in DATASETS
    with pytest.raises(UnknownDatasetError, match="unknown data set 'mnist'"):
        get_data_spec("mnist")
