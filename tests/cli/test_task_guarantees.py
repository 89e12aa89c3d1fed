"""The guarantees of ``train`` hold for ``lra``, ``detect`` and ``segment`` too (issue 27): no finished or
busy output folder is written into, no data set or drawing replaced, NaN/inf or integer weights refused on
every loading path, and bad values end in one line with exit status 2 (in-process ``polaformer.cli.main``)."""
import errno
import io
import json
import os
import shutil
import struct
import zlib

import pytest
import torch
from PIL import Image

import polaformer.files
from cli_helpers import assert_unchanged, error_line, quiet, run_main, snapshot, within
from dense_helpers import write_ade, write_coco
from polaformer.checkpoint import with_checksum
from polaformer.cli import main
from polaformer.engine.output import OutputLock
from polaformer.tasks.lra.listops import generate_listops

TINY = ["--model", "vit_tiny_patch16_224", "--model-kwarg", "patch_size=2", "--model-kwarg", "embed_dim=16",
        "--model-kwarg", "depth=1", "--model-kwarg", "num_heads=1"]

LRA_MODEL = ["--opts", "model.dim", "8", "model.hidden_dim", "8", "model.num_heads", "1", "model.head_dim", "8",
             "model.num_layers", "1"]
DET_BACKBONE = ["--backbone", "pola_deit_tiny_patch16_224", "--backbone-kwarg", "depth=1", "--backbone-kwarg",
                "embed_dim=16", "--backbone-kwarg", "num_heads=1"]
DENSE_QUICK = ["--steps", "1", "--batch-size", "1", "--no-progress", "--device", "cpu", "--train-size", "1",
               "--val-size", "1"]
SEG_BACKBONE = ["--backbone", "pola_pvt_tiny", "--backbone-kwarg", "depths=[1, 1, 1, 1]", "--backbone-kwarg",
                "embed_dims=[16, 32, 64, 64]", "--backbone-kwarg", "num_heads=[1, 2, 2, 2]", "--backbone-kwarg",
                "mlp_ratios=[2, 2, 2, 2]"]


def lra_train(root, *extra):
    return ["lra", "train", "--task", "listops", "--data", root / "listops", *LRA_MODEL, "--batch-size", "8",
            "--eval-every", "2", "--steps", "2", "--device", "cpu", *extra]


def detect_train(*extra):
    return ["detect", "train", "--detector", "fcos", *DET_BACKBONE, *DENSE_QUICK, *extra]


def segment_train(*extra):
    return ["segment", "train", "--decoder", "fpn", *SEG_BACKBONE, *DENSE_QUICK, *extra]


