"""ImageNet-layout folders (polaformer.data.folder) on tiny generated image folders."""
from __future__ import annotations

import io
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from polaformer.data.folder import (
    DatasetError,
    ImageFolderDataset,
    build_folder_datasets,
    build_mixup,
    build_transform,
    collate_skip_corrupt,
)

CLASSES = ("cat", "dog", "fox")
PER_CLASS = 4


def make_cfg(data_path="", img_size=32, **overrides):
    """A stand-in for the engine's config with exactly the keys folder.py reads (official defaults)."""
    cfg = SimpleNamespace(
        DATA=SimpleNamespace(DATA_PATH=str(data_path), IMG_SIZE=img_size, INTERPOLATION="bicubic"),
        AUG=SimpleNamespace(
            COLOR_JITTER=0.4,
            AUTO_AUGMENT="rand-m9-mstd0.5-inc1",
            REPROB=0.25,
            REMODE="pixel",
            RECOUNT=1,
            MIXUP=0.8,
            CUTMIX=1.0,
            CUTMIX_MINMAX=None,
            MIXUP_PROB=1.0,
            MIXUP_SWITCH_PROB=0.5,
            MIXUP_MODE="batch",
        ),
        MODEL=SimpleNamespace(NAME="pola_pvt_tiny", LABEL_SMOOTHING=0.1),
        TEST=SimpleNamespace(CROP=True),
    )
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def write_image(path, seed, size=40):
    """A random RGB image, saved as JPEG or PNG according to the suffix."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def jpeg_bytes(seed, size=40):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
        buffer, format="JPEG"
    )
    return buffer.getvalue()


def make_split(root, classes=CLASSES, per_class=PER_CLASS, seed=0):
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            write_image(folder / f"img{i}.{'jpg' if i % 2 == 0 else 'png'}", seed + 100 * c + i)


@pytest.fixture()
def data_root(tmp_path):
    """train/: 3 classes x 4 images (JPEG and PNG) + a corrupt and a truncated JPEG; val/: 3 x 2."""
    root = tmp_path / "data"
    make_split(root / "train")
    make_split(root / "val", per_class=2, seed=1000)
    (root / "train" / "cat" / "zz_corrupt.jpg").write_bytes(np.random.default_rng(7).bytes(600))
    good = jpeg_bytes(8)
    (root / "train" / "dog" / "zz_truncated.jpg").write_bytes(good[: len(good) // 2])
    # ignored: hidden files and folders, files with other extensions
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"junk")
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    (root / "train" / ".cache").mkdir()
    return root


CORRUPT = {"zz_corrupt.jpg", "zz_truncated.jpg"}


def test_truncated_fixture_is_really_unreadable(data_root):
    with pytest.raises(OSError):
        with Image.open(data_root / "train" / "dog" / "zz_truncated.jpg") as image:
            image.load()


def test_class_mapping_and_samples(data_root):
    train = ImageFolderDataset(data_root / "train")
    assert train.classes == list(CLASSES)
    assert train.class_to_idx == {"cat": 0, "dog": 1, "fox": 2}
    assert len(train) == 3 * PER_CLASS + 2
    assert train.class_counts() == [5, 5, 4]
    names = {os.path.basename(p) for p, _ in train.samples}
    assert {"img0.jpg", "img1.png"} <= names and CORRUPT <= names
    assert ".DS_Store" not in names and "notes.txt" not in names
    for path, target in train.samples:
        assert os.path.basename(os.path.dirname(path)) == CLASSES[target]
    image, target = train[1]  # cat/img1.png, untransformed
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (40, 40)
    assert target == 0


def test_nested_and_uppercase_extensions(tmp_path):
    root = tmp_path / "split"
    (root / "a" / "sub").mkdir(parents=True)
    (root / "b").mkdir()
    write_image(root / "a" / "sub" / "x.PNG", 1)
    write_image(root / "b" / "y.JPEG", 2)
    ds = ImageFolderDataset(root)
    assert len(ds) == 2 and ds.targets.tolist() == [0, 1]


@pytest.mark.parametrize("img_size", [32, 48])
def test_transform_output_shapes(data_root, img_size):
    cfg = make_cfg(data_root, img_size=img_size)
    for is_train in (True, False):
        ds = ImageFolderDataset(data_root / "val", build_transform(cfg, is_train))
        for i in range(len(ds)):
            image, _ = ds[i]
            assert image.shape == (3, img_size, img_size) and image.dtype == torch.float32


def test_train_transform_follows_official_settings():
    small = build_transform(make_cfg(img_size=32), True).transforms
    assert isinstance(small[0], transforms.RandomCrop) and small[0].padding == 4
    big = build_transform(make_cfg(img_size=224), True)
    names = [type(t).__name__ for t in big.transforms]
    assert names[0] == "RandomResizedCropAndInterpolation"
    assert "RandAugment" in names and "RandomErasing" in names
    assert "ColorJitter" not in names  # timm turns colour jitter off while RandAugment is on
    erasing = big.transforms[names.index("RandomErasing")]
    assert erasing.probability == 0.25 and erasing.mode == "pixel"
    plain = build_transform(make_cfg(img_size=224, AUG__AUTO_AUGMENT="none", AUG__REPROB=0.0), True)
    names = [type(t).__name__ for t in plain.transforms]
    assert "ColorJitter" in names and "RandAugment" not in names and "RandomErasing" not in names
    no_jitter = build_transform(make_cfg(img_size=224, AUG__AUTO_AUGMENT="none", AUG__COLOR_JITTER=0.0), True)
    assert "ColorJitter" not in [type(t).__name__ for t in no_jitter.transforms]


@pytest.mark.parametrize("img_size,crop,resize", [(224, True, 256), (384, True, 438), (224, False, 224)])
def test_eval_transform_matches_official(img_size, crop, resize):
    steps = build_transform(make_cfg(img_size=img_size, TEST__CROP=crop), False).transforms
    assert isinstance(steps[0], transforms.Resize)
    assert tuple(steps[0].size) == (resize, resize)
    assert steps[0].interpolation == transforms.InterpolationMode.BICUBIC
    if crop:
        assert isinstance(steps[1], transforms.CenterCrop) and tuple(steps[1].size) == (img_size, img_size)
    assert isinstance(steps[-2], transforms.ToTensor) and isinstance(steps[-1], transforms.Normalize)
    image = Image.fromarray(np.zeros((300, 500, 3), dtype=np.uint8))
    transform = build_transform(make_cfg(img_size=img_size, TEST__CROP=crop), False)
    assert transform(image).shape == (3, img_size, img_size)


def test_bad_interpolation_and_size():
    with pytest.raises(DatasetError, match="DATA.INTERPOLATION"):
        build_transform(make_cfg(DATA__INTERPOLATION="cubic"), False)
    with pytest.raises(DatasetError, match="DATA.IMG_SIZE"):
        build_transform(make_cfg(img_size=0), True)


def test_corrupt_images_skipped_warned_once_and_counted(data_root, caplog):
    cfg = make_cfg(data_root, img_size=32)
    train_set, _, _ = build_folder_datasets(cfg)
    loader = DataLoader(train_set, batch_size=4, shuffle=True, collate_fn=collate_skip_corrupt)
    caplog.set_level(logging.WARNING, logger="polaformer.data.folder")
    for epoch in range(2):
        seen = skipped = 0
        for images, targets, num_skipped in loader:
            assert images.shape[1:] == (3, 32, 32) and len(images) == len(targets)
            seen += len(images)
            skipped += num_skipped
        assert (seen, skipped) == (3 * PER_CLASS, 2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2  # once per file, not once per epoch
    assert any("zz_corrupt.jpg" in m for m in warned) and any("zz_truncated.jpg" in m for m in warned)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_count_travels_through_workers(data_root, num_workers):
    cfg = make_cfg(data_root, img_size=32)
    ds = ImageFolderDataset(data_root / "train", build_transform(cfg, False), image_shape=(3, 32, 32))
    loader = DataLoader(ds, batch_size=3, num_workers=num_workers, collate_fn=ds.collate_fn)
    seen = skipped = 0
    labels = []
    for images, targets, num_skipped in loader:
        seen += len(images)
        skipped += num_skipped
        labels += targets.tolist()
    assert (seen, skipped) == (3 * PER_CLASS, 2)
    assert sorted(labels) == [0] * 4 + [1] * 4 + [2] * 4


def test_all_corrupt_batch_and_even_batches():
    images, targets, num_skipped = collate_skip_corrupt([None, None], image_shape=(3, 8, 8))
    assert images.shape == (0, 3, 8, 8) and targets.shape == (0,) and targets.dtype == torch.long
    assert num_skipped == 2
    images, targets, num_skipped = collate_skip_corrupt([None])
    assert images.shape == (0,) and targets.shape == (0,) and num_skipped == 1
    sample = (torch.zeros(3, 8, 8), 1)
    images, targets, num_skipped = collate_skip_corrupt([sample, None, sample, sample], even=True)
    assert images.shape == (2, 3, 8, 8) and targets.tolist() == [1, 1] and num_skipped == 1
    images, _, num_skipped = collate_skip_corrupt([sample, None], image_shape=(3, 8, 8), even=True)
    assert images.shape == (0, 3, 8, 8) and num_skipped == 1


def test_mixup_batches_are_even_with_soft_targets(data_root):
    cfg = make_cfg(data_root, img_size=32)
    train_set, val_set, num_classes = build_folder_datasets(cfg)
    assert num_classes == 3 and len(val_set) == 6
    mixup = build_mixup(cfg, num_classes)
    loader = DataLoader(train_set, batch_size=5, collate_fn=train_set.collate_fn)
    total_skipped = 0
    for images, targets, num_skipped in loader:
        total_skipped += num_skipped
        assert len(images) % 2 == 0
        if len(images) == 0:
            continue
        mixed, soft = mixup(images, targets)
        assert mixed.shape == images.shape and soft.shape == (len(images), num_classes)
        assert torch.allclose(soft.sum(1), torch.ones(len(images)))
        assert soft.min() > 0  # label smoothing 0.1 spreads mass over every class
    assert total_skipped == 2
    # validation batches are not made even
    sizes = [len(images) for images, _, _ in DataLoader(val_set, batch_size=5, collate_fn=val_set.collate_fn)]
    assert sizes == [5, 1]


def test_build_mixup_settings_and_off():
    mixup = build_mixup(make_cfg(), 10)
    assert mixup.mixup_alpha == 0.8 and mixup.cutmix_alpha == 1.0 and mixup.label_smoothing == 0.1
    assert mixup.mix_prob == 1.0 and mixup.switch_prob == 0.5 and mixup.mode == "batch"
    assert mixup.num_classes == 10
    assert build_mixup(make_cfg(AUG__MIXUP=0.0, AUG__CUTMIX=0.0), 10) is None
    minmax = build_mixup(make_cfg(AUG__MIXUP=0.0, AUG__CUTMIX=0.0, AUG__CUTMIX_MINMAX=[0.2, 0.8]), 10)
    assert minmax is not None and tuple(minmax.cutmix_minmax) == (0.2, 0.8)
    images = torch.randn(4, 3, 8, 8)
    mixed, soft = build_mixup(make_cfg(AUG__CUTMIX=0.0), 3)(images.clone(), torch.tensor([0, 1, 2, 0]))
    assert mixed.shape == images.shape and soft.shape == (4, 3)
    assert not torch.equal(mixed, images)  # (timm's Mixup mixes its input in place)


# ---------------------------------------------------------------- errors before training


def test_error_data_path_unset_or_missing(tmp_path):
    with pytest.raises(DatasetError, match="DATA.DATA_PATH"):
        build_folder_datasets(make_cfg(""))
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError, match=f"data folder not found: {missing}"):
        build_folder_datasets(make_cfg(missing))


def test_error_missing_train_or_val(tmp_path):
    make_split(tmp_path / "train")
    with pytest.raises(DatasetError, match=f"missing folder {tmp_path / 'val'}"):
        build_folder_datasets(make_cfg(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError) as info:
        build_folder_datasets(make_cfg(empty))
    assert str(empty / "train") in str(info.value) and str(empty / "val") in str(info.value)


def test_error_empty_class_folder(data_root):
    (data_root / "val" / "eel").mkdir()
    (data_root / "val" / "eel" / "readme.txt").write_text("no images here")
    (data_root / "train" / "eel").mkdir()
    write_image(data_root / "train" / "eel" / "a.png", 3)
    with pytest.raises(DatasetError, match=f"empty class folder: {data_root / 'val' / 'eel'}"):
        build_folder_datasets(make_cfg(data_root))


def test_error_several_empty_class_folders(tmp_path):
    make_split(tmp_path, classes=("a",))
    for name in ("b", "c"):
        (tmp_path / name).mkdir()
    with pytest.raises(DatasetError, match="2 empty class folders.*b, c"):
        ImageFolderDataset(tmp_path)


def test_error_no_images(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "b").mkdir(parents=True)
    make_split(tmp_path / "val", classes=("a", "b"))
    with pytest.raises(DatasetError, match=f"no images in {tmp_path / 'train'}"):
        build_folder_datasets(make_cfg(tmp_path))
    flat = tmp_path / "flat"
    flat.mkdir()
    write_image(flat / "x.jpg", 1)
    with pytest.raises(DatasetError, match="no class folders \\(found 1 image files directly in it\\)"):
        ImageFolderDataset(flat)


def test_error_train_val_classes_differ(tmp_path):
    make_split(tmp_path / "train", classes=("ant", "bee", "cat"), per_class=1)
    make_split(tmp_path / "val", classes=("ant", "bee", "cow", "dog"), per_class=1)
    with pytest.raises(DatasetError) as info:
        build_folder_datasets(make_cfg(tmp_path))
    message = str(info.value)
    assert "1 only in train/ (cat)" in message and "2 only in val/ (cow, dog)" in message


def test_official_randaugment_posterize_to_zero_bits_works():
    # 'rand-m9-mstd0.5-inc1' can draw magnitude 10, i.e. posterize to 0 bits (Pillow 13 refuses; we pin <13)
    from PIL import Image
    from timm.data.auto_augment import posterize

    out = posterize(Image.new("RGB", (8, 8), (200, 100, 50)), 0)
    assert out.getpixel((0, 0)) == (0, 0, 0)


def test_a_fifo_named_like_an_image_is_skipped(data_root):
    """Reading a FIFO blocks until a writer comes: only regular files are images (issue 27)."""
    before = len(ImageFolderDataset(data_root / "train"))
    os.mkfifo(data_root / "train" / CLASSES[0] / "pipe.png")
    train = ImageFolderDataset(data_root / "train")
    assert len(train) == before
    assert not any(path.endswith("pipe.png") for path, _ in train.samples)
