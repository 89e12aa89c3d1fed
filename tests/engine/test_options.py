"""One declaration per engine option (issue 53, polaformer.engine.options): every training command's configuration
tree, its flag, help text and checks come from :data:`OPTIONS`; the official upper-case tree reads the options at
their official keys through one adapter. The test adds an option in one place and finds it everywhere."""
from __future__ import annotations

import dataclasses
import importlib

import pytest

from polaformer.cli import build_parser, main
from polaformer.cli.common import TRAIN_TASKS
from polaformer.engine import options
from polaformer.engine.config import POSITIVE_INT, Config, ConfigError
from polaformer.engine.options import OPTIONS, Option, loop_kwargs, official_values, options_of
from polaformer.engine.task import LoopSettings

DUMMY = Option("dummy_knob", "a knob only this test turns", default=3, range=POSITIVE_INT, loop=None, metavar="K")
# every training command, the arguments that get it past its own required options
COMMANDS = {
    "train": ["train"],
    "lm train": ["lm", "train"],
    "sr train": ["sr", "train", "--scale", "2"],
    "diffusion train": ["diffusion", "train"],
    "convert train": ["convert", "train", "--source", "vit_tiny_patch16_224", "--teacher", "t.pth"],
    "lra train": ["lra", "train", "--task", "listops", "--data", "lra-data"],
    "detect train": ["detect", "train"],
    "segment train": ["segment", "train"],
}


class Stop(Exception):
    """Raised where the command would start to load data: the configuration it has built is in ``args``."""


@pytest.fixture
def dummy(monkeypatch):
    monkeypatch.setattr(options, "OPTIONS", (*OPTIONS, DUMMY))
    return DUMMY


def test_the_commands_here_are_every_training_command():
    assert {TRAIN_TASKS[" ".join(argv[:2]) if argv[0] not in ("detect", "segment") else "dense train"]
            for argv in COMMANDS.values()} == set(TRAIN_TASKS.values())


def _trees():
    """Every task's default configuration tree, and the dotted key of the dummy option in it."""
    from polaformer.tasks.classification.config import default_config
    from polaformer.tasks.convert.train import convert_config
    from polaformer.tasks.dense.config import dense_config
    from polaformer.tasks.diffusion.train import diffusion_config
    from polaformer.tasks.lm.train import lm_config
    from polaformer.tasks.lra.config import lra_config
    from polaformer.tasks.sr.train import sr_config

    lower = [lm_config(check=False), sr_config(check=False), diffusion_config(check=False),
             convert_config(check=False), lra_config("listops"), dense_config("detect"), dense_config("segment")]
    return [(default_config(), "TRAIN.DUMMY_KNOB")] + [(cfg, "train.dummy_knob") for cfg in lower]


def test_an_option_declared_once_is_in_every_configuration_tree(dummy):
    for cfg, key in _trees():
        section, name = key.split(".")
        assert cfg[section][name] == 3, key


