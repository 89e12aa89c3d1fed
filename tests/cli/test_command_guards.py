"""The guarantees of issue 27 for the commands added since (issue 38): ``diffusion``, ``sr``, ``lm``, ``ablate``,
``bench`` and every path that opens one file. Bad settings end in one line naming the key (status 2) through the
config system's declared ranges; a FIFO given as a file is refused instead of waited on; no output replaces a file
unless asked; resuming refuses changed settings; our checkpoints' checksums catch damage; sizes are checked
before anything is allocated. In-process ``polaformer.cli.main`` except where the behaviour is about a process.
"""
from __future__ import annotations

import errno
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import polaformer.checkpoint
import polaformer.files
from cli_helpers import assert_unchanged, error_line, quiet, run_main, snapshot, within
from conftest import REPO
from polaformer.cli import main

TINY = ["--model", "vit_tiny_patch16_224", "--model-kwarg", "patch_size=2", "--model-kwarg", "embed_dim=16",
        "--model-kwarg", "depth=1", "--model-kwarg", "num_heads=1"]
DIFFUSION = ["--steps", "2", "--batch-size", "4", "--image-size", "8", "--eval-every", "2", "--opts",
             "model.hidden_size", "16", "model.depth", "1", "model.num_heads", "2", "train.eval_samples", "16"]
LM = ["--context", "16", "--steps", "2", "--batch-size", "4", "--eval-every", "2", "--max-bytes", "20000", "--opts",
      "train.eval_batches", "2", "train.warmup_steps", "1"]
SR_TINY = ["--opts", "model.embed_dim", "8", "model.depths", "[1]", "model.num_heads", "[2]", "model.window_size",
           "8", "data.repeats", "4", "eval.tile", "16", "eval.overlap", "4"]
BIG_SEED = str(2**70)


