"""The command line answers at once (issue 51): ``polaformer --help``, every subcommand's ``--help`` and every
argument error come back without importing torch, timm or a model; a command that runs imports them after parsing,
where Ctrl-C is still one line (test_cli_errors.py). The argument choices the parser knows without the runtime are
those of the registries the commands run on. benchmarks/bench_startup.py measures the time."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from conftest import REPO
from polaformer.cli import build_parser, classification as cli_classification

HEAVY = ("torch", "timm", "polaformer.models", "torchvision")


def _env():
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _subcommands(parser: argparse.ArgumentParser, prefix=()) -> list[tuple[str, ...]]:
    """Every command path of the parser: ('train',), ('lm', 'train'), ('bench', 'gpu'), ..."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found += _subcommands(sub, (*prefix, name))
    return found


COMMANDS = _subcommands(build_parser())


def test_the_command_walk_finds_every_command():
    assert {("train",), ("lm", "sample"), ("bench", "gpu"), ("lra", "bench"), ("checkpoint", "consolidate"),
            ("convert", "demo"), ("data", "shard")} <= set(COMMANDS)
    assert len(COMMANDS) >= 40


def test_help_imports_no_torch_through_the_real_entry_point():
    """``python -m polaformer --help`` as a user runs it, its imports listed by ``-X importtime``."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "polaformer", "--help"], capture_output=True,
                            text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: polaformer" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "import time:" in line]
    assert "polaformer.cli" in imported  # the listing is read right
    assert [name for name in imported if name.split(".")[0] in HEAVY or name in HEAVY] == []


# Run in one child process that imports the package as the console script does (sys.argv[0] is the command's
# path; another import of the package loads the runtime at once): each argv through polaformer.cli.main, then
# which heavy modules are loaded.
_CHILD = """
import json, sys
sys.argv[0] = "/usr/local/bin/polaformer"
from polaformer.cli import main
heavy = {heavy!r}
results = []
for argv in json.loads(sys.stdin.read()):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    results.append([argv, code, sorted(m for m in sys.modules if m in heavy or m.split(".")[0] in heavy)])
print(json.dumps(results))
"""


def _run_child(argvs):
    result = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY)], input=json.dumps(argvs),
                            capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


ARGUMENT_ERRORS = [
    ["train", "--epochs", "many"],  # a type's refusal
    ["train", "--data", "nope"],  # a choice
    ["train", "--model", ""],  # an empty value
    ["train", "--epoch", "3"],  # no abbreviations
    ["eval"],  # a required option missing
    ["lm"],  # a command group without its command
    ["lm", "sample", "--checkpoint", "x.pth", "--prompt", ""],
    ["lra", "train", "--data", "d", "--task", "nope"],
    ["detect", "train", "--backbone-kwarg", "depth"],  # not KEY=VALUE
    ["segment", "train", "--decoder", "nope"],
    ["bench", "gpu"],  # --out required
    ["nope"],
]


def test_every_help_and_argument_error_imports_no_torch():
    """Every subcommand's --help (status 0) and an unknown option of each, plus the argument errors above (status
    2), in one process: none loads torch, timm, torchvision or a model."""
    argvs = [["--help"], ["--version"]] + [[*command, "--help"] for command in COMMANDS]
    argvs += [[*command, "--no-such-option"] for command in COMMANDS] + ARGUMENT_ERRORS
    results, stderr = _run_child(argvs)
    assert len(results) == len(argvs)
    for argv, code, heavy in results:
        expected = 0 if argv[-1] in ("--help", "--version") else 2
        assert (code, heavy) == (expected, []), (argv, stderr[-2000:])
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == len(argvs) - 2 - len(COMMANDS)  # one line per argument error


def test_a_command_that_runs_imports_the_runtime_after_parsing():
    """The control: a command that gets past its arguments does import torch (so the test above can fail)."""
    results, _ = _run_child([["lra", "generate", "listops", "--out", str(REPO / "no" / "such"), "--min-length", "9",
                              "--max-length", "5"]])
    (_, code, heavy), = results
    assert code == 2 and "torch" in heavy


def test_the_static_choices_are_the_registries():
    """Choices and defaults the parser shows without importing the runtime, against the registries the commands
    run on."""
    from polaformer.data import DATASETS, DEFAULT_DATA
    from polaformer.models import pola_dit, pola_lm
    from polaformer.tasks.classification import DEFAULT_MODEL
    from polaformer.tasks.classification.evaluation import DEFAULT_EVAL_BATCH_SIZE
    from polaformer.tasks.dense.detection import DETECTORS
    from polaformer.tasks.dense.segmentation import DECODERS
    from polaformer.tasks.lra.data import TASKS

    assert cli_classification.DATASET_NAMES == tuple(sorted(DATASETS))
    assert (cli_classification.DEFAULT_DATA, cli_classification.DEFAULT_MODEL,
            cli_classification.DEFAULT_EVAL_BATCH_SIZE) == (DEFAULT_DATA, DEFAULT_MODEL, DEFAULT_EVAL_BATCH_SIZE)
    parser = build_parser()

    def choices(*path_and_dest):
        *path, dest = path_and_dest
        node = parser
        for name in path:
            node = next(a for a in node._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        return set(next(a for a in node._actions if a.dest == dest).choices)

    assert choices("train", "data") == choices("eval", "data") == set(DATASETS)
    assert choices("detect", "train", "detector") == set(DETECTORS)
    assert choices("segment", "train", "decoder") == set(DECODERS)
    assert choices("lra", "train", "task") == set(TASKS)
    assert choices("lm", "train", "attention") == set(pola_lm.ATTENTIONS)
    assert choices("diffusion", "train", "attention") == set(pola_dit.ATTENTIONS)


@pytest.mark.parametrize("name", ["accelerate", "load_checkpoint", "LoadResult"])
def test_the_package_names_load_on_first_use(name):
    """``from polaformer import accelerate, load_checkpoint, LoadResult`` works as before the package stopped
    importing torch."""
    import polaformer
    from polaformer.acceleration import accelerate
    from polaformer.checkpoint import LoadResult, load_checkpoint

    assert getattr(polaformer, name) is {"accelerate": accelerate, "load_checkpoint": load_checkpoint,
                                         "LoadResult": LoadResult}[name]
    assert name in dir(polaformer)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        polaformer.nope  # noqa: B018


def test_a_library_import_registers_the_models_with_timm():
    """Outside the command, ``import polaformer`` loads the runtime at once: the models are in timm's registry, as
    they were before the command stopped importing torch."""
    code = "import polaformer, sys, timm; print('pola_deit_tiny_patch16_224' in timm.list_models('pola_*'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