def _captured_config(monkeypatch, command: str):
    """Intercept ``command`` where it hands its configuration on: the checked tree (a dict for detect/segment)."""
    def stop(*args, **kwargs):
        raise Stop(*args)

    if command == "train":
        module = importlib.import_module("polaformer.tasks.classification.train")
        monkeypatch.setattr(module, "train", stop)  # the engine's: after the task's checks
        return lambda error: error.args[0].cfg
    if command in ("detect train", "segment train"):
        monkeypatch.setattr(importlib.import_module("polaformer.tasks.dense.runner"), "train_task", stop)
        return lambda error: Config(error.args[1])
    if command == "lra train":
        monkeypatch.setattr(importlib.import_module("polaformer.tasks.lra.train"), "load_splits", stop)
        return lambda error: error.args[0]
    task = command.split()[0]
    module = importlib.import_module(f"polaformer.tasks.{task}.train")
    monkeypatch.setattr(module, {"lm": "LMTask", "sr": "SRTask", "diffusion": "DiffusionTask",
                                 "convert": "ConvertTask"}[task], stop)
    return lambda error: error.args[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_option_declared_once_is_a_flag_of_every_training_command(dummy, command, monkeypatch, tmp_path, capsys):
    argv = COMMANDS[command]
    key = "TRAIN.DUMMY_KNOB" if command == "train" else "train.dummy_knob"
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    assert f"--dummy-knob K a knob only this test turns ({key})" in " ".join(capsys.readouterr().out.split())

    config_of = _captured_config(monkeypatch, command)
    with pytest.raises(Stop) as stopped:
        main([*argv, "--dummy-knob", "7", "--output", str(tmp_path / "run")])
    cfg = config_of(stopped.value)
    section, name = key.split(".")
    assert cfg[section][name] == 7

    # its range, checked once with the configuration and naming the key; its type at once, in the same words
    assert main([*argv, "--dummy-knob", "0", "--output", str(tmp_path / "run")]) == 2
    assert f"{key} must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--dummy-knob", "many"])
    assert "argument --dummy-knob: must be a positive integer, got 'many'" in capsys.readouterr().err


def test_every_declared_option_is_a_flag_with_its_key_in_the_help():
    parser = build_parser()
    for command, task in TRAIN_TASKS.items():
        path = ("detect", "train") if command == "dense train" else tuple(command.split())
        node = parser
        for name in path:
            node = next(a for a in node._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
        actions = {action.dest: action for action in node._actions}
        for option in options_of(task):
            assert actions[option.name].help.endswith(f"({option.key(task)})"), (command, option.name)


def test_every_option_the_loop_reads_is_a_loop_setting():
    fields = {f.name for f in dataclasses.fields(LoopSettings)}
    assert {option.loop_field for option in OPTIONS if option.loop_field is not None} <= fields


def test_the_official_tree_is_read_by_one_adapter():
    """The official keys (configs/*.yaml) are the options: the batch at DATA.BATCH_SIZE, the EMA switched by
    TRAIN.EMA.ENABLE, clipping off at 0."""
    from polaformer.tasks.classification.config import default_config

    cfg = default_config()
    cfg.merge({"DATA": {"BATCH_SIZE": 64}, "TRAIN": {"CLIP_GRAD": 0.0, "EMA": {"ENABLE": True, "DECAY": 0.99}}})
    values = official_values(cfg)
    assert (values["batch_size"], values["clip_grad_norm"], values["ema_decay"]) == (64, 0.0, 0.99)
    settings = loop_kwargs(values)
    assert (settings["batch_size"], settings["clip_grad_norm"], settings["ema_decay"]) == (64, None, 0.99)
    cfg.TRAIN.EMA.ENABLE = False
    assert official_values(cfg)["ema_decay"] is None


@pytest.mark.parametrize("key, value, message", [
    ("train.parallel", "zero", "train.parallel must be one of ddp, fsdp, got 'zero'"),
    ("train.amp", "yes", "train.amp must be true or false, got 'yes'"),
    ("train.steps", None, "train.steps must be a positive integer, got None"),  # lm has no epochs to replace them
    ("train.ema_decay", 1.0, "train.ema_decay must lie in [0, 1) (0: no EMA), got 1.0"),
])
def test_a_value_outside_its_declaration_is_one_line_naming_the_key(key, value, message):
    from polaformer.tasks.lm.train import lm_config

    cfg = lm_config(check=False)
    section, name = key.split(".")
    cfg[section]._values[name] = value  # past the tree's type check, as a bad checkpoint would be
    with pytest.raises(ConfigError) as info:
        options.check_options(cfg, "lm")
    assert str(info.value) == message


def test_steps_may_be_null_only_where_the_epochs_replace_them():
    from polaformer.tasks.dense.config import dense_config

    cfg = dense_config("detect")
    assert cfg.train.steps is None and cfg.train.epochs == 1.5
    options.check_options(cfg, "dense")  # no error
