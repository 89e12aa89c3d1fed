"""Every task under ``torchrun --nproc_per_node=2`` on the CPU (Gloo), through its real command.

Each runs the public command line twice: 2 processes with batch b, and 1 process (in this process, one thread as
torchrun's) with batch 2b and the same seed; the weights and the evaluation metrics (computed by each process on
every K-th example and added up) agree, and only rank 0 writes the output folder and prints the summary line.
Super-resolution is in test_distributed_launch.py, whose multi-node and kill -9 tests reuse its runs.
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

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RUN_FILES = ["best.pth", "last.pth", "metrics.json", "metrics.jsonl"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def launch(argv: list[str], launcher: list[str] | None = None) -> subprocess.Popen:
    """``torchrun LAUNCHER -m polaformer ARGV`` (default: 2 processes on this node), one thread per process."""
    launcher = launcher or ["--nproc_per_node=2", f"--master_port={free_port()}"]
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "polaformer", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    return subprocess.CompletedProcess(process.args, 0, stdout, stderr)


def torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m polaformer ARGV``, one thread per process."""
    return finish(launch(argv))


def one_process(argv: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process: more threads sum in another order
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)


def weights(folder, part: str = "model") -> dict:
    return torch.load(folder / "last.pth", weights_only=True)[part]


def metrics(folder) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def history(folder) -> list[dict]:
    """The records of the run's evaluations (metrics.jsonl)."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_rank0_wrote(result: subprocess.CompletedProcess, root, summary: str) -> None:
    """The 2-process run into ``root/two``: one summary line, the run's files and nothing else, from rank 0."""
    lines = [line for line in result.stdout.splitlines() if line.startswith(summary)]
    assert len(lines) == 1 and str(root / "two") in lines[0], result.stdout
    assert sorted(p.name for p in root.iterdir()) == ["two"]
    assert sorted(p.name for p in (root / "two").iterdir()) == RUN_FILES
    assert torch.load(root / "two" / "last.pth", weights_only=True)["world_size"] == 2


def assert_same_training(two: dict, one: dict, lr_sum: float) -> None:
    """The weights of 2 processes x batch b against 1 process x 2b, the same data and draws per step.

    Their gradients differ only in the order the sums are added (each process's batch mean, averaged by DDP,
    against one mean over the whole batch): float rounding. Adam(W) divides each gradient element by its own
    magnitude, so where an element is a near-cancelling sum that rounding can move its update by up to the
    learning rate: all but 0.1% of the weights agree to 1e-5 (in practice all of them to about 1e-8), every one
    within Adam's bound (``lr_sum``, the rates of all updates, x1.5 for bias-corrected moments). Had the
    gradients not been averaged over the processes, most weights would be off by about the learning rate."""
    assert one.keys() == two.keys()
    far = sum((~torch.isclose(two[k], one[k], rtol=1e-4, atol=1e-5)).sum().item() for k in one)
    assert far <= 1e-3 * sum(v.numel() for v in one.values()), far
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1.5 * lr_sum)


def assert_same_scores(two: list[dict], one: list[dict], keys: tuple[str, ...]) -> None:
    """Metrics of every evaluation: the 2 processes score every other example each and add up, so the scores are
    those of one process up to the float rounding of weights and sums."""
    assert len(two) == len(one) > 0
    for a, b in zip(two, one):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


def test_detect_trains_under_torchrun(tmp_path, capsys):
    """Mask R-CNN (the default detector) trains on 2 processes; it used to fail on both ranks with "Every element
    of targets should have a masks key": the loss asked the DDP wrapper, not the detector, for its mask head.

    2 processes x 1 image cannot equal 1 x 2 images here: torchvision samples anchors and RoIs at random per image
    from the global generator (rank 1 draws from its own stream, one process draws its second image's after the
    first's), and its losses are means over the whole batch's samples (the mask loss over its positive RoIs), not
    means of per-image means. So this test checks the run and what it writes, not the weights against one
    process (a bound loose enough to hold, AdamW's per-step learning rate, could not fail). Its box and mask AP,
    from the detections of both processes gathered, are those one process gives its final weights."""
    common = ["detect", "train", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"), "--steps", "2",
              "--train-size", "4", "--val-size", "2", "--no-progress", "--device", "cpu"]
    result = torchrun([*common, "--batch-size", "1", "--output", str(tmp_path / "two")])
    summaries = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["step"] == 2, result.stdout
    assert "segm_AP" in json.loads(summaries[0])  # the mask head trained and was scored
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == RUN_FILES
    assert torch.load(tmp_path / "two" / "last.pth", weights_only=True)["world_size"] == 2
    one_process(["detect", "eval", "--checkpoint", str(tmp_path / "two" / "last.pth"), "--device", "cpu"])
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recorded = history(tmp_path / "two")[-1]
    assert {k: recorded[k] for k in scored} == scored


