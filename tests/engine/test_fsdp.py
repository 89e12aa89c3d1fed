"""``train.parallel: fsdp`` (PyTorch's FSDP2 ``fully_shard``) on the CPU with Gloo: a tiny PolaDiT trains 2 steps on 2
processes, writes a sharded checkpoint (``torch.distributed.checkpoint``), resumes on 1 process for a third step, and
ends where the same run with DDP ends; its checkpoint becomes one file that the plain model loads strictly."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed_helpers import free_port
from polaformer.cli import main
from polaformer.engine.parallel import blocks
from polaformer.tasks.diffusion.train import load_diffusion_model
from tolerances import adam_drift_bound, assert_trainings_agree

RUN = ["diffusion", "train", "--batch-size", "4", "--image-size", "8", "--eval-every", "2", "--device", "cpu"]
TINY = ["--opts", "model.hidden_size", "16", "model.depth", "2", "model.num_heads", "2", "train.eval_samples", "8"]


def _two_processes(rank: int, port: int, root: str) -> None:
    """Both 2-step runs in one process group (one start of the processes for the two)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for parallel in ("fsdp", "ddp"):
            code = main([*RUN, "--steps", "2", "--output", f"{root}/{parallel}", *TINY, "train.parallel", parallel])
            assert code == 0
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fsdp and ddp: 2 steps on 2 processes x batch 4, then a third step on 1 process x batch 4 (``--resume``)."""
    root = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_two_processes, args=(free_port(), str(root)), nprocs=2, join=True)
    written = {}
    for parallel in ("fsdp", "ddp"):
        written[parallel] = sorted(p.name for p in (root / parallel).iterdir())
    shards = [p for p in (root / "fsdp").iterdir() if p.suffix == ".dcp"]
    written["shard_files"] = sorted(p.name for p in shards[0].iterdir()) if len(shards) == 1 else []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned process
    try:
        for parallel in ("fsdp", "ddp"):
            assert main([*RUN, "--steps", "3", "--resume", "auto", "--output", str(root / parallel), *TINY,
                         "train.parallel", parallel]) == 0
    finally:
        torch.set_num_threads(threads)
    return root, written


@pytest.mark.slow
def test_two_processes_write_a_sharded_checkpoint(runs):
    _, written = runs
    folders = [name for name in written["fsdp"] if name.endswith(".dcp")]
    assert len(folders) == 1 and folders[0].startswith("state-2-"), written["fsdp"]
    assert {"best.pth", "last.pth", "metrics.json"} <= set(written["fsdp"])
    assert [name for name in written["shard_files"] if name.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert not [name for name in written["ddp"] if name.endswith(".dcp")]  # ddp writes single files
    last = torch.load(runs[0] / "fsdp" / "last.pth", weights_only=True)
    assert "model" not in last and "optimizer" not in last and last["sharded"].startswith("state-3-")
    assert last["world_size"] == 1 and last["num_updates"] == 3


@pytest.mark.slow
def test_resumed_on_one_process_it_ends_as_ddp_does_and_consolidates(runs, tmp_path):
    """The two chains differ only in how the gradients are summed: FSDP reduce-scatters each rank's shard of the
    gradient and clips with a norm summed from shards, DDP all-reduces whole buckets, so the float32 sums round
    differently. AdamW divides each gradient by its running magnitude, so where a gradient element is a near-cancelling
    sum the rounding can move its update by up to the learning rate (1e-3): the weights agree as two trainings that
    differ by rounding do (tolerances.assert_trainings_agree, the drift bound of 3 AdamW steps)."""
    root, _ = runs
    single = tmp_path / "fsdp.pth"
    assert main(["checkpoint", "consolidate", str(root / "fsdp" / "last.pth"), str(single)]) == 0
    fsdp = torch.load(single, weights_only=True)
    ddp = torch.load(root / "ddp" / "last.pth", weights_only=True)
    assert fsdp["num_updates"] == ddp["num_updates"] == 3
    for part in ("model", "model_ema"):
        assert fsdp[part].keys() == ddp[part].keys()
        worst = max((fsdp[part][k] - ddp[part][k]).abs().max().item() for k in ddp[part])
        print(f"max |fsdp - ddp| over the {part} weights after 3 steps: {worst:.2e}")
        betas = tuple(ddp["optimizer"]["param_groups"][0]["betas"])
        assert_trainings_agree(fsdp[part], ddp[part], adam_drift_bound([1e-3] * 3, betas))
    # the optimizer state is numbered as Optimizer.state_dict() numbers it: it loads into the plain run's optimizer
    assert fsdp["optimizer"]["param_groups"][0]["params"] == ddp["optimizer"]["param_groups"][0]["params"]
    for index, state in ddp["optimizer"]["state"].items():
        torch.testing.assert_close(fsdp["optimizer"]["state"][index]["step"], state["step"])
    model, _, _ = load_diffusion_model(single, ema=False)  # strict: every key and shape of the plain model
    assert all(torch.equal(model.state_dict()[k], fsdp["model"][k]) for k in fsdp["model"])


@pytest.mark.slow
def test_consolidated_checkpoint_resumes_and_loaders_refuse_the_sharded_file(runs, tmp_path, capsys):
    root, _ = runs
    single = tmp_path / "run" / "last.pth"
    assert main(["checkpoint", "consolidate", str(root / "fsdp" / "last.pth"), str(single)]) == 0
    assert main(["checkpoint", "consolidate", str(root / "fsdp" / "last.pth"), str(single)]) == 2
    assert "already exists" in capsys.readouterr().err
    # parallel: ddp now (the default): a resumed run may change how it runs
    assert main([*RUN, "--steps", "4", "--resume", str(single), "--output", str(tmp_path / "run"), *TINY]) == 0
    with pytest.raises(Exception, match="sharded checkpoint .*consolidate"):
        load_diffusion_model(root / "fsdp" / "last.pth")


def test_blocks_are_the_innermost_block_lists():
    import timm

    import polaformer.models  # noqa: F401  (registers the families)

    dit = timm.create_model("pola_dit_s_2", input_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=16,
                            num_heads=2)
    assert blocks(dit) == list(dit.blocks)
    swin = timm.create_model("pola_swin_t", depths=(1, 1, 2, 1), embed_dim=16, num_heads=(1, 2, 2, 4))
    assert blocks(swin) == [b for stage in swin.layers for b in stage.blocks]


def test_classification_continues_a_sharded_run_with_ddp(tmp_path, capsys):
    """One process with ``fsdp`` trains the plain model but writes sharded checkpoints (the official key tree:
    ``TRAIN.PARALLEL``); the run continues with ``ddp``, and ``eval`` names the command that makes the file whole."""
    run = ["train", "--model", "pola_deit_digits", "--batch-size", "512", "--device", "cpu", "--output", str(tmp_path)]
    assert main([*run, "--epochs", "1", "--opts", "TRAIN.PARALLEL", "fsdp"]) == 0
    first = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert "model" not in first and (tmp_path / first["sharded"]).is_dir()
    assert main(["eval", "--checkpoint", str(tmp_path / "checkpoint.pth")]) == 2
    assert "'polaformer checkpoint consolidate' makes it one file" in capsys.readouterr().err
    assert main([*run, "--epochs", "2", "--resume", "auto"]) == 0
    last = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert last["epoch"] == 2 and "model" in last and "sharded" not in last
