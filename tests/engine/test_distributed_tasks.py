"""Every task under ``torchrun --nproc_per_node=2`` on the CPU (Gloo), through its real command.

Each runs the public command line twice: 2 processes with batch b, and 1 process (in this process, one thread as
torchrun's) with batch 2b and the same seed; the weights and the evaluation metrics (computed by each process on
every K-th example and added up) agree, and only rank 0 writes the output folder and prints the summary line.
Super-resolution is in test_distributed_launch.py, whose multi-node and kill -9 tests reuse its runs.
"""
import json

import pytest
import torch

from dense_helpers import kwarg_flags
from distributed_helpers import (
    RUN_FILES,
    assert_rank0_wrote,
    assert_same_first_step,
    assert_same_training,
    assert_scored_alone,
    checkpoint,
    history,
    metrics,
    one_process,
    one_thread,
    scored_alone,
    torchrun,
)
from tolerances import forward_rtol

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


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


@pytest.mark.numerics
def test_lm_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """No dropout, the same windows per step (the engine's sampler) and per evaluation: ``train.eval_batches``
    counts batches of the global batch, so 2 processes x 4 score the same 2 x 8 windows as 1 x 8, each process every
    other one. The weights agree to Adam's drift bound, the first step's loss and the 2-process run's final
    validation score (against one process scoring its final weights) to rounding."""
    from polaformer.tasks.lm import LMTask, load_lm_model

    common = ["lm", "train", "--context", "16", "--steps", "2", "--max-bytes", "20000", "--eval-every", "1",
              "--device", "cpu", "--opts", "train.eval_batches", "2", "train.warmup_steps", "1"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "valid bits/byte:")

    one_process([*common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    assert_same_training(checkpoint(tmp_path / "two"), checkpoint(tmp_path / "one"), 3e-3)  # the default peak lr
    # pola_lm_tiny: 2 blocks of 6 reductions of at most 256 terms (64 features, its 256-wide MLP, 16 tokens), the
    # cross-entropy's log-sum-exp over 256 bytes and the mean over at most 16 windows x 16 positions
    rtol = forward_rtol([256] * 12 + [256, 16 * 16])
    assert_same_first_step(history(tmp_path / "two"), history(tmp_path / "one"), "train_bpb", rtol)
    model, _ = load_lm_model(tmp_path / "two" / "last.pth")
    _, cfg = load_lm_model(tmp_path / "one" / "last.pth")  # the 1-process run's batch: the same 16 windows
    assert_scored_alone(history(tmp_path / "two")[-1], scored_alone(LMTask(cfg), model),
                        {"valid_bpb": "bits_per_byte"}, rtol)


@pytest.mark.numerics
def test_lra_two_processes_equal_one_with_the_same_global_batch(tmp_path_factory):
    """No dropout (``model.dropout 0``, ``model.attention_dropout 0``; with it each process draws its own masks);
    the dev batches are counted in global batches and split over the processes, and so is the test split the best
    weights are scored on at the end (after rank 0 wrote best.pth). Accuracies count argmax predictions: rounding
    changes one only where two logits lie within it of each other."""
    from torch.utils.data import DataLoader

    from polaformer.engine.device import place_model
    from polaformer.tasks.lra.data import collate_lra, load_lra_split
    from polaformer.tasks.lra.listops import generate_listops
    from polaformer.tasks.lra.train import evaluate_lra, load_lra_model

    data = tmp_path_factory.mktemp("listops")
    generate_listops(data, train=32, val=16, test=12, min_length=10, max_length=30, max_depth=3, seed=0,
                     progress=False)
    root = tmp_path_factory.mktemp("lra")
    lr = 1e-2
    common = ["lra", "train", "--task", "listops", "--data", str(data), "--attention", "pola", "--steps", "3",
              "--eval-every", "1", "--lr", str(lr), "--device", "cpu", "--opts", "model.dim", "16",
              "model.hidden_dim", "32", "model.num_heads", "2", "model.head_dim", "8", "model.dropout", "0",
              "model.attention_dropout", "0", "train.eval_batches", "1"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(root / "two")])
    assert_rank0_wrote(result, root, "test accuracy:")

    one_process([*common, "--batch-size", "8", "--output", str(root / "one")])
    assert_same_training(checkpoint(root / "two"), checkpoint(root / "one"), lr)  # OneCycle peaks at lr
    # 2 blocks of 6 reductions of at most 32 terms (16 and 32 features, sequences of at most 32 tokens), the mean
    # pooling and the head, the log-sum-exp over 10 classes and the mean over at most 12 examples
    rtol = forward_rtol([32] * 16 + [10, 12])
    assert_same_first_step(history(root / "two"), history(root / "one"), "train_loss", rtol)

    def alone(name: str, split: str, limit: int | None = None) -> dict:
        model, _ = load_lra_model(root / "two" / name)
        loader = DataLoader(load_lra_split("listops", data, split, limit=limit), batch_size=8, collate_fn=collate_lra)
        with one_thread():
            return evaluate_lra(place_model(model, torch.device("cpu")), loader)

    scores = ("loss", "accuracy")
    assert_scored_alone(history(root / "two")[-1], alone("last.pth", "dev", limit=8),
                        {f"dev_{key}": key for key in scores}, rtol)  # train.eval_batches 1: 8 examples
    two = metrics(root / "two")
    assert two["test_examples"] == 12
    assert_scored_alone(two, alone("best.pth", "test"), {f"test_{key}": key for key in scores}, rtol)


@pytest.mark.numerics
def test_segment_two_processes_equal_one_with_the_same_global_batch(tmp_path, capsys):
    """Semantic FPN on the digit scenes without its spatial dropout (``model.decoder_dropout 0``: each process would
    draw its own masks) and GroupNorm only (UPerNet's BatchNorm would see each process's half batch): the same
    computation as one process, at the paper's learning rate. mIoU and pixel accuracy count argmax pixels, which
    float rounding of the weights can flip: so the 2-process run's own scores, from the confusion matrices of both
    processes' images added up, are checked against one process scoring its final weights: exactly equal."""
    common = ["segment", "train", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"), "--steps", "2",
              "--eval-every", "1", "--train-size", "4", "--val-size", "3", "--lr", "2e-4", "--no-progress",
              "--device", "cpu", "--opts", "model.decoder_dropout", "0", "model.decoder_channels", "64",
              "train.warmup_steps", "0"]
    result = torchrun([*common, "--batch-size", "1", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "{")

    one_process([*common, "--batch-size", "2", "--output", str(tmp_path / "one")])
    assert_same_training(checkpoint(tmp_path / "two"), checkpoint(tmp_path / "one"), 2e-4)
    # about 40 convs and linears of at most 576 terms (3x3 convs over 64 channels) and 8 attention sums over at most
    # 64 keys, then the cross-entropy's mean over 2 x 128 x 128 pixels
    rtol = forward_rtol([576] * 48 + [2 * 128 * 128])
    assert_same_first_step(history(tmp_path / "two"), history(tmp_path / "one"), "train_loss", rtol)
    capsys.readouterr()
    one_process(["segment", "eval", "--checkpoint", str(tmp_path / "two" / "last.pth"), "--device", "cpu"])
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recorded = history(tmp_path / "two")[-1]
    assert (scored["mIoU"], scored["aAcc"]) == (recorded["mIoU"], recorded["aAcc"])


@pytest.mark.numerics
def test_diffusion_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    """Each training image's step and noise come from (seed, epoch, index), the validation's are fixed per image,
    so both runs draw the same; the class dropout (drawn by the model, per process) is off. The EMA follows."""
    from polaformer.tasks.diffusion import DiffusionTask, load_diffusion_model

    common = ["diffusion", "train", "--steps", "2", "--image-size", "8", "--eval-every", "1", "--device", "cpu",
              "--opts", "model.hidden_size", "16", "model.depth", "1", "model.num_heads", "2",
              "train.eval_samples", "15", "model.class_dropout_prob", "0"]
    result = torchrun([*common, "--batch-size", "4", "--output", str(tmp_path / "two")])
    assert_rank0_wrote(result, tmp_path, "valid loss (EMA):")

    one_process([*common, "--batch-size", "8", "--output", str(tmp_path / "one")])
    two, one = checkpoint(tmp_path / "two"), checkpoint(tmp_path / "one")
    for part in ("model", "model_ema"):
        assert_same_training(two, one, 1e-3, part)  # the default lr
    # 14 reductions of at most 256 terms (the timestep embedding's 256 frequencies, 16 features, its 64-wide MLP,
    # 16 tokens), the loss's mean over 2 x 8 x 8 outputs and over at most 15 images
    rtol = forward_rtol([256] * 14 + [2 * 8 * 8, 15])
    assert_same_first_step(history(tmp_path / "two"), history(tmp_path / "one"), "train_loss", rtol)
    logged = history(tmp_path / "two")[-1]
    for ema, names in ((False, {"valid_loss": "loss", "valid_mse": "mse"}), (True, {"ema_valid_loss": "loss"})):
        model, cfg, _ = load_diffusion_model(tmp_path / "two" / "last.pth", ema=ema)
        assert_scored_alone(logged, scored_alone(DiffusionTask(cfg), model), names, rtol)
