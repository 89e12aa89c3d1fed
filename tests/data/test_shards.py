"""Tar shards (WebDataset layout): written from a tiny image folder, read back as the folder's samples, split
over processes and loader workers, trained on through the real command, and refused in one line when broken."""
import hashlib
import io
import json
import os
import re
import socket
import tarfile

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image
from torch.utils.data import DataLoader

from polaformer.cli import main
from polaformer.data.folder import ImageFolderDataset
from polaformer.data.shards import ShardError, ShardStream, read_info, read_split, write_shards
from polaformer.tasks.classification import build_trainer, load_config

CLASSES = 3
TINY = [
    "MODEL.NAME", "pola_deit_tiny_patch16_224", "MODEL.DROP_PATH_RATE", "0.0",
    "MODEL.KWARGS", "{in_chans: 3, embed_dim: 16, depth: 1, num_heads: 1, patch_size: 8}",
    "DATA.IMG_SIZE", "16", "DATA.BATCH_SIZE", "4", "DATA.NUM_WORKERS", "0", "TRAIN.EPOCHS", "2",
    "TRAIN.WARMUP_EPOCHS", "1", "AUG.AUTO_AUGMENT", "none", "AUG.MIXUP", "0", "AUG.CUTMIX", "0", "DEVICE", "cpu",
]


