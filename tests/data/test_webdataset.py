"""WebDataset both ways: the shards `polaformer data shard` writes, read by the `webdataset` library and by timm's
`wds/` reader; shards `webdataset.ShardWriter` writes (train/ and val/ folders, no info file), trained on by
`polaformer train` and counted by `polaformer data index`."""
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from polaformer.cli import main
from polaformer.data.shards import write_shards
from polaformer.tasks.classification import load_config

wds = pytest.importorskip("webdataset")

CLASSES = 3
TINY = [
    "MODEL.NAME", "pola_deit_tiny_patch16_224", "MODEL.DROP_PATH_RATE", "0.0",
    "MODEL.KWARGS", "{in_chans: 3, embed_dim: 16, depth: 1, num_heads: 1, patch_size: 8}",
    "DATA.IMG_SIZE", "16", "DATA.BATCH_SIZE", "4", "DATA.NUM_WORKERS", "0", "TRAIN.EPOCHS", "1",
    "TRAIN.WARMUP_EPOCHS", "0", "AUG.AUTO_AUGMENT", "none", "AUG.MIXUP", "0", "AUG.CUTMIX", "0", "DEVICE", "cpu",
]


def _jpeg(label: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    pixels[..., label] = 255  # a class cue
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def our_shards(tmp_path_factory):
    """`polaformer data shard` of a folder with 4 training and 2 validation images per class, 3 per shard."""
    root = tmp_path_factory.mktemp("ours")
    for split, count in (("train", 4), ("val", 2)):
        for c in range(CLASSES):
            folder = root / "folder" / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f"img_{i}.jpg").write_bytes(_jpeg(c, 10 * c + i))
    info = write_shards(root / "folder", root / "shards", samples_per_shard=3, name="tiny")
    return root / "shards", info


def test_our_shards_read_by_the_webdataset_library(our_shards):
    shards, info = our_shards
    for split in ("train", "validation"):
        urls = [str(shards / name) for name in info["splits"][split]["filenames"]]
        samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls"))
        assert len(samples) == info["splits"][split]["num_samples"] == {"train": 12, "validation": 6}[split]
        for image, label in samples:
            assert image.size == (16, 16) and 0 <= label < CLASSES
            assert np.asarray(image)[..., label].mean() > 200  # the class cue: each image kept its label
    labels = [label for _, label in samples]  # validation keeps the folder's order
    assert labels == [0, 0, 1, 1, 2, 2]


def test_our_shards_read_by_timms_wds_reader(our_shards):
    from timm.data import create_dataset

    shards, info = our_shards
    dataset = create_dataset("wds/tiny", root=str(shards), split="validation", is_training=False, batch_size=1)
    samples = list(dataset)
    assert len(dataset) == len(samples) == 6
    assert [label for _, label in samples] == [0, 0, 1, 1, 2, 2]
    assert all(np.asarray(image)[..., label].mean() > 200 for image, label in samples)


@pytest.fixture(scope="module")
def shardwriter_shards(tmp_path_factory):
    """train/ (12 samples, 5 per shard) and val/ (6 samples) written by webdataset.ShardWriter."""
    root = tmp_path_factory.mktemp("shardwriter")
    for split, count in (("train", 12), ("val", 6)):
        (root / split).mkdir()
        with wds.ShardWriter(str(root / split / "shard-%06d.tar"), maxcount=5, verbose=0) as sink:
            for i in range(count):
                sink.write({"__key__": f"sample{i:06d}", "jpg": _jpeg(i % CLASSES, i), "cls": i % CLASSES})
    return root


def test_shardwriter_shards_train_without_an_info_file(shardwriter_shards, tmp_path, capsys):
    root = shardwriter_shards
    config = tmp_path / "tiny.yaml"
    config.write_text(load_config(None, TINY).dump())
    output = tmp_path / "out"
    assert main(["train", "--config", str(config), "--data-path", str(root), "--output", str(output)]) == 0
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    last = torch.load(output / "last.pth", weights_only=True)
    # 12 samples in shards of 5, 5, 2, one reader sure of all three: 12 per epoch, batches of 4
    assert [r["epoch"] for r in records] == [1] and last["num_updates"] == 3
    assert last["num_classes"] == CLASSES  # the largest label + 1
    assert not (root / "_info.json").exists()  # counted in memory, the data folder left as it was
    assert main(["eval", "--checkpoint", str(output / "last.pth"), "--data-path", str(root), "--workers", "0"]) == 0
    assert "6 images" in capsys.readouterr().out


def test_data_index_writes_the_counts_once(shardwriter_shards, tmp_path, capsys):
    root = tmp_path / "copy"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        for shard in (shardwriter_shards / split).iterdir():
            (root / split / shard.name).write_bytes(shard.read_bytes())
    assert main(["data", "index", str(root)]) == 0
    assert capsys.readouterr().out.strip() == (f"counted 12 train samples in 3 shards and 6 validation samples in 2 "
                                               f"shards, 3 classes -> {root}/_info.json")
    info = json.loads((root / "_info.json").read_text())
    assert info["splits"]["train"]["filenames"] == [f"train/shard-{i:06d}.tar" for i in range(3)]
    assert info["splits"]["train"]["shard_lengths"] == [5, 5, 2] and info["num_classes"] == 3
    assert info["splits"]["validation"]["shard_lengths"] == [5, 1]
    assert main(["data", "index", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "_info.json already exists: --overwrite counts the shards again" in err
    (root / "val" / "shard-000000.tar").unlink()
    (root / "val" / "shard-000001.tar").unlink()
    assert main(["data", "index", str(root), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no validation shards to count" in err
