"""DDP on the CPU (Gloo): two processes train like one process with the same global batch.

Digits with a tiny model, no augmentation, no dropout/drop path: the only difference between
two processes of batch 16 and one of batch 32 is the order in which the gradient sums are added,
so the weights agree to Adam's drift bound (distributed_helpers.assert_same_training). The same run
also goes through the real command line under torchrun.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import REPO
from distributed_helpers import assert_same_training, assert_scored_alone, free_port, one_thread
from polaformer.engine.optim import unwrap
from polaformer.tasks.classification import build_trainer, evaluate_checkpoint, load_config, run_training
from tolerances import forward_rtol

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PER_PROCESS_BATCH = 16
OPTS = [
    "DATA.DATASET", "digits", "MODEL.NAME", "vit_tiny_patch16_224",
    "MODEL.KWARGS", "{patch_size: 2, embed_dim: 16, depth: 1, num_heads: 1}",
    "MODEL.DROP_PATH_RATE", "0", "AUG.DIGITS_SHIFT", "false", "DATA.NUM_WORKERS", "0",
    "TRAIN.EPOCHS", "1", "TRAIN.WARMUP_EPOCHS", "0", "TRAIN.BASE_LR", "2e-3", "TRAIN.CLIP_GRAD", "1.0",
    "TEST.BATCH_SIZE", "90", "DEVICE", "cpu", "SEED", "3", "TRAIN.EMA.ENABLE", "true", "TRAIN.EMA.DECAY", "0.99",
]


def _worker(rank: int, world_size: int, port: int, opts: list, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1
    trainer = build_trainer(load_config(None, opts))
    trainer.fit()
    torch.save({"model": unwrap(trainer.model).state_dict(), "ema": trainer.model_ema.module.state_dict()},
               Path(folder) / f"rank{rank}.pt")
    trainer.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training as 2 processes x batch 16 (spawned, and through torchrun) and 1 x 32."""
    root = tmp_path_factory.mktemp("ddp")
    start = time.perf_counter()
    opts = [*OPTS, "DATA.BATCH_SIZE", str(PER_PROCESS_BATCH), "OUTPUT", str(root / "spawn")]
    mp.spawn(_worker, args=(2, free_port(), opts, str(root)), nprocs=2, join=True)
    spawn_time = time.perf_counter() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = run_training(load_config(None, [*OPTS, "DATA.BATCH_SIZE", str(2 * PER_PROCESS_BATCH),
                                                 "OUTPUT", str(root / "single")]))
    finally:
        torch.set_num_threads(threads)
    return root, single, spawn_time


def test_both_processes_end_with_identical_weights(runs):
    root, _, spawn_time = runs
    rank0, rank1 = (torch.load(root / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for part in ("model", "ema"):  # each process initialised its own model (seed + rank): DDP and EMA agree
        assert all(torch.equal(rank0[part][k], rank1[part][k]) for k in rank0[part]), part
    written = torch.load(root / "spawn" / "last.pth", weights_only=True)
    assert all(torch.equal(written["model"][k], rank0["model"][k]) for k in rank0["model"])
    assert all(torch.equal(written["model_ema"][k], rank0["ema"][k]) for k in rank0["ema"])
    assert written["world_size"] == 2 and len(written["rng"]) == 2
    print(f"2-process run (spawn, 1 epoch): {spawn_time:.1f}s")


@pytest.mark.numerics
def test_two_processes_equal_one_with_the_same_global_batch(runs):
    """The weights (and the EMA's) agree to Adam's drift bound. The test metrics are reduced over the processes,
    every test image counted once: they are those one process gives the 2-process run's final weights, to rounding
    (the top-1 counts argmax predictions: rounding flips one only where two logits lie within it of each other).
    The training loss is a mean over the epoch's 44 updates, whose weights differ by the drift bound: it has no
    bound of its own and is not compared."""
    root, single, _ = runs
    two = json.loads((root / "spawn" / "metrics.json").read_text())
    assert (two["global_batch_size"], single["global_batch_size"]) == (32, 32)
    assert two["epochs"][0]["num_updates"] == single["epochs"][0]["num_updates"] == 1437 // 32
    spawned, alone = (torch.load(root / run / "last.pth", weights_only=True) for run in ("spawn", "single"))
    for part in ("model", "model_ema"):
        assert_same_training(spawned, alone, 2e-3 * 32 / 512, part)  # BASE_LR per 512 images, one cosine
    with one_thread():
        scored, _ = evaluate_checkpoint(root / "spawn" / "last.pth", data="digits", device="cpu")
    # ViT of one block: reductions of at most 64 terms (16 features, its 64-wide MLP, 17 tokens), the
    # log-sum-exp over 10 classes and the mean over the 360 test images
    rtol = forward_rtol([64] * 8 + [10, 360])
    assert_scored_alone(two["epochs"][0], scored, {"test_loss": "loss", "test_top1": "top1"}, rtol)


def test_torchrun_command_line(runs, tmp_path):
    """`torchrun --nproc_per_node=2 -m polaformer train --config ...`: rank 0 writes, one summary line."""
    root, _, _ = runs
    config = tmp_path / "ddp.yaml"
    config.write_text(load_config(None, [*OPTS, "DATA.BATCH_SIZE", str(PER_PROCESS_BATCH)]).dump())
    output = tmp_path / "out"
    # One thread per process, as the spawned workers it is compared with bit for bit: torchrun sets
    # OMP_NUM_THREADS=1 only when the variable is unset, and more threads sum in another order.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "-m", "polaformer", "train", "--config", str(config), "--output", str(output)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("best top-1:")]
    assert len(summary) == 1 and summary[0].endswith(f"-> {output}"), result.stdout
    assert sorted(p.name for p in output.iterdir()) == ["best.pth", "best_ema.pth", "last.pth", "metrics.json",
                                                        "metrics.jsonl"]
    assert json.loads((output / "metrics.json").read_text())["world_size"] == 2
    # Same computation as the spawned processes: the same weights, bit for bit.
    spawned = torch.load(root / "rank0.pt", weights_only=True)["model"]
    written = torch.load(output / "last.pth", weights_only=True)["model"]
    assert all(torch.equal(written[k], spawned[k]) for k in spawned)