def _png(path: Path, value: int, size=(16, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(path)
    return path


def _bomb(path: Path) -> Path:
    """A PNG whose header declares 40000x40000 pixels (a few hundred bytes on disk)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return path


def _train(argv) -> None:
    with quiet():
        assert main([str(a) for a in argv]) == 0, argv


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Finished two-step runs of diffusion, lm and sr and a one-epoch digits run, their checkpoints (sound, NaN,
    damaged), images, a decompression bomb, a FIFO and existing outputs."""
    root = tmp_path_factory.mktemp("guards")
    _train(["diffusion", "train", *DIFFUSION, "--output", root / "diffusion"])
    _train(["lm", "train", *LM, "--output", root / "lm"])
    for i in range(3):
        image = np.random.RandomState(i).randint(0, 255, (32, 40, 3), dtype=np.uint8)
        (root / "hr").mkdir(exist_ok=True)
        Image.fromarray(image).save(root / "hr" / f"{i}.png")
    _train(["sr", "train", "--scale", "2", "--train-hr", root / "hr", "--valid-hr", root / "hr", "--patch-size", "16",
            "--steps", "2", "--batch-size", "2", "--eval-every", "2", "--output", root / "sr", *SR_TINY])
    _train(["train", *TINY, "--epochs", "1", "--batch-size", "256", "--output", root / "digits"])

    lm = torch.load(root / "lm" / "best.pth", weights_only=True)
    key = next(k for k, v in lm["model"].items() if v.is_floating_point())
    lm["model"][key] = torch.full_like(lm["model"][key], float("nan"))
    torch.save(polaformer.checkpoint.with_checksum(lm), root / "lm_nan.pth")  # as a diverged run saves it
    _damage(root / "digits" / "checkpoint.pth", root / "damaged.pth")
    for folder, value in (("a", 10), ("b", 200)):
        _png(root / folder / "x.png", value)
    _bomb(root / "bomb.png")
    os.mkfifo(root / "fifo")
    (root / "taken").mkdir()
    _png(root / "taken" / "x_x2.png", 1)
    _png(root / "samples.png", 2)
    (root / "scores.json").write_text("{}\n")
    (root / "rows.json").write_text("[]\n")
    (root / "bogus_row.yaml").write_text(f"BASE: [{REPO / 'configs/ablations/digits.yaml'}]\nABLATION:\n  SEEDS: [0]\n"
                                         "  ROWS:\n  - NAME: bogus\n    SWITCHES: {local: bogus}\n")
    return root


def _damage(source: Path, target: Path) -> None:
    """64 bytes in the middle of the largest tensor's data replaced by finite floats (1.0): the file still loads."""
    data = bytearray(source.read_bytes())
    with zipfile.ZipFile(source) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length + record.file_size // 2 // 4 * 4
    data[start:start + 64] = struct.pack("<f", 1.0) * 16
    target.write_bytes(bytes(data))


R = "{root}"
DIFF_TRAIN = ["diffusion", "train", *DIFFUSION]  # ends with --opts ...: more KEY VALUE pairs can follow
SAMPLE = ["diffusion", "sample", "--checkpoint", f"{R}/diffusion/last.pth", "--per-class", "1", "--steps", "2"]
LM_TRAIN = ["lm", "train", *LM]
LM_SAMPLE = ["lm", "sample", "--checkpoint", f"{R}/lm/best.pth", "--length", "5"]
SR_TRAIN = ["sr", "train", "--scale", "2", "--train-hr", f"{R}/hr", "--valid-hr", f"{R}/hr", "--patch-size", "16",
            "--steps", "1", "--batch-size", "2", *SR_TINY]
UPSCALE = ["sr", "upscale", "--checkpoint", f"{R}/sr/best.pth"]

CASES = [
    # diffusion: settings, sizes, devices, seeds and an existing output
    ("diffusion sample --cfg-scale nan", [*SAMPLE, "--output", f"{R}/new.png", "--cfg-scale", "nan"],
     "sample.cfg_scale must be a finite number >= 0 (1: no guidance), got nan"),
    ("diffusion sample --cfg-scale 1e308", [*SAMPLE, "--output", f"{R}/new.png", "--cfg-scale", "1e308"],
     "sampling produced NaN or infinite values (sample.cfg_scale 1e+308, ddim with 2 steps): "
     "use a smaller --cfg-scale"),
    ("diffusion sample over an existing file", [*SAMPLE, "--output", f"{R}/samples.png"],
     "samples.png already exists: --overwrite replaces it, or choose another --output"),
    ("diffusion train.ema_decay .nan", [*DIFF_TRAIN, "train.ema_decay", ".nan", "--output", f"{R}/new"],
     "train.ema_decay must lie in [0, 1) (0: no EMA), got nan"),
    ("diffusion train.eval_samples 0", [*DIFF_TRAIN, "train.eval_samples", "0", "--output", f"{R}/new"],
     "train.eval_samples must be a positive integer, got 0"),
    ("diffusion model.depth -1", [*DIFF_TRAIN, "model.depth", "-1", "--output", f"{R}/new"],
     "model.depth must be an integer >= 0 (0: the named model's), got -1"),
    ("diffusion beta_start > beta_end", [*DIFF_TRAIN, "diffusion.beta_start", "0.5", "diffusion.beta_end", "0.01",
                                         "--output", f"{R}/new"],
     "diffusion.beta_start (0.5) must not exceed diffusion.beta_end (0.01)"),
    ("diffusion data.valid_fraction 0", [*DIFF_TRAIN, "data.valid_fraction", "0", "--output", f"{R}/new"],
     "data.valid_fraction must lie in (0, 1), got 0.0"),
    ("diffusion data.valid_fraction 1", [*DIFF_TRAIN, "data.valid_fraction", "1", "--output", f"{R}/new"],
     "data.valid_fraction must lie in (0, 1), got 1.0"),
    ("diffusion --lr nan", [*DIFF_TRAIN, "--lr", "nan", "--output", f"{R}/new"],
     "train.lr must be a finite number > 0, got nan"),
    ("diffusion --lr -1", [*DIFF_TRAIN, "--lr", "-1", "--output", f"{R}/new"],
     "train.lr must be a finite number > 0, got -1.0"),
    ("diffusion train_timesteps 0", [*DIFF_TRAIN, "diffusion.train_timesteps", "0", "--output", f"{R}/new"],
     "diffusion.train_timesteps must be a positive integer, got 0"),
    ("diffusion --image-size 100000", ["diffusion", "train", "--image-size", "100000", "--output", f"{R}/new"],
     "a batch of train.batch_size images of data.image_size 100000 (64 x 1 x 100000 x 100000) needs"),
    ("diffusion sample --per-class 1e9", [*SAMPLE[:4], "--output", f"{R}/new.png", "--per-class", "1000000000"],
     "10000000000 samples (10000000000 x 1 x 8 x 8) needs"),
    ("diffusion train --seed 2**70", [*DIFF_TRAIN, "--seed", BIG_SEED, "--output", f"{R}/new"],
     f"train.seed must be an integer in [-2**63, 2**63), got {BIG_SEED}"),
    ("diffusion sample --seed 2**70", [*SAMPLE, "--output", f"{R}/new.png", "--seed", BIG_SEED],
     f"the seed must be an integer in [-2**63, 2**63), got {BIG_SEED}"),
    ("diffusion sample --device meta", [*SAMPLE, "--output", f"{R}/new.png", "--device", "meta"],
     "device 'meta' cannot run models: use 'cpu' or 'cuda'"),
    # lm
    ("lm eval --batches -1", ["lm", "eval", "--checkpoint", f"{R}/lm/best.pth", "--batches", "-1"],
     "--batches must be an integer >= 0 (0: all), got -1"),
    ("lm eval, NaN weights", ["lm", "eval", "--checkpoint", f"{R}/lm_nan.pth", "--batches", "1"],
     "holds NaN or infinite values"),
    ("lm sample --temperature -1", [*LM_SAMPLE, "--temperature", "-1"],
     "--temperature must be a finite number >= 0 (0: greedy), got -1.0"),
    ("lm sample --temperature nan", [*LM_SAMPLE, "--temperature", "nan"],
     "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    ("lm sample --top-k -1", [*LM_SAMPLE, "--top-k", "-1"], "--top-k must be an integer >= 0 (0: all), got -1"),
    ("lm sample --length 1e9", [*LM_SAMPLE[:-2], "--length", "1000000000"],
     "--length must be an integer in [1, 1048576], got 1000000000"),
    ("lm sample --seed 2**70", [*LM_SAMPLE, "--seed", BIG_SEED], "--seed must be an integer in [-2**63, 2**63)"),
    ("lm --lr nan", [*LM_TRAIN[:-5], "--lr", "nan", "--output", f"{R}/new"],
     "train.lr must be a finite number > 0, got nan"),
    ("lm --lr -1", [*LM_TRAIN[:-5], "--lr", "-1", "--output", f"{R}/new"],
     "train.lr must be a finite number > 0, got -1.0"),
    ("lm data.valid_fraction 0", [*LM_TRAIN, "data.valid_fraction", "0", "--output", f"{R}/new"],
     "data.valid_fraction must lie in (0, 1), got 0.0"),
    ("lm --context 1e9", ["lm", "train", "--context", "1000000000", "--output", f"{R}/new"],
     "model.context 1000000000 (a position table of 1000000000 x 64) needs"),
    ("lm --max-bytes 10", ["lm", "train", "--max-bytes", "10", "--output", f"{R}/new"],
     "the training split has 10 bytes (data.max_bytes 10), fewer than one window of model.context 128 + 1"),
    # sr
    ("sr --lr -1", [*SR_TRAIN, "--lr", "-1", "--output", f"{R}/new"], "train.lr must be a finite number > 0"),
    ("sr --lr nan", [*SR_TRAIN, "--lr", "nan", "--output", f"{R}/new"],
     "train.lr must be a finite number > 0, got nan"),
    ("sr train.gamma .nan", [*SR_TRAIN, "train.gamma", ".nan", "--output", f"{R}/new"],
     "train.gamma must be a finite number > 0, got nan"),
    ("sr model.window_size 0", ["sr", "train", "--opts", "model.window_size", "0", "--output", f"{R}/new"],
     "model.window_size must be a positive integer, got 0"),
    ("sr upscale, a decompression bomb", [*UPSCALE, f"{R}/bomb.png", "--output", f"{R}/new"],
     "bomb.png: Image size (1600000000 pixels) exceeds limit of"),
    ("sr upscale over an existing file", [*UPSCALE, f"{R}/a/x.png", "--output", f"{R}/taken"],
     "taken/x_x2.png already exists: --overwrite replaces it"),
    ("sr eval --json over an existing file", ["sr", "eval", "--checkpoint", f"{R}/sr/best.pth", "--hr", f"{R}/hr",
                                              "--json", f"{R}/scores.json"],
     "scores.json already exists: --overwrite replaces it, or choose another --json"),
    # ablate and bench
    ("ablate, bad learning rate", ["ablate", "--config", str(REPO / "configs/ablations/digits.yaml"), "--output",
                                   f"{R}/new", "--opts", "TRAIN.BASE_LR", ".nan"],
     "TRAIN.BASE_LR must be a finite number > 0, got nan"),
    ("ablate --seeds 2**70", ["ablate", "--config", str(REPO / "configs/ablations/digits.yaml"), "--output",
                              f"{R}/new", "--seeds", BIG_SEED], "ABLATION.SEEDS must be an integer in [-2**63"),
    ("ablate, a row with local: bogus", ["ablate", "--config", f"{R}/bogus_row.yaml", "--output", f"{R}/new"],
     "ablation row 'bogus' (SWITCHES {'local': 'bogus'}): cannot build model 'pola_deit_digits' with {'in_chans': 1, "
     "'img_size': 8, 'drop_path_rate': 0.0, 'local': 'bogus'}: local must be one of dwc, dcn, none, got 'bogus'"),
    ("bench --json over an existing file", ["bench", "pacs", "--rounds", "1", "--json", f"{R}/rows.json"],
     "rows.json already exists: --overwrite replaces it"),
    ("bench pacs --min-time 0", ["bench", "pacs", "--min-time", "0"], "--min-time must be > 0, got 0.0"),
    # the classification commands
    ("export --opset 99999", ["export", "--model", "pola_deit_tiny_patch16_224", "--out", f"{R}/new.onnx",
                              "--opset", "99999"], "opset must be in 1.."),
    ("analyze --dpi 100000", ["analyze", "--dpi", "100000", "--out", f"{R}/new"],
     "a figure of 8 x 5.6 inches at --dpi 100000 needs"),
    ("analyze --img-size 1e6", ["analyze", "--img-size", "1000000", "--out", f"{R}/new"],  # 100000 alike, 112 GiB
     "an image of --img-size 1000000 (3 x 1000000 x 1000000 float32) needs 1.12e+04 GiB, more than the"),
    ("train --model-kwarg num_classes=0", ["train", *TINY, "--model-kwarg", "num_classes=0", "--output", f"{R}/new"],
     "MODEL.KWARGS.num_classes: the number of classes comes from the data"),
    ("a 1000-character option name", ["lra", "train", "--task", "listops", "--data", f"{R}/new", "--attention",
                                      "pola", "--attention-option", "x" * 1000 + "=1"],
     "unknown option(s) xxxx"),  # the line is cut to MAX_MESSAGE characters
    ("eval, a damaged checkpoint", ["eval", "--checkpoint", f"{R}/damaged.pth"],
     "damaged.pth (its tensors do not match the checksum saved with them: the file was changed or damaged"),
    ("train --resume of a finished run", ["train", *TINY, "--epochs", "1", "--batch-size", "256", "--output",
                                          f"{R}/digits", "--resume",
                                          f"{R}/digits/checkpoint.pth"],
     "nothing to train: "),
]
if not torch.cuda.is_available():
    CASES.append(("diffusion sample --device cuda", [*SAMPLE, "--output", f"{R}/new.png", "--device", "cuda"],
                  "device 'cuda' requested but CUDA is not available"))

AFTER_LOGS = {"train --resume of a finished run", "lm --max-bytes 10"}


@pytest.mark.parametrize("name, argv, fragment", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_with_status_2(work, name, argv, fragment, capsys):
    before = snapshot(work)
    code, out, err = run_main([str(a).replace(R, str(work)) for a in argv], capsys)
    assert (code, out) == (2, ""), err
    assert fragment in error_line(err, logs_allowed=name in AFTER_LOGS)
    assert_unchanged(before, work)
    assert not (work / "new").exists()  # nothing written, not even an empty output folder


def test_a_non_utf8_prompt_is_its_bytes(work, capsys):
    """``--prompt $'\\xff'``: Python hands the byte over as a surrogate; the byte model takes the byte itself."""
    code, out, err = run_main(["lm", "sample", "--checkpoint", work / "lm" / "best.pth", "--prompt", "\udcff",
                               "--length", "3", "--temperature", "0"], capsys)
    assert code == 0, err
    assert out.startswith("\ufffd")


def test_bench_gpu_smoke_in_process_without_the_interpreter_is_one_line(tmp_path, capsys, monkeypatch):
    import polaformer.cli.bench

    monkeypatch.setattr(polaformer.cli.bench, "_triton_interprets", lambda: False)
    code, _, err = run_main(["bench", "gpu", "--smoke", "--out", tmp_path / "gpu.csv"], capsys)
    assert code == 2
    assert "--smoke needs Triton's interpreter" in error_line(err)
    assert not (tmp_path / "gpu.csv").exists()


# --- files that are not regular files ---------------------------------------------------------

FIFO_CASES = [
    ("eval --checkpoint", ["eval", "--checkpoint", "{fifo}"], "{fifo} (a FIFO (named pipe), not a regular file)"),
    ("train --finetune", ["train", *TINY, "--epochs", "1", "--finetune", "{fifo}", "--output", "{root}/new"],
     "a FIFO (named pipe), not a regular file"),
    ("train --config", ["train", "--config", "{fifo}", "--output", "{root}/new"],
     "config file {fifo}: a FIFO (named pipe), not a regular file"),
    ("analyze --image", ["analyze", "--model", "pola_deit_tiny_patch16_224", "--model-kwarg", "depth=1", "--image",
                         "{fifo}", "--out", "{root}/new"],
     "cannot read image {fifo}: a FIFO (named pipe), not a regular file"),
    ("lra eval --checkpoint", ["lra", "eval", "--checkpoint", "{fifo}", "--data", "{root}"],
     "a FIFO (named pipe), not a regular file"),
    ("sr upscale", [*UPSCALE, "{fifo}", "--output", "{root}/new"],
     "cannot read image {fifo}: a FIFO (named pipe), not a regular file"),
    ("ablate --config", ["ablate", "--config", "{fifo}", "--output", "{root}/new"],
     "config file {fifo}: a FIFO (named pipe), not a regular file"),
]


@pytest.mark.parametrize("name, argv, fragment", FIFO_CASES, ids=[case[0] for case in FIFO_CASES])
def test_a_fifo_is_refused_not_waited_on(work, name, argv, fragment, capsys):
    fifo = work / "fifo"

    def fill(text):
        return text.replace("{fifo}", str(fifo)).replace("{root}", str(work)).replace(R, str(work))

    code, out, err = within(60, fifo, lambda: run_main([fill(str(a)) for a in argv], capsys))
    assert (code, out) == (2, ""), err
    assert fill(fragment) in error_line(err, logs_allowed=True)


def test_load_checkpoint_refuses_a_fifo(work):
    from polaformer import load_checkpoint

    with pytest.raises(polaformer.checkpoint.CorruptCheckpointError, match="a FIFO"):
        within(30, work / "fifo", lambda: load_checkpoint(torch.nn.Linear(2, 2), work / "fifo"))


def test_an_sr_folder_with_a_fifo_trains_on_its_images(work, tmp_path, capsys):
    folder = tmp_path / "hr"
    folder.mkdir()
    for image in (work / "hr").iterdir():
        (folder / image.name).write_bytes(image.read_bytes())
    os.mkfifo(folder / "pipe.png")
    argv = ["sr", "train", "--scale", "2", "--train-hr", folder, "--valid-hr", folder, "--patch-size", "16",
            "--steps", "1", "--batch-size", "2", "--output", tmp_path / "run", *SR_TINY]
    code, _, err = within(120, folder / "pipe.png", lambda: run_main(argv, capsys))
    assert code == 0, err
    assert "3 train / 3 valid images" in err


# --- outputs -------------------------------------------------------------------------------------

def test_sr_upscale_gives_same_named_images_distinct_outputs(work, tmp_path, capsys):
    argv = [a.replace(R, str(work)) for a in [*UPSCALE, f"{R}/a/x.png", f"{R}/b/x.png", "--output", str(tmp_path)]]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    pixels = [Image.open(tmp_path / name).getpixel((0, 0)) for name in ("x_x2.png", "x_x2-2.png")]
    assert pixels[0] != pixels[1]
    first = (tmp_path / "x_x2.png").read_bytes()
    code, _, err = run_main(argv, capsys)  # again: refused, nothing changed
    assert code == 2 and "x_x2.png already exists (and 1 more)" in error_line(err)
    assert (tmp_path / "x_x2.png").read_bytes() == first
    code, _, err = run_main([*argv, "--overwrite"], capsys)
    assert code == 0, err


def test_progress_bars_leave_the_result_unchanged(work):
    from polaformer.tasks.sr import load_sr_model, model_upscaler

    model, cfg = load_sr_model(work / "sr" / "best.pth")
    lr = torch.rand(1, 3, 20, 30)
    torch.testing.assert_close(model_upscaler(model, cfg, progress=True)(lr), model_upscaler(model, cfg)(lr))
    assert not model._forward_hooks  # the counting hook is removed


# --- resuming ------------------------------------------------------------------------------------

RESUMES = [
    ("diffusion", lambda r: ["diffusion", "train", *DIFFUSION[:6], "--steps", "4", "--resume", r / "diffusion" /
                             "last.pth", "--output", r / "new", *DIFFUSION[8:]], "train.lr", ["--lr", "0.5"]),
    ("diffusion", lambda r: ["diffusion", "train", *DIFFUSION[:2], *DIFFUSION[4:6], "--batch-size", "2", "--steps",
                             "4", "--resume", r / "diffusion" / "last.pth", "--output", r / "new", *DIFFUSION[8:]],
     "train.batch_size", []),
    ("lm", lambda r: ["lm", "train", *LM[:2], "--batch-size", "4", "--steps", "4", *LM[6:], "--resume",
                      r / "lm" / "last.pth", "--output", r / "new"], "train.lr", ["--lr", "0.5"]),
    ("lm", lambda r: ["lm", "train", *LM[:2], "--batch-size", "2", "--steps", "4", *LM[6:], "--resume",
                      r / "lm" / "last.pth", "--output", r / "new"], "train.batch_size", []),
    ("sr", lambda r: ["sr", "train", "--scale", "2", "--train-hr", r / "hr", "--valid-hr", r / "hr",
                      "--patch-size", "16", "--steps", "4", "--batch-size", "2", "--eval-every", "2", *SR_TINY,
                      "--resume", r / "sr" / "last.pth", "--output", r / "new"], "train.lr", ["--lr", "0.5"]),
    ("classification", lambda r: ["train", *TINY, "--epochs", "2", "--batch-size", "256", "--resume",
                                  r / "digits" / "checkpoint.pth", "--output", r / "new"], "TRAIN.BASE_LR",
     ["--lr", "0.5"]),
    ("classification", lambda r: ["train", *TINY, "--epochs", "2", "--batch-size", "128", "--resume",
                                  r / "digits" / "checkpoint.pth", "--output", r / "new"], "DATA.BATCH_SIZE", []),
]


@pytest.mark.parametrize("task, argv, key, change", RESUMES, ids=[f"{r[0]}-{r[2]}" for r in RESUMES])
def test_resume_refuses_a_changed_setting_unless_allowed(work, task, argv, key, change, capsys, tmp_path):
    argv = [*argv(work), *change]
    before = snapshot(work)
    code, _, err = run_main(argv, capsys)
    assert code == 2, err
    line = error_line(err, logs_allowed=True)
    assert f"was trained with {key} = " in line and f"--allow-changed {key} continues the run" in line
    assert_unchanged(before, work)
    allowed = [a if a != work / "new" else tmp_path / "run" for a in argv]
    code, _, err = run_main([*allowed, "--allow-changed", key], capsys)
    assert code == 0, err


# --- faults --------------------------------------------------------------------------------------

def test_lm_train_onto_a_full_disk_is_the_documented_line(work, tmp_path, capsys, monkeypatch):
    """The disk fills after the first 4 kB of a checkpoint: torch's zip writer turned that into 'unexpected pos'."""
    real_open = open

    class FillsUp(io.FileIO):
        room = 4096

        def write(self, data):
            n = min(len(data), FillsUp.room)
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            FillsUp.room -= n
            return super().write(bytes(memoryview(data).cast("B")[:n]))

    def open_on_a_small_disk(path, mode="r", *args, **kwargs):
        if "last.pth" in str(path) and "x" in mode:
            return io.BufferedWriter(FillsUp(path, mode.replace("b", "")))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(polaformer.files, "open", open_on_a_small_disk, raising=False)
    code, _, err = run_main(["lm", "train", *LM, "--output", tmp_path / "run"], capsys)
    assert code == 2, err
    assert error_line(err, logs_allowed=True).endswith(
        f"cannot write {tmp_path / 'run' / 'last.pth'}: no space left on device (any previous version of the file "
        "is unchanged)")
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]


def test_ctrl_c_while_the_first_checkpoint_is_copied_names_it(tmp_path, capsys, monkeypatch):
    """Ctrl-C after ``checkpoint.pth`` is written, while it is copied to ``best.pth``: the run saved it."""
    import polaformer.engine.checkpoint as engine_checkpoint

    real = engine_checkpoint.atomic_write
    calls = []

    def interrupted_on_the_copy(path, write):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, write)

    monkeypatch.setattr(engine_checkpoint, "atomic_write", interrupted_on_the_copy)
    code, _, err = run_main(["train", *TINY, "--epochs", "1", "--batch-size", "256", "--output", tmp_path], capsys)
    assert code == 130
    assert error_line(err, logs_allowed=True) == (
        f"polaformer: interrupted; last saved checkpoint: {tmp_path / 'checkpoint.pth'}")


# --- real processes --------------------------------------------------------------------------------

SUBPROCESS_CASES = [
    ("diffusion", ["diffusion", "sample", "--checkpoint", "{root}/diffusion/last.pth", "--output", "{root}/x.png",
                   "--cfg-scale", "nan"], "sample.cfg_scale must be a finite number >= 0"),
    ("sr", ["sr", "upscale", "--checkpoint", "{root}/sr/best.pth", "{root}/bomb.png", "--output", "{root}/new"],
     "exceeds limit of"),
    ("lm", ["lm", "sample", "--checkpoint", "{root}/lm/best.pth", "--top-k", "-1"], "--top-k must be an integer >= 0"),
    ("ablate", ["ablate", "--config", "{root}/fifo"], "a FIFO (named pipe), not a regular file"),
    ("bench", ["bench", "pacs", "--json", "{root}/rows.json"], "rows.json already exists"),
]


# Imports the command once, then runs each case in a child forked from it, through the real entry point (the
# console script's and `python -m polaformer`'s `run`), its stdout and stderr in files: a process per command
# for one import of torch.
FORKED = r"""
import json, os, sys, traceback
import polaformer.cli
from polaformer.__main__ import run
statuses = []
for argv, out, err in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["polaformer", *argv]
        try:
            code = run()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(statuses))
"""


@pytest.mark.slow
def test_subprocess_errors_are_one_short_line(work, tmp_path):
    """Each new command in a process of its own: status 2, one line of at most 500 characters on stderr, nothing
    on stdout, no file changed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POLAFORMER_NATIVE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    before = snapshot(work)
    cases = [([a.replace("{root}", str(work)) for a in argv], str(tmp_path / f"{i}.out"), str(tmp_path / f"{i}.err"))
             for i, (_, argv, _) in enumerate(SUBPROCESS_CASES)]
    result = subprocess.run([sys.executable, "-c", FORKED, json.dumps(cases)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for (name, _, fragment), (_, out, err), status in zip(SUBPROCESS_CASES, cases, json.loads(result.stdout)):
        stderr = Path(err).read_text()
        assert (status, Path(out).read_text()) == (2, ""), (name, stderr[-2000:])
        assert fragment in error_line(stderr), name
    assert_unchanged(before, work)


@pytest.mark.parametrize("argv, message", [
    (["sr", "eval", "--checkpoint", "{root}/sr/best.pth", "--hr", "{fifo}"], "image folder {fifo} is not a folder"),
    (["diffusion", "train", "--vae", "{fifo}", "--output", "{root}/new"], "VAE path is not a folder: {fifo}"),
    (["diffusion", "fid", "--checkpoint", "{root}/diffusion/last.pth", "--features", "{fifo}", "--per-class", "1"],
     "an Inception weights file; not a regular file: {fifo}"),
], ids=["sr eval --hr", "diffusion train --vae", "diffusion fid --features"])
def test_a_fifo_for_a_folder_or_weights_is_named_as_such(work, argv, message, capsys):
    """These checked the path's kind already (no hang) but called a FIFO missing."""
    def fill(text):
        return str(text).replace("{fifo}", str(work / "fifo")).replace("{root}", str(work))

    code, out, err = run_main([fill(a) for a in argv], capsys)
    assert (code, out) == (2, "")
    assert fill(message) in error_line(err)


def test_an_upscale_larger_than_memory_is_refused_before_allocating(work):
    """A 100000x100000 input (a view of one pixel: no memory behind it) would need a 2e11-pixel output."""
    from polaformer.engine.config import ConfigError
    from polaformer.tasks.sr import load_sr_model, model_upscaler

    model, cfg = load_sr_model(work / "sr" / "best.pth")
    lr = torch.zeros(1, 3, 1, 1).expand(1, 3, 100000, 100000)
    for progress in (False, True):
        with pytest.raises(ConfigError, match=r"^the x2 output of a 100000x100000 image \(1 x 3 x 200000 x 200000\) "
                                              r"needs .* GiB, more than the .* of memory available on cpu; upscale a "
                                              r"smaller image$"):
            model_upscaler(model, cfg, progress=progress)(lr)