def make_folder(root, train_per_class=4, val_per_class=2, size=16):
    """DIR/{train,val}/<class>/ with PNG, JPEG and .jpeg images; one corrupt training file."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(CLASSES):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                pixels[..., c] = 255  # a class cue
                Image.fromarray(pixels).save(folder / f"img_{i}.{('png', 'jpg', 'jpeg')[i % 3]}")
    (root / "train" / "class_1" / "broken.png").write_bytes(b"\x89PNG not really")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    folder = make_folder(root / "folder")
    assert main(["data", "shard", str(folder), str(root / "shards"), "--samples-per-shard", "3", "--name", "tiny"]) == 0
    return folder, root / "shards"


def stream(shards, split="train", shuffle=True, classes=CLASSES):
    info, path = read_info(shards)
    return ShardStream(read_split(info, path, (split,)), shuffle=shuffle, num_classes=classes)


def digest(sample):
    return None if sample is None else (hashlib.sha256(np.asarray(sample[0]).tobytes()).hexdigest(), sample[1])


def folder_digests(folder):
    dataset = ImageFolderDataset(folder)
    return [digest(dataset[i]) for i in range(len(dataset))]


def test_shards_hold_the_folder_samples_and_labels(data):
    folder, shards = data
    info = json.loads((shards / "_info.json").read_text())
    assert info["classes"] == ["class_0", "class_1", "class_2"]
    train = info["splits"]["train"]
    assert train["num_samples"] == 13 and train["shard_lengths"] == [3, 3, 3, 3, 1]
    assert train["filenames"][0] == "tiny-train-000000.tar" and info["splits"]["validation"]["shard_lengths"] == [3, 3]
    with tarfile.open(shards / train["filenames"][0]) as tar:
        names = tar.getnames()
    assert len(names) == 6 and {n.split(".", 1)[1] for n in names} <= {"png", "jpg", "cls"}  # .jpeg is named .jpg
    # Validation: streamed in the folder's order. Training: the same samples, shuffled, the corrupt one skipped.
    assert [digest(s) for s in stream(shards, "validation", shuffle=False)] == folder_digests(folder / "val")
    read = [digest(s) for s in stream(shards)]
    expected = folder_digests(folder / "train")
    assert read != expected and sorted(read, key=str) == sorted(expected, key=str) and read.count(None) == 1
    # The same folder gives the same shards, byte for byte.
    again = shards.parent / "again"
    write_shards(folder, again, samples_per_shard=3, name="tiny")
    assert all((again / n).read_bytes() == (shards / n).read_bytes() for n in [*train["filenames"], "_info.json"])


def test_epochs_are_deterministic_and_differ(data):
    _, shards = data
    first = stream(shards)
    one = [digest(s) for s in first]
    assert [digest(s) for s in stream(shards)] == one
    first.set_epoch(1)
    assert [digest(s) for s in first] != one


def collect(shards, rank, world, workers, batch):
    dataset = stream(shards)
    dataset.set_layout(rank, world, num_workers=workers, batch_size=batch, seed=5)
    dataset.set_epoch(2)
    loader = DataLoader(dataset, batch_size=batch, drop_last=True, num_workers=workers,
                        collate_fn=lambda samples: [digest(s) for s in samples])
    batches = list(loader)
    assert len(batches) == len(loader) == len(dataset) // batch  # what the engine counts on
    return dataset, batches


def test_ranks_and_workers_read_disjoint_shards_covering_the_set(data):
    folder, shards = data
    expected = sorted(folder_digests(folder / "train"), key=str)
    # 13 samples in shards of 3, 3, 3, 3, 1. Two processes: each is sure of two shards, the smallest being 1 + 3.
    ranks = [sum(collect(shards, rank, 2, 0, 1)[1], []) for rank in (0, 1)]
    assert [len(r) for r in ranks] == [4, 4]
    assert not set(map(str, ranks[0])) & set(map(str, ranks[1]))
    # Two processes x two workers: four readers, each sure of one shard, the smallest holding 1 sample.
    per_rank = [collect(shards, rank, 2, 2, 1) for rank in (0, 1)]
    seen = [s for _, batches in per_rank for batch in batches for s in batch]
    assert [len(d) for d, _ in per_rank] == [2, 2] and len(seen) == 4 and len(set(map(str, seen))) == 4
    # Evaluation: each process reads its shards in order, together every sample once.
    evaluated = []
    for rank in (0, 1):
        dataset = stream(shards, "validation", shuffle=False)
        dataset.set_layout(rank, 2)
        evaluated += [digest(s) for s in dataset]
    assert sorted(evaluated, key=str) == sorted(folder_digests(folder / "val"), key=str)
    # One process, one batch of 13: every sample once (None for the corrupt one). More readers than shards: refused.
    alone = sum(collect(shards, 0, 1, 0, 13)[1], [])
    assert sorted(alone, key=str) == expected
    with pytest.raises(ShardError, match=r"^5 training shards cannot be shared by 3 processes x 2 loader workers: "
                                         r"each of the 6 readers needs shards of its own; write at least 6 shards"):
        collect(shards, 0, 3, 2, 1)


@pytest.mark.parametrize("workers", [0, 2])
def test_starting_mid_epoch_continues_with_the_batches_that_followed(data, workers):
    _, shards = data
    _, whole = collect(shards, 0, 1, workers, 2)
    for done in (1, 3):
        dataset = stream(shards)
        dataset.set_layout(0, 1, num_workers=workers, batch_size=2, seed=5)
        dataset.set_epoch(2)
        dataset.set_start(done * 2)
        loader = DataLoader(dataset, batch_size=2, drop_last=True, num_workers=workers,
                            collate_fn=lambda samples: [digest(s) for s in samples])
        assert list(loader) == whole[done:]


def shard_config(tmp_path, shards, *opts):
    return load_config(None, [*TINY, "DATA.DATA_PATH", str(shards), "OUTPUT", str(tmp_path), *opts])


def test_train_on_shards_and_evaluate_the_folder(data, tmp_path, capsys):
    """`polaformer train --data-path SHARDS`: its evaluation on the validation shards is `polaformer eval` on the
    folder they were written from."""
    folder, shards = data
    config = tmp_path / "tiny.yaml"
    config.write_text(load_config(None, TINY).dump())
    output = tmp_path / "out"
    assert main(["train", "--config", str(config), "--data-path", str(shards), "--output", str(output)]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    last = torch.load(output / "last.pth", weights_only=True)
    # 13 samples, one reader: 12 per epoch in batches of 4; the corrupt image counted where it came up.
    assert [r["epoch"] for r in records] == [1, 2] and last["num_updates"] == 6
    assert last["class_names"] == ["class_0", "class_1", "class_2"]
    assert sum(r["skipped_images"] for r in records) <= 2
    assert main(["eval", "--checkpoint", str(output / "last.pth"), "--data-path", str(folder), "--workers", "0"]) == 0
    line = capsys.readouterr().out
    top1, loss = re.search(r"val top-1: ([\d.]+)%.*loss: ([\d.]+);", line).groups()
    assert float(top1) == round(records[-1]["test_top1"], 3) and float(loss) == round(records[-1]["test_loss"], 4)
    assert "6 images" in line
    # `eval` on the shards themselves: the same images, the same numbers.
    assert main(["eval", "--checkpoint", str(output / "last.pth"), "--data-path", str(shards), "--workers", "2"]) == 0
    assert capsys.readouterr().out.split(" <- ")[0] == line.split(" <- ")[0]


def _process(rank, port, opts):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    trainer = build_trainer(load_config(None, opts))
    trainer.fit()
    trainer.close()


def test_two_processes_train_on_their_own_shards(data, tmp_path, capsys):
    _, shards = data
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    output = tmp_path / "ddp"
    opts = [*TINY, "DATA.DATA_PATH", str(shards), "OUTPUT", str(output), "TRAIN.EPOCHS", "1", "DATA.BATCH_SIZE", "2"]
    mp.start_processes(_process, args=(port, opts), nprocs=2, join=True, start_method="fork")  # no imports again
    last = torch.load(output / "last.pth", weights_only=True)
    # Shards of 3, 3, 3, 3, 1 over two processes: each is sure of 1 + 3 samples, two batches of 2.
    assert (last["world_size"], last["num_updates"]) == (2, 2)
    # The validation shards were split over the processes and the sums gathered: one process reading them all
    # gets the numbers of the run.
    record = json.loads((output / "metrics.jsonl").read_text().splitlines()[-1])
    assert main(["eval", "--checkpoint", str(output / "last.pth"), "--data-path", str(shards), "--workers", "0"]) == 0
    top1, loss = re.search(r"val top-1: ([\d.]+)%.*loss: ([\d.]+); 6 images", capsys.readouterr().out).groups()
    assert float(top1) == round(record["test_top1"], 3) and float(loss) == round(record["test_loss"], 4)


def test_resumed_mid_epoch_ends_as_uninterrupted(data, tmp_path):
    _, shards = data
    whole = build_trainer(shard_config(tmp_path / "whole", shards))
    whole.fit()
    whole.close()

    class Stop(KeyboardInterrupt):
        pass

    def stop(updates):
        if updates == 4:  # mid-way into the second epoch, after its checkpoint
            raise Stop

    cut = build_trainer(shard_config(tmp_path / "cut", shards, "TRAIN.SAVE_FREQ_STEPS", "1"))
    cut.settings.on_update = stop
    with pytest.raises(Stop):
        cut.fit()
    cut.close()
    state = torch.load(tmp_path / "cut" / "last.pth", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 1)
    resumed = build_trainer(shard_config(tmp_path / "cut", shards, "TRAIN.SAVE_FREQ_STEPS", "1", "MODEL.RESUME",
                                         str(tmp_path / "cut" / "last.pth")))
    resumed.fit()
    resumed.close()
    a = torch.load(tmp_path / "whole" / "last.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "last.pth", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_data_shard_refuses_to_replace_shards_and_a_missing_folder(data, tmp_path, capsys):
    folder, shards = data
    assert main(["data", "shard", str(folder), str(shards)]) == 2
    assert capsys.readouterr().err.strip() == (f"polaformer data: error: {shards}/_info.json already exists: "
                                               "--overwrite replaces the shards, or choose another OUT")
    assert main(["data", "shard", str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"polaformer data: error: data folder not found: {tmp_path}/none/train"
    assert not (tmp_path / "out").exists()


def write_tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for name, payload in samples:
            member = tarfile.TarInfo(name)
            member.size = len(payload)
            tar.addfile(member, io.BytesIO(payload))


def broken_shards(root, data, change):
    """A copy of the shards with ``change(info, root)`` applied."""
    import shutil

    copy = root / "broken"
    shutil.copytree(data[1], copy)
    info = json.loads((copy / "_info.json").read_text())
    change(info, copy)
    if (copy / "_info.json").exists():
        (copy / "_info.json").write_text(json.dumps(info))
    return copy


def png():
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    return buffer.getvalue()


def replace_first(samples):
    def change(info, root):
        write_tar(root / info["splits"]["train"]["filenames"][0], samples)
        info["splits"]["train"]["shard_lengths"][0] = 1
        info["splits"]["train"]["num_samples"] = 11
    return change


@pytest.mark.parametrize("change, message", [
    (lambda info, root: (root / "_info.json").unlink(),
     r"no shard info file in .*broken: expected _info.json or info.json"),
    (lambda info, root: (root / "tiny-train-000003.tar").unlink(),
     r"shard .*broken/tiny-train-000003.tar is listed in .*_info.json but missing$"),
    (replace_first([("a.png", png())]), r"tiny-train-000000.tar: sample 'a' has no label \(a .cls member\)$"),
    (replace_first([("a.cls", b"1"), ("a.txt", b"x")]),
     r"tiny-train-000000.tar: sample 'a' has no image \(members: cls, txt; expected one of .jpg, .jpeg, .png"),
    (replace_first([("a.png", png()), ("a.cls", b"3")]),
     r"sample 'a' has label '3', not a class index 0..2 \(3 classes: the info file's classes\)$"),
    (lambda info, root: info["splits"]["train"]["shard_lengths"].__setitem__(0, 2) or info["splits"]["train"].pop(
        "num_samples"), r"tiny-train-000000.tar holds 3 samples, .*_info.json says 2$"),
])
def test_broken_shards_are_refused_in_one_line(data, tmp_path, capsys, change, message):
    shards = broken_shards(tmp_path, data, change)
    code = main(["train", "--data-path", str(shards), "--config", str(_config(tmp_path)), "--output",
                 str(tmp_path / "out"), "--opts", "DATA.DATASET", "wds/tiny"])
    lines = capsys.readouterr().err.strip().splitlines()  # log lines before an error found in training
    assert code == 2 and lines[-1].startswith("polaformer: error: "), lines
    assert re.search(message, lines[-1]), lines[-1]


def _config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(load_config(None, TINY).dump())
    return path


def test_an_error_found_in_a_loader_worker_is_one_line(data, tmp_path, capsys):
    shards = broken_shards(tmp_path, data, lambda info, root: write_tar(
        root / info["splits"]["train"]["filenames"][1], [("z.png", png()), ("z.cls", b"7")]))
    code = main(["train", "--data-path", str(shards), "--config", str(_config(tmp_path)), "--output",
                 str(tmp_path / "out"), "--opts", "DATA.NUM_WORKERS", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and re.fullmatch(r"polaformer: error: \S*tiny-train-000001.tar: sample 'z' has label '7', not a "
                                      r"class index 0..2 \(3 classes: the info file's classes\)", err), err
