"""The `polaformer` command line: train/eval round trip and one-line errors with exit status 2."""
import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from polaformer.cli import build_parser, main
from polaformer.cli.common import FLAG_KEYS, TRAIN_FLAG_MEANINGS

TINY = [
    "--model", "vit_tiny_patch16_224",
    "--model-kwarg", "patch_size=2", "--model-kwarg", "embed_dim=16",
    "--model-kwarg", "depth=1", "--model-kwarg", "num_heads=1",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny 2-epoch training run shared by the tests: (output folder, printed final line)."""
    output = tmp_path_factory.mktemp("run")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["train", *TINY, "--epochs", "2", "--batch-size", "128", "--output", str(output)])
    assert code == 0
    return output, stdout.getvalue().strip()


def run_main(argv, capsys):
    """Run the CLI in-process; returns (exit status, stdout, stderr), argparse's exits included."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err, *fragments):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(r"polaformer( \w+)?: error: ", lines[0]), lines[0]
    for fragment in fragments:
        assert fragment in lines[0]


def test_train_writes_checkpoint_metrics_and_final_line(trained):
    output, final_line = trained
    metrics = json.loads((output / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    for record in metrics["epochs"]:
        assert {"train_loss", "test_top1", "epoch_time_s"} <= set(record)
    assert metrics["final_test_top1"] == metrics["epochs"][-1]["test_top1"]
    assert metrics["wall_time_s"] > 0
    assert metrics["config"]["epochs"] == 2 and metrics["config"]["model_kwargs"]["depth"] == 1
    assert (output / "checkpoint.pth").is_file()
    assert final_line == (
        f"final test top-1: {metrics['final_test_top1']:.2f}% "
        f"(epochs=2, time={metrics['wall_time_s']:.1f}s) -> {output / 'checkpoint.pth'}"
    )


def test_eval_reproduces_the_final_top1(trained, capsys):
    output, _ = trained
    metrics = json.loads((output / "metrics.json").read_text())
    code, out, err = run_main(["eval", "--checkpoint", str(output / "checkpoint.pth")], capsys)
    assert code == 0, err
    assert out.startswith(f"test top-1: {metrics['final_test_top1']:.2f}% ")


def test_eval_with_the_right_model_name(trained, capsys):
    output, _ = trained
    code, _, err = run_main(["eval", "--checkpoint", str(output / "checkpoint.pth"), "--model", "vit_tiny_patch16_224"],
                            capsys)
    assert code == 0, err


def test_eval_missing_checkpoint(tmp_path, capsys):
    path = tmp_path / "missing.pth"
    code, out, err = run_main(["eval", "--checkpoint", str(path)], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, f"checkpoint not found: {path}")


def test_eval_corrupt_checkpoint(tmp_path, capsys):
    path = tmp_path / "corrupt.pth"
    path.write_bytes(b"\x00" * 100)
    code, _, err = run_main(["eval", "--checkpoint", str(path)], capsys)
    assert code == 2
    assert_one_line_error(err, f"corrupt or unreadable checkpoint: {path} (")


def test_eval_checkpoint_of_another_architecture(trained, capsys):
    output, _ = trained
    code, _, err = run_main(["eval", "--checkpoint", str(output / "checkpoint.pth"), "--model", "pola_deit_digits"],
                            capsys)
    assert code == 2
    assert_one_line_error(err, "'vit_tiny_patch16_224'", "'pola_deit_digits'")


def test_eval_checkpoint_whose_weights_do_not_fit(trained, tmp_path, capsys):
    output, _ = trained
    checkpoint = torch.load(output / "checkpoint.pth", weights_only=True)
    checkpoint["model_kwargs"]["embed_dim"] = 32  # as if the architecture had changed since
    torch.save(checkpoint, tmp_path / "changed.pth")
    code, _, err = run_main(["eval", "--checkpoint", str(tmp_path / "changed.pth")], capsys)
    assert code == 2
    assert_one_line_error(err, "does not fit", "shape mismatches")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["train", "--epoch", "3"], "unrecognized arguments: --epoch 3"),  # no silent abbreviations
        (["train", "--epochs", "many"], "argument --epochs: must be a finite number > 0, got 'many'"),
        (["train", "--batch-size", "two"], "argument --batch-size: must be a positive integer, got 'two'"),
        (["train", "--batch-size", "0"], "DATA.BATCH_SIZE must be a positive integer, got 0"),  # with the config
        (["train", "--model-kwarg", "depth"], "expected KEY=VALUE"),
        (["train", "--data", "imagenet"], "invalid choice: 'imagenet'"),
        (["eval"], "the following arguments are required: --checkpoint"),
        (["fly"], "invalid choice: 'fly'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, fragment, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, fragment)


def test_unknown_model(tmp_path, capsys):
    code, _, err = run_main(["train", "--model", "no_such_model", "--output", str(tmp_path)], capsys)
    assert code == 2
    assert_one_line_error(err, "unknown model 'no_such_model'")


@pytest.mark.slow
def test_python_dash_m(trained):
    """The real entry point: exit statuses and streams as a shell sees them."""
    output, _ = trained
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "polaformer"]

    ok = subprocess.run([*command, "eval", "--checkpoint", str(output / "checkpoint.pth")],
                        capture_output=True, text=True, env=env, timeout=120)
    metrics = json.loads((output / "metrics.json").read_text())
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"test top-1: {metrics['final_test_top1']:.2f}% ")

    bad = subprocess.run([*command, "train", "--bogus"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert_one_line_error(bad.stderr, "unrecognized arguments: --bogus")


def _subparser(parser, path):
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("command", [c for c in FLAG_KEYS if c != "dense train"] + ["detect train", "segment train"])
def test_every_flag_of_the_table_is_an_option_of_its_command(command):
    """FLAG_KEYS is the one flag -> key path of a command's own options (its engine options: tests/engine/
    test_options.py): each is on its parser, and a step-based command's help names the key the option sets (detect
    and segment train share 'dense train')."""
    table = FLAG_KEYS["dense train" if command in ("detect train", "segment train") else command]
    actions = {a.dest: a for a in _subparser(build_parser(), command.split())._actions}
    assert set(table) <= set(actions), set(table) - set(actions)
    if command != "train":  # classification's options predate the table; their help texts are free-form
        for dest, key in table.items():
            if dest in TRAIN_FLAG_MEANINGS:
                assert actions[dest].help.endswith(f"({key})"), (dest, actions[dest].help)
