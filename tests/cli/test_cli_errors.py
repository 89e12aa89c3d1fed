"""Bad input and faults at the command line: exit status 2 (130 for Ctrl-C), one stderr line naming
the problem, and no existing file changed. docs/errors.md lists the same cases with their messages.

Most cases run in-process through ``polaformer.cli.main`` (the same code the entry point runs, with
the same streams captured); a few run as real ``python -m polaformer`` processes: a signal, a lock
held by another process, and the message-length cap.
"""
import errno
import io
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

import polaformer.files
from cli_helpers import assert_unchanged, error_line, quiet, run_main, snapshot
from conftest import REPO
from polaformer.checkpoint import with_checksum
from polaformer.cli import main
from polaformer.engine.output import OutputLock

TINY = ["--model", "vit_tiny_patch16_224", "--model-kwarg", "patch_size=2", "--model-kwarg", "embed_dim=16",
        "--model-kwarg", "depth=1", "--model-kwarg", "num_heads=1"]
DEIT = "pola_deit_tiny_patch16_224"
DEIT_KWARGS = dict(depth=1, img_size=32, patch_size=8, embed_dim=16, num_heads=2)


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A finished digits run, an RGB image folder, folder checkpoints (sound and damaged) and configs."""
    root = tmp_path_factory.mktemp("errors")
    run = root / "run"
    with quiet():
        assert main(["train", *TINY, "--epochs", "1", "--batch-size", "128", "--output", str(run)]) == 0

    for split in ("train", "val"):
        for c, name in enumerate(("ant", "bee")):
            folder = root / "data" / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = np.full((32, 32, 3), 60 * c + 10 * i, dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")

    for folder, classes, readable in (("unreadable", ("ant", "bee"), False), ("one_class", ("ant",), True),
                                      ("cat_dog", ("cat", "dog"), True)):
        for split in ("train", "val"):
            for c, name in enumerate(classes):
                (root / folder / split / name).mkdir(parents=True)
                for i in range(2):
                    image = root / folder / split / name / f"{i}.png"
                    if readable:
                        Image.fromarray(np.full((32, 32, 3), 60 * c, dtype=np.uint8)).save(image)
                    else:
                        image.write_bytes(b"not a PNG")

    import timm

    import polaformer.models  # noqa: F401

    model = timm.create_model(DEIT, num_classes=2, **DEIT_KWARGS)
    good = {"model": model.state_dict(), "arch": DEIT, "model_kwargs": DEIT_KWARGS, "num_classes": 2, "epoch": 1,
            "class_names": ["ant", "bee"]}
    torch.save(good, root / "deit.pth")
    head = good["model"]["head.weight"]
    nan = {**good, "model": {**good["model"], "head.weight": torch.full_like(head, float("nan"))}}
    torch.save(nan, root / "nan.pth")
    integer = {**good, "model": {**good["model"], "head.bias": torch.zeros(2, dtype=torch.int64)}}
    torch.save(integer, root / "int64.pth")
    torch.save({**good, "model_kwargs": {**DEIT_KWARGS, "depth": 10**9}}, root / "deep.pth")

    digits = torch.load(run / "checkpoint.pth", weights_only=True)

    def tampered(changes, name):  # saved with a checksum of its own: the tampering is what is under test
        torch.save(with_checksum({**digits, **changes}), root / name)

    tampered({"arch": 42}, "arch42.pth")
    tampered({"model_kwargs": [1, 2]}, "kwargs_list.pth")
    tampered({"epoch": "three"}, "bad_epoch.pth")
    tampered({"optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}, "bad_optimizer.pth")
    tampered({"rng": [{"python": 5, "numpy": {}, "torch": torch.zeros(3)}]}, "bad_rng.pth")
    moments = {**digits["optimizer"]["state"][0], "exp_avg": torch.zeros(3, 3)}
    optimizer = {**digits["optimizer"], "state": {**digits["optimizer"]["state"], 0: moments}}
    tampered({"optimizer": optimizer}, "bad_exp_avg.pth")
    (root / "model.onnx").write_bytes(b"an earlier export")

    configs = root / "configs"
    configs.mkdir()
    (configs / "base5.yaml").write_text("BASE: 5\n")
    (configs / "latin1.yaml").write_bytes("TAG: caf\xe9\n".encode("latin-1"))
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(8)
    ]
    (configs / "bomb.yaml").write_text("\n".join(lines) + "\n")
    os.symlink("loop_b.yaml", configs / "loop_a.yaml")  # a loop of symbolic links
    os.symlink("loop_a.yaml", configs / "loop_b.yaml")
    (root / "a_file").write_text("not a folder\n")
    return root


# --- the table -------------------------------------------------------------------------------

R = "{root}"  # replaced by the fixture folder
TRAIN_DIGITS = ["train", *TINY, "--epochs", "1", "--output", f"{R}/new"]
TRAIN_FOLDER = ["train", "--data-path", f"{R}/data", "--output", f"{R}/new"]
EVAL_FOLDER = ["eval", "--checkpoint", f"{R}/deit.pth", "--data-path", f"{R}/data", "--workers", "0"]
RESUME = ["train", *TINY, "--batch-size", "128", "--output", f"{R}/new", "--epochs", "3", "--resume"]

CASES = [
    # settings
    ("negative lr", [*TRAIN_DIGITS, "--lr", "-1"], "TRAIN.BASE_LR must be a finite number > 0, got -1.0"),
    ("NaN lr", [*TRAIN_DIGITS, "--lr", "nan"], "TRAIN.BASE_LR must be a finite number > 0, got nan"),
    ("negative weight decay", [*TRAIN_DIGITS, "--weight-decay", "-0.1"], "TRAIN.WEIGHT_DECAY must be a finite"),
    ("label smoothing 1.5", [*TRAIN_DIGITS, "--label-smoothing", "1.5"], "MODEL.LABEL_SMOOTHING must lie in [0, 1)"),
    ("negative NUM_WORKERS", [*TRAIN_FOLDER, "--opts", "DATA.NUM_WORKERS", "-1"],
     "DATA.NUM_WORKERS must be an integer >= 0"),
    ("negative TEST.BATCH_SIZE", [*TRAIN_FOLDER, "--opts", "TEST.BATCH_SIZE", "-4"],
     "TEST.BATCH_SIZE must be an integer >= 0"),
    ("BASE: 5", [*TRAIN_FOLDER, "--config", f"{R}/configs/base5.yaml"], "BASE in"),
    ("non-UTF-8 YAML", [*TRAIN_FOLDER, "--config", f"{R}/configs/latin1.yaml"], "is not UTF-8 text"),
    ("YAML alias bomb", [*TRAIN_FOLDER, "--config", f"{R}/configs/bomb.yaml"], "YAML aliases (*name) are not allowed"),
    ("alias in --model-kwarg", ["train", "--model-kwarg", "depth=[&a 1, *a]"], "cannot read the value"),
    ("device meta", [*TRAIN_DIGITS, "--device", "meta"], "device 'meta' cannot run models"),
    ("device mps", ["eval", "--checkpoint", f"{R}/run/checkpoint.pth", "--device", "mps"], "MPS is not available"),
    ("embed_dim=-5", [*TRAIN_DIGITS, "--model-kwarg", "embed_dim=-5"], "embed_dim must be positive, got -5"),
    ("a 100 kB value", [*TRAIN_DIGITS, "--model-kwarg", "mlp_ratio=" + "x" * 100_000],
     "mlp_ratio must be positive, got 'xxx"),  # the line is cut to MAX_MESSAGE characters
    ("1-channel model, RGB folder", [*TRAIN_FOLDER, "--model", DEIT, "--model-kwarg", "in_chans=1"],
     "built for 1-channel images"),
    ("digits model, RGB folder", [*TRAIN_FOLDER, "--model", "pola_deit_digits"], "built for 1-channel images"),
    # output folder
    ("finished run, no --resume", ["train", *TINY, "--epochs", "1", "--output", f"{R}/run"],
     "already holds a run (checkpoint.pth"),
    ("output under a file", [*TRAIN_DIGITS[:-1], f"{R}/a_file/out"], "cannot create the output folder"),
    ("resume, no epoch left", ["train", *TINY, "--batch-size", "128", "--output", f"{R}/new", "--epochs", "1",
                               "--resume", f"{R}/run/checkpoint.pth"], "nothing to train: "),
    # checkpoints
    ("NaN weights", ["eval", "--checkpoint", f"{R}/nan.pth", "--data-path", f"{R}/data"],
     "weight 'head.weight' holds NaN or infinite values"),
    ("int64 weights", ["eval", "--checkpoint", f"{R}/int64.pth", "--data-path", f"{R}/data"],
     "weight 'head.bias' is int64, the model's is float32; refusing to cast it"),
    ("arch=42", ["eval", "--checkpoint", f"{R}/arch42.pth"], "'arch' must be a model name, found 42"),
    ("model_kwargs a list", ["eval", "--checkpoint", f"{R}/kwargs_list.pth"], "'model_kwargs' must be a dict"),
    ("tampered epoch", [*RESUME, f"{R}/bad_epoch.pth"], "training state cannot be restored: ValueError"),
    ("tampered optimizer", [*RESUME, f"{R}/bad_optimizer.pth"], "training state cannot be restored"),
    ("tampered rng", [*RESUME, f"{R}/bad_rng.pth"], "training state cannot be restored"),
    ("tampered exp_avg shape", [*RESUME, f"{R}/bad_exp_avg.pth"],
     "training state cannot be restored: ValueError: optimizer state 'exp_avg' of '"),
    # data folders
    ("every image unreadable", [*TRAIN_FOLDER[:2], f"{R}/unreadable", *TRAIN_FOLDER[3:]],
     "unreadable/train: none of its 4 images can be read (e.g. "),
    ("one class folder", [*TRAIN_FOLDER[:2], f"{R}/one_class", *TRAIN_FOLDER[3:]],
     "one_class/train has one class folder (ant): a classifier needs at least 2 classes"),
    ("eval, other class names", [*EVAL_FOLDER[:4], f"{R}/cat_dog", *EVAL_FOLDER[5:]],
     "cat_dog/val are not those"),
    # export
    ("export --atol -1", ["export", "--model", DEIT, "--out", f"{R}/model.onnx", "--atol", "-1"],
     "--atol must be >= 0, got -1.0"),
    ("export --weights ema, no checkpoint", ["export", "--model", DEIT, "--out", f"{R}/model.onnx", "--weights", "ema"],
     "--weights needs --checkpoint FILE"),
    ("export, NaN weights", ["export", "--model", DEIT, "--checkpoint", f"{R}/nan.pth", "--out", f"{R}/model.onnx",
                             "--overwrite"], "weight 'head.weight' holds NaN or infinite values"),
    ("export over an existing file", ["export", "--model", DEIT, "--out", f"{R}/model.onnx"],
     "model.onnx already exists: --overwrite replaces it, or choose another --out"),
    # sizes and memory
    ("depth=1e9 in a checkpoint", [*EVAL_FOLDER[:2], f"{R}/deep.pth", *EVAL_FOLDER[3:]], "for its weights"),
    ("eval --img-size 100000", [*EVAL_FOLDER, "--img-size", "100000"], "more than the"),
    ("eval --crop-pct 1e-9", [*EVAL_FOLDER, "--crop-pct", "1e-9"], "an image resized for crop_pct 1e-09"),
    ("eval size the model cannot take", [*EVAL_FOLDER, "--img-size", "36"], "cannot take 36x36 images"),
    ("throughput size not divisible", ["throughput", "--model", DEIT, "--img-size", "30", "--batch-size", "2"],
     "cannot take 30x30 images"),
    ("throughput --img-size 100000", ["throughput", "--model", DEIT, "--img-size", "100000"], "more than the"),
    # issue 51: the last raw tracebacks and silent acceptances of train
    ("patches that do not tile the images", ["train", "--model-kwarg", "patch_size=3", "--epochs", "1", "--output",
                                             f"{R}/new"],
     "model 'pola_deit_digits' cannot take 8x8 images: image size 8x8 is not divisible by the patch size 3x3"),
    ("a --config symlink loop", [*TRAIN_FOLDER, "--config", f"{R}/configs/loop_a.yaml"],
     "configs/loop_a.yaml: too many levels of symbolic links"),
    ("no such CPU index", [*TRAIN_DIGITS, "--device", "cpu:7"],
     "device 'cpu:7': there is no cpu device 7 (use 'cpu:0' or 'cpu')"),
    ("--model ''", [*TRAIN_DIGITS, "--model", ""],
     "polaformer train: error: argument --model: got an empty value (give NAME, or leave the option out)"),
    ("--output ''", [*TRAIN_DIGITS, "--output", ""],
     "polaformer train: error: argument --output: got an empty value (give DIR, or leave the option out)"),
]


# Cases that fail after an info line was logged (the data folder's summary, "resumed from ...").
AFTER_LOGS = {"1-channel model, RGB folder", "digits model, RGB folder", "resume, no epoch left"}


@pytest.mark.parametrize("name, argv, fragment", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_with_status_2(work, name, argv, fragment, capsys):
    before = snapshot(work)
    code, out, err = run_main([a.replace(R, str(work)) for a in argv], capsys)
    assert (code, out) == (2, ""), err
    assert fragment in error_line(err, logs_allowed=name in AFTER_LOGS)
    assert_unchanged(before, work)


@pytest.mark.parametrize("option", ["--model", "--output", "--config", "--data-path", "--resume", "--device"])
def test_an_empty_value_names_nothing(option, tmp_path, capsys, monkeypatch):
    """``--model ''`` trained the default model and ``--output ''`` wrote into runs/MODEL, without a word; an empty
    value of any option that names something is now refused by the parser every command shares, before anything
    is read or written (here: in an empty working folder, which stays empty)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["train", *TINY, "--epochs", "1", option, ""], capsys)
    assert (code, out) == (2, ""), err
    assert re.search(rf"argument {option}(/--\w+)?: got an empty value \(give ", error_line(err))
    assert list(tmp_path.iterdir()) == []