def with_nan(source, target, key=None):
    """A copy of ``source`` with NaN weights, as a diverged run saves it (with its checksum)."""
    checkpoint = torch.load(source, weights_only=True)
    key = key or next(k for k, v in checkpoint["model"].items() if v.is_floating_point())
    checkpoint["model"][key] = torch.full_like(checkpoint["model"][key], float("nan"))
    torch.save(with_checksum(checkpoint), target)
    return key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished one- or two-step runs of lra, detect and segment, and their checkpoints with NaN weights."""
    root = tmp_path_factory.mktemp("tasks")
    generate_listops(root / "listops", train=16, val=8, test=8, min_length=10, max_length=30, max_depth=3, seed=0,
                     progress=False)
    for argv in (lra_train(root, "--output", root / "lra"), detect_train("--output", root / "detect"),
                 segment_train("--output", root / "segment")):
        with quiet():
            assert main([str(a) for a in argv]) == 0, argv
    for task in ("lra", "detect", "segment"):
        with_nan(root / task / "last.pth", root / f"nan_{task}.pth")
    Image.new("RGB", (40, 32), (90, 30, 200)).save(root / "x.png")
    (root / "drawn").mkdir()
    Image.new("RGB", (4, 4)).save(root / "drawn" / "x.png")
    for folder in ("a", "b"):
        (root / folder).mkdir()
        Image.new("RGB", (40, 32), (10, 10, 10)).save(root / folder / "x.png")

    with quiet():
        assert main(["train", *TINY, "--epochs", "1", "--batch-size", "256", "--output", str(root / "digits")]) == 0
    good = torch.load(root / "digits" / "checkpoint.pth", weights_only=True)
    head = good["model"]["head.weight"]
    torch.save(with_checksum({**good, "model": {**good["model"], "head.weight": torch.full_like(head, float("inf"))}}),
               root / "inf_head.pth")
    bias = good["model"]["head.bias"]
    torch.save(with_checksum({**good, "model": {**good["model"],
                                                "head.bias": torch.zeros_like(bias, dtype=torch.int64)}}),
               root / "int64_head.pth")
    torch.save({**good, "epoch": -5}, root / "minus5.pth")
    configs = root / "configs"
    configs.mkdir()
    (configs / "nested.yaml").write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    (configs / "huge_int.yaml").write_text("train:\n  seed: " + "9" * 100_000 + "\n")
    write_ade(root / "ade")
    images, annotations = write_coco(root / "coco")
    original = json.loads(annotations.read_text())
    for name, edit in COCO_EDITS.items():
        data = json.loads(json.dumps(original))
        edit(data)
        (root / "coco" / f"{name}.json").write_text(json.dumps(data))
    return root


def _set(path, value):
    def edit(data):
        *parents, last = path
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


COCO_EDITS = {
    "bbox_1e30": _set(["annotations", 0, "bbox"], [1e30, 2, 5, 5]),
    "bbox_outside": _set(["annotations", 0, "bbox"], [500, 500, 5, 5]),
    "rle_huge": _set(["annotations", 0, "segmentation"], {"size": [1000000, 1000000], "counts": "abc"}),
    "rle_garbage": _set(["annotations", 0, "segmentation"], {"size": [48, 64], "counts": "garbage!"}),
    "rle_short": _set(["annotations", 0, "segmentation"], {"size": [48, 64], "counts": [5, 10]}),
    "no_annotations": _set(["annotations"], []),
    "duplicate_id": _set(["images", 1, "id"], 10),
    "traversal": _set(["images", 0, "file_name"], "../../../../etc/passwd"),
    "segmentation_empty": _set(["annotations", 0, "segmentation"], []),
    "all_crowd": lambda data: [ann.update(iscrowd=1) for ann in data["annotations"]],
}


def coco_train(root, name):
    ann = root / "coco" / f"{name}.json"
    return detect_train("--train-images", root / "coco" / "images", "--train-annotations", ann, "--val-images",
                        root / "coco" / "images", "--val-annotations", ann, "--output", root / "new")


CASES = [
    # finished and busy output folders
    ("lra train into a finished folder", lambda r: lra_train(r, "--output", r / "lra"),
     "already holds a run (last.pth"),
    ("detect train into a finished folder", lambda r: detect_train("--output", r / "detect"),
     "already holds a run (last.pth"),
    ("segment train into a finished folder", lambda r: segment_train("--output", r / "segment"),
     "already holds a run (last.pth"),
    ("lra generate into a data set", lambda r: ["lra", "generate", "listops", "--out", r / "listops", "--train", "4",
                                                "--val", "2", "--test", "2", "--min-length", "10",
                                                "--max-length", "20"],
     "already holds a data set (basic_train.tsv"),
    # weights that would load silently wrong
    ("lra eval, NaN weights", lambda r: ["lra", "eval", "--checkpoint", r / "nan_lra.pth", "--data", r / "listops"],
     "holds NaN or infinite values"),
    ("lra train --resume, NaN weights", lambda r: lra_train(r, "--output", r / "new", "--steps", "4", "--resume",
                                                           r / "nan_lra.pth"), "holds NaN or infinite values"),
    ("detect eval, NaN weights", lambda r: ["detect", "eval", "--checkpoint", r / "nan_detect.pth", "--val-size", "1",
                                            "--device", "cpu"], "holds NaN or infinite values"),
    ("detect predict, NaN weights", lambda r: ["detect", "predict", "--checkpoint", r / "nan_detect.pth", r / "x.png",
                                               "--out", r / "new", "--device", "cpu"], "holds NaN or infinite values"),
    ("segment eval, NaN weights", lambda r: ["segment", "eval", "--checkpoint", r / "nan_segment.pth", "--val-size",
                                             "1", "--device", "cpu"], "holds NaN or infinite values"),
    ("detect train --resume, NaN weights", lambda r: detect_train("--output", r / "new", "--steps", "2", "--resume",
                                                                  r / "nan_detect.pth"),
     "holds NaN or infinite values"),
    ("train --finetune, inf weights", lambda r: ["train", *TINY, "--epochs", "1", "--finetune", r / "inf_head.pth",
                                                 "--output", r / "new"],
     "weight 'head.weight' holds NaN or infinite values"),
    ("train --finetune, int64 head.bias", lambda r: ["train", *TINY, "--epochs", "1", "--finetune",
                                                     r / "int64_head.pth", "--output", r / "new"],
     "weight 'head.bias' is int64, the model's is float32; refusing to cast it"),
    # values
    ("detect train --lr inf", lambda r: detect_train("--output", r / "new", "--lr", "inf"),
     "train.lr must be a finite number > 0, got inf"),
    ("train, config nested 100k deep", lambda r: ["train", "--config", r / "configs" / "nested.yaml", "--output",
                                                  r / "new"], "nested deeper than 64 levels"),
    ("lra train, config nested 100k deep", lambda r: lra_train(r, "--config", r / "configs" / "nested.yaml"),
     "nested deeper than 64 levels"),
    ("detect train, config nested 100k deep", lambda r: detect_train("--config", r / "configs" / "nested.yaml"),
     "nested deeper than 64 levels"),
    ("train, a 100k-digit integer", lambda r: ["train", "--config", r / "configs" / "huge_int.yaml", "--output",
                                               r / "new"], "an integer of 100000 digits (at most 100)"),
    ("segment train, a 100k-digit integer", lambda r: segment_train("--config", r / "configs" / "huge_int.yaml"),
     "an integer of 100000 digits (at most 100)"),
    ("segment train --crop-size 100000", lambda r: segment_train("--root", r / "ade", "--crop-size", "100000",
                                                                 "--output", r / "new"),
     "a batch of data.crop_size 100000 crops (1 x 3 x 100000 x 100000) needs"),
    ("train --seed 1e20", lambda r: ["train", *TINY, "--epochs", "1", "--seed", "99999999999999999999", "--output",
                                     r / "new"],
     "SEED must be an integer in [-2**63, 2**63), got 99999999999999999999"),
    ("COCO bbox 1e30", lambda r: coco_train(r, "bbox_1e30"), "bbox [1e+30, 2, 5, 5] lies outside its 48x64 image"),
    ("COCO bbox outside the image", lambda r: coco_train(r, "bbox_outside"), "lies outside its 48x64 image"),
    ("COCO RLE of 1e6 x 1e6", lambda r: coco_train(r, "rle_huge"), "RLE size must be [height, width] of at most"),
    ("COCO RLE garbage counts", lambda r: coco_train(r, "rle_garbage"), "RLE counts do not cover its 48x64 pixels"),
    ("COCO RLE short counts", lambda r: coco_train(r, "rle_short"), "RLE counts do not cover its 48x64 pixels"),
    ("COCO zero annotations", lambda r: coco_train(r, "no_annotations"), "no annotations, so nothing to train on"),
    ("COCO duplicate image id", lambda r: coco_train(r, "duplicate_id"), "has the id 10 of an earlier image"),
    ("COCO file_name leaving the folder", lambda r: coco_train(r, "traversal"),
     "file_name '../../../../etc/passwd' leaves the image folder"),
    ("COCO \"segmentation\": []", lambda r: coco_train(r, "segmentation_empty"),
     "segmentation is an empty list; give polygons or an RLE, or leave the key out"),
    ("detect predict over an existing drawing", lambda r: ["detect", "predict", "--checkpoint",
                                                           r / "detect" / "last.pth", r / "x.png", "--out", r / "drawn",
                                                           "--device", "cpu"],
     "drawn/x.png already exists: --overwrite replaces it, or choose another --out"),
    ("lra train --resume, another learning rate", lambda r: lra_train(r, "--output", r / "new", "--steps", "4",
                                                                      "--resume", r / "lra" / "last.pth", "--lr",
                                                                      "0.5"),
     "was trained with train.lr = 0.0001, this run asks for 0.5: --allow-changed train.lr continues the run"),
    ("lra train --resume, another batch size", lambda r: lra_train(r, "--output", r / "new", "--steps", "4",
                                                                   "--resume", r / "lra" / "last.pth",
                                                                   "--batch-size", "4"),
     "was trained with train.batch_size = 8, this run asks for 4: --allow-changed train.batch_size continues"),
    ("detect train --resume, another learning rate", lambda r: detect_train("--output", r / "new", "--steps", "2",
                                                                            "--resume", r / "detect" / "last.pth",
                                                                            "--lr", "0.5"),
     "this run asks for 0.5: --allow-changed train.lr continues the run with the new value"),
    ("lra train model.num_layers 0", lambda r: lra_train(r, "--output", r / "new", "--opts", "model.num_layers", "0"),
     "model.num_layers must be a positive integer, got 0"),
    ("lra train --attention-option alpha=-3", lambda r: lra_train(r, "--output", r / "new", "--attention", "pola",
                                                                  "--attention-option", "alpha=-3"),
     "alpha must be a finite number >= 0, got -3"),
    ("lra train --workers -1", lambda r: lra_train(r, "--output", r / "new", "--workers", "-1"),
     "train.num_workers must be an integer >= 0, got -1"),
    # issue 51: the last raw tracebacks and silent acceptances of detect and segment
    ("segment train --num-classes 1e9", lambda r: segment_train("--root", r / "ade", "--num-classes", "1000000000",
                                                                "--output", r / "new"),
     "the 1000000000 x 1000000000 confusion matrix of data.num_classes 1000000000 needs 7.45e+09 GiB, more than the"),
    ("segment train --num-classes without --root", lambda r: segment_train("--num-classes", "1000000000", "--output",
                                                                          r / "new"),
     "polaformer segment train: error: --num-classes needs --root DIR (it applies to ADE20K-layout folders)"),
    ("segment train --decoder lightham, DeiT with a pyramid's kwargs",
     lambda r: [*segment_train("--output", r / "new"), "--decoder", "lightham", "--backbone",
                "pola_deit_tiny_patch16_224"],
     "cannot build model 'pola_deit_tiny_patch16_224' with {'depths': [1, 1, 1, 1], 'embed_dims': [16, 32, 64, 64], "
     "'num_heads': [1, 2, 2, 2], 'mlp_ratios': [2, 2, 2, 2]}: PolaDeiT.__init__() got an unexpected keyword argument "
     "'depths'"),
    ("detect train --backbone-kwarg depth=0", lambda r: detect_train("--backbone-kwarg", "depth=0", "--output",
                                                                     r / "new"),
     "model 'pola_deit_tiny_patch16_224': depth must be positive, got 0"),
    ("COCO, every annotation a crowd", lambda r: coco_train(r, "all_crowd"),
     "all_crowd.json: all 6 annotations are crowd regions (iscrowd=1), which are neither trained on nor scored: "
     "nothing to train on or to score"),
    ("detect predict --score-threshold nan", lambda r: ["detect", "predict", "--checkpoint", r / "detect" / "last.pth",
                                                        r / "x.png", "--out", r / "new", "--score-threshold", "nan"],
     "the score threshold must be a number in [0, 1], got nan"),
]


# Cases that fail after an info line was logged.
AFTER_LOGS = {"train --finetune, inf weights", "train --finetune, int64 head.bias",
              "lra train --resume, another learning rate", "lra train --resume, another batch size",
              "detect train --resume, another learning rate"}


@pytest.mark.parametrize("name, argv, fragment", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_with_status_2(runs, name, argv, fragment, capsys):
    before = snapshot(runs)
    code, out, err = run_main(argv(runs), capsys)
    assert (code, out) == (2, ""), err
    assert fragment in error_line(err, logs_allowed=name in AFTER_LOGS)
    assert_unchanged(before, runs)


@pytest.mark.parametrize("task", ["lra", "detect", "segment"])
def test_a_busy_folder_is_refused_naming_the_holder(runs, task, capsys, tmp_path):
    import os

    argv = {"lra": lambda: lra_train(runs, "--output", tmp_path), "detect": lambda: detect_train("--output", tmp_path),
            "segment": lambda: segment_train("--output", tmp_path)}[task]()
    lock = OutputLock(tmp_path)
    try:
        code, _, err = run_main(argv, capsys)
    finally:
        lock.release()
    assert code == 2
    assert f"is in use by process {os.getpid()}" in error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_lra_generate_replaces_a_data_set_only_when_asked(runs, tmp_path, capsys):
    argv = ["lra", "generate", "listops", "--out", tmp_path, "--train", "4", "--val", "2", "--test", "2",
            "--min-length", "10", "--max-length", "20"]
    assert run_main(argv, capsys)[0] == 0
    first = snapshot(tmp_path)
    assert run_main([*argv, "--seed", "1"], capsys)[0] == 2
    assert_unchanged(first, tmp_path)
    assert run_main([*argv, "--seed", "1", "--overwrite"], capsys)[0] == 0
    assert snapshot(tmp_path)["basic_train.tsv"] != first["basic_train.tsv"]


def test_detect_predict_gives_same_named_images_distinct_outputs(runs, tmp_path, capsys):
    code, out, err = run_main(["detect", "predict", "--checkpoint", runs / "detect" / "last.pth", runs / "a" / "x.png",
                               runs / "b" / "x.png", runs / "x.png", "--out", tmp_path, "--device", "cpu"], capsys)
    assert code == 0, err
    assert out.split() == [str(tmp_path / name) for name in ("x.png", "x-2.png", "x-3.png")]
    assert len({Image.open(tmp_path / name).getpixel((0, 0)) for name in ("x.png", "x-2.png", "x-3.png")}) == 2


def test_detect_predict_refuses_a_fifo(runs, tmp_path, capsys):
    """An image that is a FIFO blocked the command forever; now one line, and no drawing."""
    fifo = tmp_path / "x.png"
    os.mkfifo(fifo)
    code, _, err = within(60, fifo, lambda: run_main(["detect", "predict", "--checkpoint", runs / "detect" / "last.pth",
                                                       fifo, "--out", tmp_path / "out", "--device", "cpu"], capsys))
    assert code == 2
    assert f"{fifo}: a FIFO (named pipe), not a regular file" in error_line(err)
    assert not (tmp_path / "out").exists()  # no drawing, not even the empty folder for one


def test_detect_predict_refuses_a_decompression_bomb(runs, tmp_path, capsys):
    """A 40000x40000 PNG (only its header is real) is one line, not PIL's DecompressionBombError."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    code, _, err = run_main(["detect", "predict", "--checkpoint", runs / "detect" / "last.pth", bomb, "--out",
                             tmp_path / "out", "--device", "cpu"], capsys)
    assert code == 2
    assert "bomb.png: cannot read the image (Image size (1600000000 pixels) exceeds limit" in error_line(err)


