"""How runs are launched and restarted under torchrun, on super-resolution (a fast step-based task): 2 processes
against 1, two torchrun agents meeting at a c10d rendezvous on 127.0.0.1 (two "nodes" on one machine), and a rank
killed with SIGKILL then resumed with ``--resume auto``. The last two are compared bit for bit with the same
2-process run (built once, as a module fixture, to start as few process groups as possible)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from distributed_helpers import (
    RUN_FILES,
    assert_rank0_wrote,
    assert_same_first_step,
    assert_same_training,
    assert_scored_alone,
    checkpoint,
    finish,
    free_port,
    history,
    launch,
    one_process,
    scored_alone,
    torchrun,
    weights,
)
from tolerances import assert_same_tensors, forward_rtol

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# an evaluation (and so a last.pth) after every step, for the kill -9 test
SR_STEPS = 4


def sr_command(data: Path, batch_size: int, output: Path) -> list[str]:
    return ["sr", "train", "--scale", "2", "--train-hr", str(data), "--valid-hr", str(data), "--patch-size", "16",
            "--steps", str(SR_STEPS), "--eval-every", "1", "--batch-size", str(batch_size), "--device", "cpu",
            "--output", str(output), "--opts", "model.embed_dim", "8", "model.depths", "[1]", "model.num_heads",
            "[2]", "model.window_size", "8", "data.repeats", "4"]


@pytest.fixture(scope="module")
def sr_runs(tmp_path_factory):
    """``(data, root)``: root/two trained by 2 processes x batch 2, root/one by 1 process x 4."""
    from PIL import Image

    from polaformer.tasks.sr.data import embedded_photo

    data = tmp_path_factory.mktemp("hr")
    for i, name in enumerate(("astronaut", "coffee", "rocket")):  # 40 x 56 crops: 3 validation images
        photo = embedded_photo(name)
        top, left = (photo.shape[1] - 40) // 2, (photo.shape[2] - 56) // 2
        Image.fromarray(photo[:, top:top + 40, left:left + 56].permute(1, 2, 0).numpy()).save(data / f"{i}.png")
    root = tmp_path_factory.mktemp("sr")
    result = torchrun(sr_command(data, 2, root / "two"))
    assert_rank0_wrote(result, root, "valid PSNR-Y")
    one_process(sr_command(data, 4, root / "one"))
    return data, root


@pytest.mark.numerics
def test_sr_two_processes_equal_one_with_the_same_global_batch(sr_runs):
    """The random patches come from (seed, epoch, index): the same crops and flips per step. The weights agree to
    Adam's drift bound, the first step's L1 loss (same initial weights) to rounding; the PSNR-Y and SSIM-Y the 2
    processes logged (each scoring every other image, the scores gathered) are those one process gives their
    final weights. Each image is scored alone (batch 1), by the same kernels at the same shapes with one thread,
    and the means add in one order: the scores are equal. (Scores of the two trainings' weights have no bound:
    their output rounds to uint8, where a weight's last bits can flip a pixel.)"""
    from polaformer.tasks.sr import SRTask, load_sr_model

    _, root = sr_runs
    assert_same_training(checkpoint(root / "two"), checkpoint(root / "one"), 2e-4)  # the default lr
    # the model's ~30 reductions of at most 72 terms (3x3 convs of 8 channels, windows of 64 tokens), then the
    # L1 mean over 4 x 3 x 16 x 16 values
    rtol = forward_rtol([72] * 30 + [4 * 3 * 16 * 16])
    assert_same_first_step(history(root / "two"), history(root / "one"), "train_l1", rtol)
    model, cfg = load_sr_model(root / "two" / "last.pth")
    assert_scored_alone(history(root / "two")[-1], scored_alone(SRTask(cfg), model), {"psnr_y": "psnr_y",
                                                                                        "ssim_y": "ssim_y"}, rtol=0)


def test_two_nodes_train_as_two_processes_of_one_node(sr_runs, tmp_path):
    """``torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`` twice, as two
    machines would run it (one output folder, shared): the same 2 ranks as one node's 2 processes, so the same
    weights bit for bit, and only the agent holding rank 0 writes."""
    data, root = sr_runs
    output = tmp_path / "two"
    port = free_port()
    nodes = [launch(sr_command(data, 2, output), ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                                  f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=polaformer-test"])
             for _ in range(2)]
    results = [finish(node) for node in nodes]
    summaries = [line for r in results for line in r.stdout.splitlines() if line.startswith("valid PSNR-Y")]
    assert len(summaries) == 1, [r.stdout for r in results]
    assert sorted(p.name for p in output.iterdir()) == RUN_FILES
    assert_same_tensors(weights(output), weights(root / "two"), "model")
    assert history(output)[-1]["psnr_y"] == history(root / "two")[-1]["psnr_y"]


def _rank_processes(agent: subprocess.Popen) -> dict[int, int]:
    """``{rank: pid}`` of the workers a torchrun agent started (Linux: their parent and environment)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == agent.pid:
            rank = [v[5:] for v in environ if v.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0])] = int(entry.name)
    return ranks


def test_rank_killed_then_resumed_equals_uninterrupted(sr_runs, tmp_path):
    """kill -9 of rank 1 once the first checkpoint has landed: torchrun stops rank 0 too. The same command with
    ``--resume auto`` continues from last.pth (rank 0's weights, every process's random states and data position)
    and ends bit-identical to the uninterrupted 2-process run."""
    data, root = sr_runs
    output = tmp_path / "two"
    victim = launch(sr_command(data, 2, output))
    last = output / "last.pth"
    deadline = time.monotonic() + 240
    while not last.exists():
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    os.kill(_rank_processes(victim)[1], signal.SIGKILL)
    victim.communicate(timeout=120)
    assert victim.returncode != 0
    state = torch.load(last, weights_only=True)
    assert 1 <= state["num_updates"] < SR_STEPS, state["num_updates"]  # killed mid-run

    result = torchrun([*sr_command(data, 2, output), "--resume", "auto"])
    assert f"resumed from {last}" in result.stderr
    a, b = (torch.load(folder / "last.pth", weights_only=True) for folder in (root / "two", output))
    assert a["num_updates"] == b["num_updates"] == SR_STEPS
    for key in ("model", "optimizer", "lr_scheduler", "rng"):
        assert_same_tensors(a[key], b[key], key)
    timings = {"elapsed_s"}
    assert ([{k: v for k, v in r.items() if k not in timings} for r in a["history"]]
            == [{k: v for k, v in r.items() if k not in timings} for r in b["history"]])