def test_throughput_counts_activations_not_only_the_input(capsys, monkeypatch):
    """Batch 20000 of DeiT-tiny: its 11.2 GiB input fits in 16 GiB, the input plus the largest layer's
    activations do not (the kernel killed it at 24 GB). Memory is fixed so the case reads alike anywhere."""
    import polaformer.limits

    monkeypatch.setattr(polaformer.limits, "available_memory", lambda device="cpu": 16 * 2**30)
    code, out, err = run_main(["throughput", "--model", DEIT, "--batch-size", "20000", "--device", "cpu"], capsys)
    assert (code, out) == (2, ""), err
    assert error_line(err).startswith(
        "polaformer: error: a forward pass of 20000 x 3 x 224 x 224 images needs at least ")
    assert "more than the 16 GiB of memory available on cpu; use a smaller batch" in err


def test_non_finite_weights_load_when_allowed(work, capsys):
    code, out, err = run_main(["eval", "--checkpoint", work / "nan.pth", "--data-path", work / "data",
                               "--workers", "0", "--allow-nonfinite"], capsys)
    assert code == 0, err
    assert "loss: nan" in out


def test_divergence_is_one_line(work, capsys):
    code, _, err = run_main([*TRAIN_DIGITS[:-1], work / "diverged", "--lr", "1e6", "--no-augment"], capsys)
    assert code == 2
    assert re.search(r"training diverged at step \d+, loss (nan|inf)", error_line(err, logs_allowed=True))