def test_lm_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """No dropout, the same windows per step (the engine's sampler) and per evaluation: ``train.eval_batches``
    counts batches of the global batch, so 2 processes x 4 score the same 2 x 8 windows as 1 x 8, each process every
    other one (see :func:`assert_same_training` for the tolerance)."""
    common = ["lm", "train", "--context", "16", "--steps", "2", "--max-bytes", "20000", "--eval-every", "2",
              "--device", "cpu", "--opts", "train.eval_batches", "2", "train.warmup_steps", "1"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "valid bits/byte:")

    one_process([*common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    lr_sum = 2 * 3e-3  # the default lr, both steps (1 warm-up step, then cosine from the peak)
    assert_same_training(weights(tmp_path / "two"), weights(tmp_path / "one"), lr_sum)
    assert_same_scores(history(tmp_path / "two"), history(tmp_path / "one"), ("train_bpb", "valid_bpb"))


def test_lra_two_processes_equal_one_with_the_same_global_batch(tmp_path_factory):
    """No dropout (``model.dropout 0``, ``model.attention_dropout 0``; with it each process draws its own masks);
    the dev batches are counted in global batches and split over the processes, and so is the test split the best
    weights are scored on at the end (after rank 0 wrote best.pth)."""
    from polaformer.tasks.lra.listops import generate_listops

    data = tmp_path_factory.mktemp("listops")
    generate_listops(data, train=32, val=16, test=12, min_length=10, max_length=30, max_depth=3, seed=0,
                     progress=False)
    root = tmp_path_factory.mktemp("lra")
    lr = 1e-2
    common = ["lra", "train", "--task", "listops", "--data", str(data), "--attention", "pola", "--steps", "3",
              "--eval-every", "3", "--lr", str(lr), "--device", "cpu", "--opts", "model.dim", "16",
              "model.hidden_dim", "32", "model.num_heads", "2", "model.head_dim", "8", "model.dropout", "0",
              "model.attention_dropout", "0", "train.eval_batches", "1"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(root / "two")])
    assert_rank0_wrote(result, root, "test accuracy:")

    one_process([*common, "--batch-size", "8", "--output", str(root / "one")])
    assert_same_training(weights(root / "two"), weights(root / "one"), 3 * lr)  # OneCycle peaks at lr
    two, one = metrics(root / "two"), metrics(root / "one")
    assert_same_scores(history(root / "two"), history(root / "one"),
                       ("train_loss", "train_accuracy", "dev_loss", "dev_accuracy"))
    assert (two["test_examples"], one["test_examples"]) == (12, 12)
    assert_same_scores([two], [one], ("test_loss", "test_accuracy"))


def test_segment_two_processes_equal_one_with_the_same_global_batch(tmp_path, capsys):
    """Semantic FPN on the digit scenes without its spatial dropout (``model.decoder_dropout 0``: each process would
    draw its own masks) and GroupNorm only (UPerNet's BatchNorm would see each process's half batch): the same
    computation as one process, at the paper's learning rate. mIoU and pixel accuracy count argmax pixels, which
    float rounding of the weights can flip: so the 2-process run's own scores, from the confusion matrices of both
    processes' images added up, are checked against one process scoring its final weights: exactly equal."""
    common = ["segment", "train", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"), "--steps", "2",
              "--train-size", "4", "--val-size", "3", "--lr", "2e-4", "--no-progress", "--device", "cpu",
              "--opts", "model.decoder_dropout", "0", "model.decoder_channels", "64", "train.warmup_steps", "0"]
    result = torchrun([*common, "--batch-size", "1", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "{")

    one_process([*common, "--batch-size", "2", "--output", str(tmp_path / "one")])
    assert_same_training(weights(tmp_path / "two"), weights(tmp_path / "one"), 2 * 2e-4)
    assert_same_scores(history(tmp_path / "two"), history(tmp_path / "one"), ("train_loss",))
    capsys.readouterr()
    one_process(["segment", "eval", "--checkpoint", str(tmp_path / "two" / "last.pth"), "--device", "cpu"])
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recorded = history(tmp_path / "two")[-1]
    assert (scored["mIoU"], scored["aAcc"]) == (recorded["mIoU"], recorded["aAcc"])


def test_diffusion_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """Each training image's step and noise come from (seed, epoch, index), the validation's are fixed per image,
    so both runs draw the same; the class dropout (drawn by the model, per process) is off. The EMA follows."""
    common = ["diffusion", "train", "--steps", "2", "--image-size", "8", "--eval-every", "2", "--device", "cpu",
              "--opts", "model.hidden_size", "16", "model.depth", "1", "model.num_heads", "2",
              "train.eval_samples", "15", "model.class_dropout_prob", "0"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "valid loss (EMA):")

    one_process([*common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    for part in ("model", "model_ema"):
        assert_same_training(weights(tmp_path / "two", part), weights(tmp_path / "one", part), 2 * 1e-3)
    assert_same_scores(history(tmp_path / "two"), history(tmp_path / "one"),
                       ("train_loss", "valid_loss", "valid_mse", "ema_valid_loss"))
