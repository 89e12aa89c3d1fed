"""Helpers of the multi-process tests (tests/engine/test_distributed*.py, test_fsdp.py): starting torchrun, the
one-process run they are compared with, and the comparisons, each with the bound its tolerance comes from
(:mod:`tolerances`)."""
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from polaformer.cli import main
from polaformer.engine.distributed import DistContext
from tolerances import adam_drift_bound, assert_trainings_agree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@contextmanager
def one_thread():
    """One thread, as each torchrun process (OMP_NUM_THREADS=1): more threads sum in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_process(argv: list[str]) -> None:
    with one_thread():
        assert main(argv) == 0


# What a task's evaluate() reads of its engine, for this one process alone.
ALONE = SimpleNamespace(ctx=DistContext(), device=torch.device("cpu"))


def checkpoint(folder, name: str = "last.pth") -> dict:
    return torch.load(folder / name, weights_only=True)


def weights(folder, part: str = "model") -> dict:
    return checkpoint(folder)[part]


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


def assert_same_training(two: dict, one: dict, peak_lr: float, part: str = "model") -> None:
    """The weights ``part`` of the checkpoints of 2 processes x batch b and 1 process x 2b, trained on the same
    examples and draws per step from the same initial weights, with Adam(W) at rates up to ``peak_lr``: their
    gradients differ only in the order their sums are added, so the weights agree as
    :func:`tolerances.assert_trainings_agree` says, within Adam's drift bound."""
    assert two["num_updates"] == one["num_updates"] > 0
    betas = tuple(one["optimizer"]["param_groups"][0]["betas"])
    assert_trainings_agree(two[part], one[part], adam_drift_bound([peak_lr] * one["num_updates"], betas))


def assert_same_first_step(two: list[dict], one: list[dict], key: str, rtol: float) -> None:
    """The training loss ``key`` of the first update (the first evaluation's, with eval_every 1): both runs
    computed it from the same initial weights on the same examples, so it agrees to the rounding of their sums
    (``rtol``, from :func:`tolerances.forward_rtol`); losses summed rather than averaged over the processes, or
    averaged with the wrong sample counts, move it by far more."""
    assert two[0]["step"] == one[0]["step"] == 1
    assert two[0][key] == pytest.approx(one[0][key], rel=rtol, abs=0), (key, two[0][key], one[0][key], rtol)


def assert_scored_alone(logged: dict, alone: dict, names: dict[str, str], rtol: float) -> None:
    """The 2-process run's logged scores (``logged[key]``, each process scoring every other example, the sums added
    up) against this one process's evaluation of the same weights (``alone[name]`` for ``names = {key: name}``):
    equal up to the rounding of their sums (``rtol``, from :func:`tolerances.forward_rtol`). Scores of two
    trainings' weights, which may differ by Adam's drift bound, have no such bound: a uint8 pixel or an argmax
    may flip."""
    for key, name in names.items():
        assert logged[key] == pytest.approx(alone[name], rel=rtol, abs=0), (key, logged[key], alone[name], rtol)


def scored_alone(task, model) -> dict:
    """``task.evaluate(model)`` by this one process (``task`` built as the 1-process run's configuration says, so
    that it scores the same examples), with one thread and the model placed as the engine places it (the CPU
    backend's fused modules)."""
    from polaformer.engine.device import place_model

    task.build(ALONE, resuming=True)  # the task's evaluation data for one process (the model it returns is unused)
    with one_thread():
        return task.evaluate(place_model(model, ALONE.device).eval(), ALONE)
