"""LRA loaders: every file format users hold, written small into tmp_path and decoded exactly."""
from __future__ import annotations

import builtins
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from polaformer.tasks.lra.data import (
    TASKS,
    LRADataError,
    cifar10_grayscale,
    collate_lra,
    load_lra_split,
)

# ----------------------------------------------------------------------------- helpers


def dump(path, obj, protocol=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


def padded(ids, length, dtype=np.int32):
    out = np.zeros(length, dtype=dtype)
    out[: len(ids)] = ids
    return out


def tokens_of(dataset):
    return [item[0].tolist() for item in dataset]


def labels_of(dataset):
    return [item[1] for item in dataset]


def one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


# ----------------------------------------------------------------------------- task table


def test_task_table_matches_skyformer_config():
    assert {name: (s.vocab_size, s.num_classes, s.max_len, s.dual) for name, s in TASKS.items()} == {
        "listops": (32, 10, 2048, False),
        "text": (512, 2, 4096, False),
        "retrieval": (512, 2, 4096, True),
        "image": (256, 10, 1024, False),
        "pathfinder": (512, 2, 1024, False),
    }
    with pytest.raises(Exception):
        TASKS["text"].vocab_size = 3  # frozen


# ----------------------------------------------------------------------------- (a) Skyformer pickles


def test_listops_pickle_strips_padding(tmp_path):
    records = [
        {"input_ids_0": padded([3, 7, 1, 2], 2048), "label": np.int32(4)},
        {"input_ids_0": padded([5], 2048), "label": np.int32(0)},
    ]
    dump(tmp_path / "lra-listops.dev.pickle", records)
    ds = load_lra_split("listops", tmp_path, "val")  # val is dev
    assert len(ds) == 2
    tokens, label = ds[0]
    assert tokens.dtype == torch.long and tokens.tolist() == [3, 7, 1, 2] and label == 4
    assert isinstance(label, int)
    assert tokens_of(ds) == [[3, 7, 1, 2], [5]] and labels_of(ds) == [4, 0]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_bare_task_name_and_every_pickle_protocol(tmp_path, protocol):
    ids = np.arange(1, 257, dtype=np.int64)
    dump(tmp_path / "text.train.pickle", [{"input_ids_0": padded(ids, 4096, np.int64), "label": np.int64(1)}], protocol)
    ds = load_lra_split("text", tmp_path, "train")
    assert tokens_of(ds) == [list(range(1, 257))] and labels_of(ds) == [1]


def test_retrieval_pickle_gives_pairs_padded_separately(tmp_path):
    records = [
        {"input_ids_0": padded([72, 105], 4096), "input_ids_1": padded([1, 2, 3, 4, 5], 4096), "label": np.int32(1)},
        {"input_ids_0": padded([9, 9, 9], 4096), "input_ids_1": padded([8], 4096), "label": 0},
    ]
    dump(tmp_path / "lra_processed" / "lra-retrieval.test.pickle", records)  # Skyformer's data/lra_processed
    ds = load_lra_split("retrieval", tmp_path, "test")
    (a, b), label = ds[0]
    assert a.tolist() == [72, 105] and b.tolist() == [1, 2, 3, 4, 5] and label == 1
    batch = collate_lra([ds[0], ds[1]])
    assert batch["tokens"].tolist() == [[72, 105, 0], [9, 9, 9]]
    assert batch["padding_mask"].tolist() == [[False, False, True], [False, False, False]]
    assert batch["tokens_b"].tolist() == [[1, 2, 3, 4, 5], [8, 0, 0, 0, 0]]
    assert batch["padding_mask_b"].tolist() == [[False] * 5, [False] + [True] * 4]
    assert batch["label"].tolist() == [1, 0]


def test_image_and_pathfinder_pickles_keep_black_pixels(tmp_path):
    pixels = np.zeros(1024, dtype=np.int32)
    pixels[5], pixels[-1] = 255, 17  # mostly black, and a trailing pixel that is not padding
    dump(tmp_path / "lra-image.train.pickle", [{"input_ids_0": pixels, "label": np.int64(9)}])
    dump(tmp_path / "lra-pathfinder32-curv_contour_length_14.train.pickle", [{"input_ids_0": pixels, "label": 1}])
    dump(tmp_path / "lra-pathfinder32-curv_baseline.train.pickle", [{"input_ids_0": pixels[::-1].copy(), "label": 0}])
    for task, label in (("image", 9), ("pathfinder", 1)):
        ds = load_lra_split(task, tmp_path, "train")
        tokens, got = ds[0]
        assert tokens.tolist() == pixels.tolist() and got == label
        batch = collate_lra([ds[0]])
        assert batch["tokens"].shape == (1, 1024) and not batch["padding_mask"].any()
    easy = load_lra_split("pathfinder", tmp_path, "train", pathfinder_difficulty="curv_baseline")
    assert easy[0][0].tolist() == pixels[::-1].tolist() and easy[0][1] == 0


def test_limit_keeps_the_first_examples(tmp_path):
    records = [{"input_ids_0": padded([i + 1], 2048), "label": i % 10} for i in range(7)]
    dump(tmp_path / "lra-listops.train.pickle", records)
    ds = load_lra_split("listops", tmp_path, "train", limit=3)
    assert tokens_of(ds) == [[1], [2], [3]]


def _exec_payload(marker):
    class Payload:
        def __reduce__(self):
            return builtins.exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    return Payload()


def _system_payload(marker):
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch '{marker}'",)

    return Payload()


@pytest.mark.parametrize("make, refused", [(_exec_payload, "builtins.exec"), (_system_payload, "system")])
def test_pickle_that_runs_code_is_refused(tmp_path, make, refused):
    live_marker, marker = tmp_path / "live_marker", tmp_path / "marker"
    # The payload is real: a plain pickle.load runs it.
    pickle.loads(pickle.dumps(make(live_marker)))
    assert live_marker.exists()
    # Hidden inside an otherwise well-formed file, it is refused before it runs.
    path = dump(
        tmp_path / "data" / "lra-listops.train.pickle",
        [{"input_ids_0": padded([1, 2], 2048), "label": make(marker)}],
    )
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("listops", tmp_path / "data", "train")
    one_line_error(excinfo, path, refused, "refused")
    assert not marker.exists()


@pytest.mark.parametrize(
    "records, fragment",
    [
        ({"input_ids_0": [1]}, "expected a list of examples"),
        ([[1, 2, 3]], "expected a dict"),
        ([{"label": 1}], "has no 'input_ids_0'"),
        ([{"input_ids_0": padded([1], 2048)}], "has no 'label'"),
        ([{"input_ids_0": padded([1], 2048), "label": 10}], "label 10 out of range 0..9"),
        ([{"input_ids_0": padded([1], 2048), "label": 2.5}], "non-integer label"),
        ([{"input_ids_0": padded([1], 2048), "label": "x"}], "non-integer label 'x'"),
        ([{"input_ids_0": np.zeros(2048, np.int32), "label": 1}], "empty sequence"),
        ([{"input_ids_0": padded([1, 0, 2], 2048), "label": 1}], "padding id 0 inside the sequence at position 1"),
        ([{"input_ids_0": padded([1, 32], 2048), "label": 1}], "token id 32 outside the vocabulary 0..31"),
        ([{"input_ids_0": np.ones(2049, np.int32), "label": 1}], "exceeds listops's max_len 2048"),
        ([{"input_ids_0": np.ones((2, 3), np.int32), "label": 1}], "expected a 1-D array"),
        ([{"input_ids_0": np.ones(3, np.float32), "label": 1}], "expected integer token ids"),
        ([], "no examples"),
    ],
)
def test_malformed_pickles(tmp_path, records, fragment):
    path = dump(tmp_path / "lra-listops.test.pickle", records)
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("listops", tmp_path, "test")
    one_line_error(excinfo, path, fragment)


def test_image_pickle_needs_1024_pixels_in_range(tmp_path):
    dump(tmp_path / "lra-image.dev.pickle", [{"input_ids_0": np.ones(1000, np.int32), "label": 1}])
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("image", tmp_path, "dev")
    one_line_error(excinfo, "lra-image.dev.pickle", "expected 1024 pixels, got 1000")
    dump(tmp_path / "lra-pathfinder.test.pickle", [{"input_ids_0": np.full(1024, 300, np.int32), "label": 1}])
    dump(tmp_path / "pathfinder.test.pickle", [{"input_ids_0": np.full(1024, 300, np.int32), "label": 1}])
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("pathfinder", tmp_path, "test")
    one_line_error(excinfo, "pathfinder.test.pickle", "pixel value 300 outside 0..255")


def test_corrupt_pickle_and_missing_split(tmp_path):
    (tmp_path / "lra-text.train.pickle").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("text", tmp_path, "train")
    one_line_error(excinfo, "lra-text.train.pickle", "not a readable pickle")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("text", tmp_path, "test")
    one_line_error(excinfo, "lra-text.test.pickle", "missing file")


# ----------------------------------------------------------------------------- (b) ListOps TSV

LISTOPS_ROWS = [
    ("( ( ( [MAX 2 ) 9 ) ] )", "9"),
    ("( ( ( [MIN 4 ) ( ( ( [SM 7 ) 8 ) ] ) ) ] )", "4"),
    ("( ( ( [MED 1 ) 2 ) ] )", "1"),
    ("( ( ( [SM 9 ) 8 ) ] )", "7"),
    ("5", "5"),
    ("( ( ( ( [MED 3 ) 4 ) 5 ) ] )", "4"),
]


def write_listops(folder, rows=LISTOPS_ROWS, header="Source\tTarget", split="train"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"basic_{split}.tsv"
    lines = [header] + [f"{s}\t{t}" for s, t in rows]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())  # csv.writer's line ends, as LRA writes them
    return path


def test_listops_tsv_tokenisation(tmp_path):
    write_listops(tmp_path / "lra_release" / "listops-1000")
    ds = load_lra_split("listops", tmp_path, "train")
    # 0-9 -> 1..10, [MIN 11, [MAX 12, [MED 13, [SM 14, ] 15; parentheses dropped (LRA's pipeline)
    assert tokens_of(ds) == [
        [12, 3, 10, 15],
        [11, 5, 14, 8, 9, 15, 15],
        [13, 2, 3, 15],
        [14, 10, 9, 15],
        [6],
        [13, 4, 5, 6, 15],
    ]
    assert labels_of(ds) == [9, 4, 1, 7, 5, 4]
    sky = load_lra_split("listops", tmp_path, "train", listops_tokens="skyformer", limit=2)
    assert tokens_of(sky) == [[12, 3, 10], [11, 5, 14, 8, 9]]  # Skyformer's pickles drop "]" too


def test_listops_tsv_columns_by_name_and_truncation(tmp_path):
    long_source = "( ( " + "( [MAX " + " ) ".join(["1"] * 2100) + " ) ] )"
    write_listops(tmp_path, [("x\t" + long_source, "1")], header="Id\tSource\tTarget", split="test")
    (tokens, label), = list(load_lra_split("listops", tmp_path, "test"))
    assert len(tokens) == 2000 and tokens[:3].tolist() == [12, 2, 2] and label == 1


@pytest.mark.parametrize(
    "rows, header, fragment",
    [
        ([("[MAX 1 ]", "1")], "Source\tLabel", "missing column 'Target'"),
        ([("[MAX 1 ]", "one")], "Source\tTarget", "line 2: non-integer label 'one'"),
        ([("[MAX 1 ]", "1"), ("[MAX 1 ]", "12")], "Source\tTarget", "line 3: label 12 out of range 0..9"),
        ([("( )", "1")], "Source\tTarget", "line 2: empty sequence"),
        ([("[MAX 10 ]", "1")], "Source\tTarget", "line 2: unknown ListOps token '10'"),
        ([("[MAX 1 ]\t3", "1")], "Source\tTarget", "line 2: expected 2 tab-separated fields, got 3"),
    ],
)
def test_malformed_listops_tsv(tmp_path, rows, header, fragment):
    path = write_listops(tmp_path, rows, header)
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("listops", tmp_path, "train")
    one_line_error(excinfo, path, fragment)


def test_listops_missing_split_file(tmp_path):
    write_listops(tmp_path)
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("listops", tmp_path, "dev")
    one_line_error(excinfo, "basic_val.tsv", "missing file")


# ----------------------------------------------------------------------------- (c) IMDb


def write_review(root, split, label, name, data: bytes):
    folder = root / "aclImdb" / split / label
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def test_imdb_bytes_and_splits(tmp_path):
    write_review(tmp_path, "train", "neg", "10_2.txt", b"Bad.")
    write_review(tmp_path, "train", "neg", "2_1.txt", b"  Awful<br />\n")  # stripped, HTML kept
    write_review(tmp_path, "train", "pos", "0_9.txt", "Très bien".encode())
    write_review(tmp_path, "test", "pos", "1_10.txt", b"x" * 5000)
    write_review(tmp_path, "test", "neg", "3_4.txt", b"meh")
    (tmp_path / "aclImdb" / "train" / "unsup").mkdir()  # ignored

    train = load_lra_split("text", tmp_path, "train")
    # neg/pos alternate, each class in review-id order; ids are byte + 1
    assert labels_of(train) == [0, 1, 0]
    assert tokens_of(train)[0] == [b + 1 for b in b"Awful<br />"]
    assert tokens_of(train)[1] == [b + 1 for b in "Très bien".encode()]  # UTF-8 bytes: è -> 0xC3 0xA8
    assert tokens_of(train)[1][2:4] == [0xC3 + 1, 0xA8 + 1]
    assert tokens_of(train)[2] == [b + 1 for b in b"Bad."]

    dev, test = load_lra_split("text", tmp_path / "aclImdb", "dev"), load_lra_split("text", tmp_path, "test")
    assert tokens_of(dev) == tokens_of(test)  # LRA evaluates IMDb on its test set
    assert labels_of(test) == [0, 1] and tokens_of(test)[1] == [ord("x") + 1] * 4000  # cut to 4000 bytes
    assert max(max(t) for t in tokens_of(train)) < TASKS["text"].vocab_size


def test_imdb_errors(tmp_path):
    write_review(tmp_path, "train", "neg", "0_1.txt", b"   \n")
    (tmp_path / "aclImdb" / "train" / "pos").mkdir()
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("text", tmp_path, "train")
    one_line_error(excinfo, "0_1.txt", "empty sequence")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("text", tmp_path, "test")
    one_line_error(excinfo, os.path.join("aclImdb", "test", "neg"), "missing folder")


# ----------------------------------------------------------------------------- (d) AAN pairs


def write_aan(folder, split, lines):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"new_aan_pairs.{split}.tsv"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_aan_pairs(tmp_path):
    folder = tmp_path / "tsv_data"
    write_aan(folder, "eval", [
        b'1.0\taan/P01-1001\taan/P02-2002\tWe parse "quotes" as bytes.\tAbc',
        b"0\tid1\tid2\tx\t" + b"y" * 4100,
    ])
    write_aan(folder, "train", [b"1\ta\tb\tq\tr"])
    ds = load_lra_split("retrieval", tmp_path, "dev")  # dev is the .eval file
    (a, b), label = ds[0]
    assert label == 1 and a.tolist() == [c + 1 for c in b'We parse "quotes" as bytes.'] and b.tolist() == [66, 99, 100]
    (a, b), label = ds[1]
    assert label == 0 and a.tolist() == [ord("x") + 1] and b.tolist() == [ord("y") + 1] * 4000
    assert len(load_lra_split("retrieval", folder, "train")) == 1
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("retrieval", tmp_path, "test")
    one_line_error(excinfo, "new_aan_pairs.test.tsv", "missing file")


@pytest.mark.parametrize(
    "line, fragment",
    [
        (b"1\ta\tb\tonly four", "line 1: expected 5 tab-separated fields (label, id1, id2, text1, text2), got 4"),
        (b"yes\ta\tb\tx\ty", "line 1: non-integer label 'yes'"),
        (b"0.5\ta\tb\tx\ty", "non-integer label '0.5'"),
        (b"2.0\ta\tb\tx\ty", "label 2 out of range 0..1"),
        (b"1\ta\tb\t\ty", "line 1 text1: empty sequence"),
    ],
)
def test_malformed_aan(tmp_path, line, fragment):
    path = write_aan(tmp_path, "train", [line])
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("retrieval", tmp_path, "train")
    one_line_error(excinfo, path, fragment)


# ----------------------------------------------------------------------------- (e) CIFAR-10


def write_cifar(root, per_batch=2, seed=0):
    """A cifar-10-batches-py folder in the release's layout: pickled dicts, 'data' (N, 3072) uint8 in
    planar RGB, 'labels' a list. Its MD5s cannot match torchvision's list, so torchvision refuses it."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [(i + j) % 10 for j in range(per_batch)]
        dump(folder / name,
             {"batch_label": name, "labels": labels, "data": data, "filenames": ["a.png"] * per_batch}, 2)
        batches[name] = (data, labels)
    dump(folder / "batches.meta", {"label_names": [str(k) for k in range(10)]}, 2)
    return folder, batches


def test_grayscale_matches_tensorflow_formula():
    # tf.image.rgb_to_grayscale on uint8: trunc(255.5 * (0.2989 r + 0.5870 g + 0.1140 b) / 255)
    rgb = np.array([[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128], [10, 200, 30]])
    image = np.zeros((1, 32, 32, 3), dtype=np.uint8)
    image[0, 0, : len(rgb)] = rgb
    grey = cifar10_grayscale(image)[0, : len(rgb)].tolist()
    assert grey == [0, 255, 76, 149, 29, 128, 124]


def test_cifar10_batches_split_45_5_10(tmp_path):
    folder, batches = write_cifar(tmp_path)
    train_data = np.concatenate([batches[f"data_batch_{k}"][0] for k in range(1, 6)])
    train_labels = [t for k in range(1, 6) for t in batches[f"data_batch_{k}"][1]]
    rgb = train_data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    expected = cifar10_grayscale(rgb)

    train = load_lra_split("image", tmp_path, "train")
    dev = load_lra_split("image", folder, "dev")
    test = load_lra_split("image", tmp_path, "test")
    assert (len(train), len(dev), len(test)) == (9, 1, 2)  # 90% / 10% of the training batches
    assert tokens_of(train) == expected[:9].tolist() and labels_of(train) == train_labels[:9]
    assert tokens_of(dev) == expected[9:].tolist() and labels_of(dev) == train_labels[9:]
    pixel = batches["test_batch"][0][1].reshape(3, 1024)[:, 0]
    grey = np.float32(pixel.astype(np.float32) * np.float32(1 / 255)) @ np.float32([0.2989, 0.587, 0.114])
    want = int(np.float32(grey) * np.float32(255.5))
    assert test[1][0][0].item() == want and test[1][1] == batches["test_batch"][1][1]
    assert len(load_lra_split("image", tmp_path, "train", limit=4)) == 4


def test_cifar10_torchvision_reader_gives_the_same_tokens(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    write_cifar(tmp_path)
    with pytest.raises(RuntimeError):  # torchvision refuses files whose MD5 it does not know
        CIFAR10(str(tmp_path), train=True, download=False)
    ours = tokens_of(load_lra_split("image", tmp_path, "train"))
    # Pretend the checksums matched: torchvision's own decoding must agree with ours.
    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(CIFAR10, "_load_meta", lambda self: None)
    assert tokens_of(load_lra_split("image", tmp_path, "train")) == ours


def test_cifar10_errors(tmp_path):
    folder, _ = write_cifar(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("image", tmp_path, "train")
    one_line_error(excinfo, "data_batch_3", "missing CIFAR-10 batch file")
    dump(folder / "test_batch", {"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]})
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("image", tmp_path, "test")
    one_line_error(excinfo, "test_batch", "shape (N, 3072)")
    dump(folder / "test_batch", {"data": np.zeros((1, 3072), np.uint8), "labels": [10]})
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("image", tmp_path, "test")
    one_line_error(excinfo, "label 10 out of range 0..9")


# ----------------------------------------------------------------------------- (f) Pathfinder PNGs


def write_pathfinder(root, n=10, difficulty="curv_contour_length_14", empty=()):
    base = root / "pathfinder32" / difficulty
    images = {}
    lines = {0: [], 1: []}
    for k in range(n):
        folder = base / "imgs" / str(k % 2)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"sample_{k}.png"
        if k in empty:
            path.write_bytes(b"")
        else:
            pixels = ((np.arange(1024) * (k + 1)) % 256).astype(np.uint8).reshape(32, 32)
            Image.fromarray(pixels, mode="L").save(path)
            images[k] = pixels.reshape(-1).tolist()
        lines[k % 2].append(f"imgs/{k % 2} sample_{k}.png {k} {k % 3 % 2} 1.8 14")
    (base / "metadata").mkdir(parents=True)
    for index, entries in lines.items():
        (base / "metadata" / f"{index}.npy").write_text("\n".join(entries) + "\n")
    return base, images


def test_pathfinder_pngs_split_80_10_10(tmp_path):
    base, images = write_pathfinder(tmp_path, n=20, empty=(7,))
    splits = {s: load_lra_split("pathfinder", tmp_path, s) for s in ("train", "dev", "test")}
    sizes = [len(d) for d in splits.values()]
    assert sum(sizes) == 19 and sizes[1] in (1, 2) and sizes[2] in (1, 2)  # 16/2/2 minus the empty file
    seen = {}
    for ds in splits.values():
        for path, (tokens, label) in zip(ds.paths, ds):
            k = int(path.stem.split("_")[1])
            assert tokens.tolist() == images[k] and label == k % 3 % 2
            seen[k] = True
    assert sorted(seen) == sorted(images)  # disjoint and complete
    again = load_lra_split("pathfinder", base, "train")  # the difficulty folder itself; same fixed shuffle
    assert again.paths == splits["train"].paths
    easy_base, _ = write_pathfinder(tmp_path, n=10, difficulty="curv_baseline")
    easy = load_lra_split("pathfinder", tmp_path / "pathfinder32", "train", pathfinder_difficulty="curv_baseline")
    assert len(easy) == 8 and all(p.is_relative_to(easy_base) for p in easy.paths)
    batch = collate_lra([easy[0], easy[1]])
    assert batch["tokens"].shape == (2, 1024) and not batch["padding_mask"].any()


def test_pathfinder_errors(tmp_path):
    base, _ = write_pathfinder(tmp_path, n=20)
    (base / "metadata" / "1.npy").write_text("imgs/1 sample_1.png 1\n")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("pathfinder", tmp_path, "train")
    one_line_error(excinfo, "1.npy", "line 1: expected at least 4 space-separated fields, got 3")
    (base / "metadata" / "1.npy").write_text("imgs/1 missing.png 1 1\n")
    with pytest.raises(LRADataError) as excinfo:
        for split in ("train", "dev", "test"):
            load_lra_split("pathfinder", tmp_path, split)
    one_line_error(excinfo, "missing.png", "image listed in the metadata is missing")
    (base / "metadata" / "1.npy").write_text("imgs/1 sample_1.png 1 2\n")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split("pathfinder", tmp_path, "train")
    one_line_error(excinfo, "1.npy", "label 2 out of range 0..1")
    (base / "metadata" / "1.npy").write_text("")
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(base / "imgs" / "0" / "sample_0.png")
    (base / "imgs" / "0" / "sample_2.png").write_bytes(b"not a png")
    found = {}
    for split in ("train", "dev", "test"):
        ds = load_lra_split("pathfinder", tmp_path, split)
        found.update({p.name: (ds, i) for i, p in enumerate(ds.paths)})
    ds, i = found["sample_0.png"]
    with pytest.raises(LRADataError) as excinfo:
        ds[i]
    one_line_error(excinfo, "sample_0.png", "expected a 32x32 image, got 16x16")
    ds, i = found["sample_2.png"]
    with pytest.raises(LRADataError) as excinfo:
        ds[i]
    one_line_error(excinfo, "sample_2.png", "not a readable PNG")


# ----------------------------------------------------------------------------- detection and arguments


@pytest.mark.parametrize(
    "task, kwargs, fragment",
    [
        ("mnist", {}, "unknown LRA task 'mnist'; expected one of listops, text, retrieval, image, pathfinder"),
        ("text", {"split": "validation"}, "unknown split 'validation'"),
        ("text", {"limit": 0}, "limit must be a positive number"),
        ("pathfinder", {"pathfinder_difficulty": "hard"}, "unknown Pathfinder difficulty 'hard'"),
        ("listops", {"listops_tokens": "bpe"}, "unknown ListOps tokenisation 'bpe'"),
    ],
)
def test_argument_errors(tmp_path, task, kwargs, fragment):
    kwargs = {"split": "train", **kwargs}
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split(task, tmp_path, **kwargs)
    one_line_error(excinfo, fragment)


@pytest.mark.parametrize(
    "task, looked_for",
    [
        ("listops", ["lra-listops.train.pickle", "basic_{train,val,test}.tsv"]),
        ("text", ["lra-text.train.pickle", "aclImdb/{train,test}/{neg,pos}/*.txt"]),
        ("retrieval", ["lra-retrieval.train.pickle", "new_aan_pairs.{train,eval,test}.tsv"]),
        ("image", ["lra-image.train.pickle", "cifar-10-batches-py"]),
        ("pathfinder", ["lra-pathfinder32-curv_contour_length_14.train.pickle",
                        "pathfinder32/curv_contour_length_14/metadata"]),
    ],
)
def test_no_recognised_files_lists_what_was_looked_for(tmp_path, task, looked_for):
    (tmp_path / "README.txt").write_text("nothing here")
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split(task, tmp_path, "train")
    one_line_error(excinfo, tmp_path, f"no LRA {task} files found", *looked_for)
    with pytest.raises(LRADataError) as excinfo:
        load_lra_split(task, tmp_path / "absent", "train")
    one_line_error(excinfo, "absent", "not a folder")


# ----------------------------------------------------------------------------- collate


def test_collate_pads_with_zero_and_masks_by_length():
    batch = [(torch.tensor([5, 6, 7]), 1), (torch.tensor([0, 9]), 0), (torch.tensor([4]), 1)]
    out = collate_lra(batch)
    assert set(out) == {"tokens", "padding_mask", "label"}
    assert out["tokens"].dtype == torch.long and out["tokens"].tolist() == [[5, 6, 7], [0, 9, 0], [4, 0, 0]]
    assert out["padding_mask"].dtype == torch.bool
    # a real token with id 0 (a black pixel) is not padding: the mask comes from lengths
    assert out["padding_mask"].tolist() == [[False, False, False], [False, False, True], [False, True, True]]
    assert out["label"].dtype == torch.long and out["label"].tolist() == [1, 0, 1]
    with pytest.raises(ValueError):
        collate_lra([])


def test_dataloader_end_to_end(tmp_path):
    write_listops(tmp_path)
    ds = load_lra_split("listops", tmp_path, "train")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate_lra)
    first = next(iter(loader))
    assert first["tokens"].shape == (4, 7) and first["padding_mask"].sum().item() == 4 * 7 - (4 + 7 + 4 + 4)