def test_full_disk_keeps_the_old_checkpoint(work, capsys, monkeypatch):
    """The epoch's checkpoint cannot be written: the error names it; the previous one is intact."""
    run = work / "run"
    real_open = open

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        if "checkpoint.pth" in str(path) and "x" in mode:
            return FullDisk(path, mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(polaformer.files, "open", open_on_full_disk, raising=False)
    before = snapshot(work)
    code, _, err = run_main(["train", *TINY, "--epochs", "2", "--batch-size", "128", "--output", run,
                             "--resume", "auto"], capsys)
    assert code == 2
    line = error_line(err, logs_allowed=True)
    assert f"cannot write {run / 'checkpoint.pth'}: no space left on device" in line
    assert_unchanged(before, work)
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_overwrite_replaces_a_finished_run(work, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    (run / "best_ema.pth").write_bytes((run / "best.pth").read_bytes())  # as from an earlier run with EMA
    code, out, err = run_main(["train", *TINY, "--epochs", "1", "--batch-size", "128", "--output", run,
                               "--overwrite", "--seed", "1"], capsys)
    assert code == 0, err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (run / "best_ema.pth").exists()
    assert torch.load(run / "checkpoint.pth", weights_only=True)["config"]["SEED"] == 1


def test_lock_names_the_holder_in_process(work, capsys):
    lock = OutputLock(work / "locked")
    try:
        code, _, err = run_main([*TRAIN_DIGITS[:-1], work / "locked"], capsys)
    finally:
        lock.release()
    assert code == 2
    assert f"is in use by process {os.getpid()}" in error_line(err)
    assert not (work / "locked" / ".polaformer.lock").exists()  # released and removed


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# Both are status 130 to a shell: exit(130), or death by SIGINT, which CPython occasionally chooses at exit
# after a KeyboardInterrupt the command handled (seen once in CI, Ctrl-C during the imports, one line printed).
ENDED_BY_CTRL_C = (130, -signal.SIGINT)


def _interactive():
    # As a terminal starts a command: Ctrl-C at its default. A test runner's worker may ignore SIGINT, and a
    # child inheriting that ignore would rightly never see the signal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_subprocess_ctrl_c_and_a_busy_folder(work, capsys):
    """A real training process: a second training into its folder is refused naming its pid; Ctrl-C
    ends it with status 130 and a one-line note of the last checkpoint it saved. The training is far longer
    than the test (a tiny model runs 200 epochs in ~20 s on a busy CI machine), so it cannot end first."""
    output = work / "interrupted"
    process = subprocess.Popen(
        [sys.executable, "-m", "polaformer", "train", *TINY, "--epochs", "100000", "--batch-size", "256",
         "--output", str(output)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        preexec_fn=_interactive)
    try:
        deadline = time.monotonic() + 90
        while not (output / "checkpoint.pth").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()  # reading the stderr of a live child would wait for it forever
                pytest.fail(f"the training ended or saved nothing: {process.communicate()[1][-2000:]}")
            time.sleep(0.2)
        code, _, err = run_main([*TRAIN_DIGITS[:-1], output], capsys)
        assert code == 2 and f"is in use by process {process.pid}" in error_line(err)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode in ENDED_BY_CTRL_C, stderr
    assert error_line(stderr, logs_allowed=True) == (
        f"polaformer: interrupted; last saved checkpoint: {output / 'checkpoint.pth'}")
    torch.load(output / "checkpoint.pth", weights_only=True)  # complete
    assert not (output / ".polaformer.lock").exists()


def test_subprocess_ctrl_c_while_starting(tmp_path):
    """Ctrl-C one second in, while the command still imports torch: status 130 and one line, no
    traceback and no output folder."""
    process = subprocess.Popen([sys.executable, "-m", "polaformer", "train", "--output", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               preexec_fn=_interactive)
    try:
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode in ENDED_BY_CTRL_C and stdout == "", stderr[-2000:]
    assert error_line(stderr).startswith("polaformer: interrupted")
    assert not (tmp_path / "run").exists()


def test_ctrl_c_inside_an_import_ends_the_command_at_once(tmp_path):
    """Ctrl-C while the command imports, landing where Python turns KeyboardInterrupt into another error (here
    class creation's __set_name__: a RuntimeError traceback; in C++ called through pybind11: an abort): status
    130 and the one line all the same (the module loaded alone, without the package's seconds of imports)."""
    script = tmp_path / "start.py"
    script.write_text(f"""
import importlib.util, os, signal
spec = importlib.util.spec_from_file_location("startup", {str(REPO / "polaformer" / "_startup.py")!r})
startup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(startup)

class Field:
    def __set_name__(self, owner, name):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10 ** 6):
            pass

with startup.interrupt_exits(True):
    class State:
        level = Field()
print("not reached")
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            preexec_fn=_interactive)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "polaformer: interrupted\n")


def test_subprocess_alias_bomb(work):
    """The real entry point on the 335-byte alias bomb: status 2, one short line, nothing changed."""
    before = snapshot(work)
    result = subprocess.run(
        [sys.executable, "-m", "polaformer", "train", "--config", str(work / "configs" / "bomb.yaml"),
         "--output", str(work / "new")], capture_output=True, text=True, env=_env(), timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr[-2000:]
    assert "YAML aliases (*name) are not allowed" in error_line(result.stderr)
    assert_unchanged(before, work)


def test_an_overflow_the_attention_refuses_is_one_line(tmp_path, capsys, monkeypatch):
    """The causal ops raise FloatingPointError for finite inputs they cannot compute in the dtype; a command
    hitting it ends in that one line, status 2."""
    import polaformer.tasks.lm

    def overflowing(*args, **kwargs):
        from polaformer.ops import causal_pacs_step
        q = k = torch.full((1, 1, 1, 2), 100.0)
        temps = torch.ones(1, 1, 1, 4)
        causal_pacs_step(q, k, torch.ones(1, 1, 1, 2), temps, temps)

    monkeypatch.setattr(polaformer.tasks.lm, "train_lm", overflowing)
    code, _, err = run_main(["lm", "train", "--output", str(tmp_path / "run")], capsys)
    assert code == 2
    assert re.fullmatch(r"polaformer: error: causal PaCS attention .* overflowed float32; .*float64", error_line(err))