def test_resume_refuses_a_negative_epoch(runs, capsys):
    before = snapshot(runs)
    code, _, err = run_main(["train", *TINY, "--epochs", "3", "--batch-size", "256", "--output", runs / "new",
                             "--resume", runs / "minus5.pth"], capsys)
    assert code == 2
    assert "training state cannot be restored: ValueError: epoch -5 is negative" in error_line(err)
    assert_unchanged(before, runs)


@pytest.mark.parametrize("task", ["lra", "detect", "segment"])
def test_full_disk_and_a_killed_runs_temporary(runs, task, capsys, tmp_path, monkeypatch):
    """Continuing a finished run whose folder holds a temporary left by kill -9, on a disk that is full
    when the next checkpoint is written: the temporary is removed, the error is the documented line,
    and the previous last.pth is unchanged."""
    run = tmp_path / task
    shutil.copytree(runs / task, run)
    stale = run / ".last.pth.0123456789ab.tmp"
    stale.write_bytes(b"half a checkpoint")
    argv = {"lra": lambda: lra_train(runs, "--output", run, "--steps", "4"),
            "detect": lambda: detect_train("--output", run, "--steps", "2"),
            "segment": lambda: segment_train("--output", run, "--steps", "2")}[task]()
    real_open = open

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        if "last.pth" in str(path) and "x" in mode:
            return FullDisk(path, mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(polaformer.files, "open", open_on_full_disk, raising=False)
    last = (run / "last.pth").read_bytes()
    code, out, err = run_main([*argv, "--resume", "auto"], capsys)
    assert code == 2, err
    line = error_line(err, logs_allowed=True)
    assert line.endswith(f"cannot write {run / 'last.pth'}: no space left on device (any previous version of the "
                         "file is unchanged)")
    assert (run / "last.pth").read_bytes() == last
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
