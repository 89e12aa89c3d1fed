"""The step-based tasks under ``torchrun --nproc_per_node=2`` on the CPU (Gloo), through their real commands.

Each runs the public command line twice: 2 processes with batch b, and 1 process (in this process, one thread as
torchrun's) with batch 2b and the same seed. Only rank 0 writes the output folder and prints the summary line.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from polaformer.cli import main
from conftest import REPO
from dense_helpers import kwarg_flags
from test_distributed import free_port

RUN_FILES = ["best.pth", "last.pth", "metrics.json", "metrics.jsonl"]


def torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m polaformer ARGV``, one thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "-m", "polaformer", *argv], capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_process(argv: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: more threads sum in another order
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)


def weights(folder) -> dict:
    return torch.load(folder / "last.pth", weights_only=True)["model"]


def test_detect_trains_under_torchrun(tmp_path):
    """Mask R-CNN (the default detector) trains on 2 processes; it used to fail on both ranks with "Every element
    of targets should have a masks key": the loss asked the DDP wrapper, not the detector, for its mask head.

    2 processes x 1 image cannot equal 1 x 2 images here: torchvision samples anchors and RoIs at random per image
    from the global generator (rank 1 draws from its own stream, one process draws its second image's after the
    first's), and its losses are means over the whole batch's samples (the mask loss over its positive RoIs), not
    means of per-image means. So this test checks the run and what it writes, not the weights against one
    process (a bound loose enough to hold, AdamW's per-step learning rate, could not fail)."""
    common = ["detect", "train", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"), "--steps", "2",
              "--train-size", "4", "--val-size", "2", "--no-progress", "--device", "cpu"]
    result = torchrun([*common, "--batch-size", "1", "--output", str(tmp_path / "two")])
    summaries = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["step"] == 2, result.stdout
    assert "segm_AP" in json.loads(summaries[0])  # the mask head trained and was scored
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == RUN_FILES
    assert torch.load(tmp_path / "two" / "last.pth", weights_only=True)["world_size"] == 2


def test_lm_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """No dropout, the same windows per step (the engine's sampler): the gradients differ only by the order in which
    the sums are added (2 half-batch means averaged by DDP against one mean), float rounding. AdamW divides each
    gradient by its own magnitude, so where a gradient element is a near-cancelling sum that rounding can move its
    update by up to the learning rate: all but 0.1% of the weights agree to 1e-5 (in practice all but one element,
    off by 3e-5), every one within AdamW's bound (a step moves a weight by at most about its learning rate, x1.5 for
    bias-corrected moments over 2 steps)."""
    common = ["lm", "train", "--context", "16", "--steps", "2", "--max-bytes", "20000", "--eval-every", "2",
              "--device", "cpu", "--opts", "train.eval_batches", "0", "train.warmup_steps", "1"]  # 0: every
    # validation window (a count of batches would cover twice as many windows in one process with batch 2b)
    result = torchrun([*common, "--batch-size", "4", "--output", str(tmp_path / "two")])
    assert sum(line.startswith("valid bits/byte:") for line in result.stdout.splitlines()) == 1, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == RUN_FILES
    assert torch.load(tmp_path / "two" / "last.pth", weights_only=True)["world_size"] == 2

    one_process([*common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    two, one = weights(tmp_path / "two"), weights(tmp_path / "one")
    lr_sum = 2 * 3e-3  # the default lr, both steps (1 warm-up step, then cosine from the peak)
    far = sum((~torch.isclose(two[k], one[k], rtol=1e-4, atol=1e-5)).sum().item() for k in one)
    assert far <= 1e-3 * sum(v.numel() for v in one.values()), far
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=2 * 1.5 * lr_sum)
    two_bpb, one_bpb = (json.loads((tmp_path / run / "metrics.json").read_text())["best_valid_bpb"]
                        for run in ("two", "one"))
    assert two_bpb == pytest.approx(one_bpb, rel=1e-4)
