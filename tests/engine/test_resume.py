"""Crash safety: a run killed with SIGKILL mid-epoch and resumed ends bit-identical to one never stopped.

The run exercises everything a resume must restore: drop path and the digits shifts (torch RNG),
EMA weights, gradient accumulation, the optimizer, the per-update schedule, and the position in
the epoch's data order (a checkpoint every 3 optimizer updates).
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from polaformer.tasks.classification import load_config
from tolerances import assert_same_tensors

OPTS = [
    "DATA.DATASET", "digits", "MODEL.NAME", "pola_deit_digits", "MODEL.DROP_PATH_RATE", "0.1",
    "AUG.DIGITS_SHIFT", "true", "DATA.BATCH_SIZE", "32", "DATA.NUM_WORKERS", "0",
    "TRAIN.EPOCHS", "2", "TRAIN.WARMUP_EPOCHS", "1", "TRAIN.BASE_LR", "2e-3", "TRAIN.BASE_BATCH_SIZE", "0",
    "TRAIN.MIN_LR", "1e-5", "TRAIN.WARMUP_LR", "1e-5", "TRAIN.CLIP_GRAD", "1.0",
    "TRAIN.ACCUMULATION_STEPS", "2", "TRAIN.SAVE_FREQ_STEPS", "3",
    "TRAIN.EMA.ENABLE", "true", "TRAIN.EMA.DECAY", "0.99", "TEST.BATCH_SIZE", "256", "DEVICE", "cpu", "SEED", "7",
]
TIMING_KEYS = {"epoch_time_s", "images_per_s"}


def train(config, output, *extra):
    # One thread each: two processes with as many threads as cores slow each other down many times.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "polaformer", "train", "--config", str(config), "--output", str(output), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def finish(process, timeout=300):
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stdout, stderr


@pytest.mark.slow
def test_killed_mid_epoch_then_resumed_equals_uninterrupted(tmp_path):
    """The resumed run starts while another process burns a CPU: a choice made by timing (once, the
    oneDNN policy) would differ under load and change the rounding between a run and its resume."""
    config = tmp_path / "run.yaml"
    config.write_text(load_config(None, OPTS).dump())
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    uninterrupted = train(config, whole)
    victim = train(config, killed)
    last = killed / "last.pth"
    deadline = time.monotonic() + 240
    while not last.exists():
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL

    state = torch.load(last, weights_only=True)
    assert state["epoch"] == 0 and state["step"] > 0, (state["epoch"], state["step"])  # killed mid-epoch
    print(f"killed after epoch {state['epoch']} + {state['step']} batches ({state['num_updates']} updates)")

    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _, log = finish(train(config, killed, "--resume", "auto"))
    finally:
        load.kill()
        load.wait()
    assert f"resumed from {last}: epoch 0, step {state['step']}" in log
    finish(uninterrupted)

    a = torch.load(whole / "last.pth", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert (a["epoch"], a["step"], a["num_updates"]) == (b["epoch"], b["step"], b["num_updates"]) == (2, 0, 44)
    for key in ("model", "model_ema", "optimizer", "lr_scheduler", "scaler", "max_accuracy", "max_accuracy_ema", "rng"):
        assert_same_tensors(a[key], b[key], key)
    # The epoch records match too (but for timings): the partial epoch's running totals were saved.
    strip = [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in a["history"]]
    assert strip == [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in b["history"]]
    assert [p.name for p in killed.iterdir() if p.name.endswith(".tmp")] == []
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


@pytest.mark.parametrize("resume", ["auto", "FILE"])
def test_resume_errors_are_one_line(tmp_path, capsys, resume):
    from polaformer.cli import main

    if resume == "auto":  # nothing to resume: starts from scratch (same command for every restart)
        code = main(["train", "--config", str(_tiny_config(tmp_path)), "--output", str(tmp_path / "o"),
                     "--resume", "auto"])
        assert code == 0 and (tmp_path / "o" / "last.pth").is_file()
        return
    code = main(["train", "--config", str(_tiny_config(tmp_path)), "--resume", str(tmp_path / "missing.pth")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"polaformer: error: checkpoint not found: {tmp_path / 'missing.pth'}"]


def _tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(load_config(None, [
        "DATA.DATASET", "digits", "MODEL.NAME", "pola_deit_digits", "MODEL.KWARGS", "{embed_dim: 16, depth: 1}",
        "DATA.BATCH_SIZE", "256", "DATA.NUM_WORKERS", "0", "TRAIN.EPOCHS", "1", "TRAIN.WARMUP_EPOCHS", "0",
        "DEVICE", "cpu",
    ]).dump())
    return path
