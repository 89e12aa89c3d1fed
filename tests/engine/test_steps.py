"""The step-based tasks' share of the engine (polaformer.engine.steps): LoopSettings read from a config tree's
``train`` section, a task's model loaded back from its run checkpoint, and each ``train`` command checking its
final configuration once."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from call_counting import counted
from polaformer.checkpoint import CorruptCheckpointError, with_checksum
from polaformer.cli import main
from polaformer.engine.config import Config, ConfigError
from polaformer.engine.steps import load_task_model, saved_config, step_settings


def train_section(**extra) -> Config:
    return Config({"train": {"steps": 10, "batch_size": 4, "eval_every": 5, "seed": 3, "num_workers": 1, **extra}})


def test_step_settings_read_the_train_section_and_the_command():
    settings = step_settings(train_section(), "out", resume=Path("out/last.pth"), overwrite=True, device="cpu",
                             show_progress=False, allow_changed=["train.steps"])
    assert (settings.output, settings.batch_size, settings.steps, settings.eval_every, settings.seed,
            settings.num_workers) == (Path("out"), 4, 10, 5, 3, 1)
    assert (settings.resume, settings.overwrite, settings.device, settings.show_progress, settings.allow_changed) == \
        ("out/last.pth", True, "cpu", False, ("train.steps",))
    # keys the section lacks keep the loop's defaults
    assert (settings.clip_grad_norm, settings.clip_grad_value, settings.ema_decay, settings.amp,
            settings.save_every_steps, settings.epochs, settings.last_name) == (None, None, None, False, 0, None,
                                                                                "last.pth")


def test_step_settings_take_the_optional_keys_a_task_has_and_zero_turns_clipping_and_ema_off():
    on = step_settings(train_section(clip_grad_norm=1.0, clip_grad_value=0.5, ema_decay=0.999, amp=True,
                                     save_every=2), "out")
    assert (on.clip_grad_norm, on.clip_grad_value, on.ema_decay, on.amp, on.save_every_steps) == (1.0, 0.5, 0.999,
                                                                                                  True, 2)
    off = step_settings(train_section(clip_grad_norm=0.0, clip_grad_value=0.0, ema_decay=0.0), "out")
    assert (off.clip_grad_norm, off.clip_grad_value, off.ema_decay) == (None, None, None)


def _save(path, **checkpoint):
    torch.save(with_checksum(checkpoint), path)
    return path


def _rebuild(checkpoint):
    cfg = saved_config(checkpoint, Config({"width": 2}), lambda cfg: None)
    return nn.Linear(cfg.width, 1), cfg


def test_load_task_model_rebuilds_loads_and_evals(tmp_path):
    trained, ema = nn.Linear(3, 1), nn.Linear(3, 1)
    path = _save(tmp_path / "run.pth", task="toy", model=trained.state_dict(), model_ema=ema.state_dict(),
                 config={"width": 3})
    model, cfg = load_task_model(path, "toy", "toy", _rebuild)
    assert not model.training and cfg.width == 3 and torch.equal(model.weight, trained.weight)
    model, _ = load_task_model(path, "toy", "toy", _rebuild, ema=True)
    assert torch.equal(model.weight, ema.weight)


@pytest.mark.parametrize("checkpoint, message", [
    ({"task": "other", "model": {}}, "a 'other' checkpoint, not a 'toy' one"),
    ({"task": "toy", "model": {}}, "not a usable toy checkpoint: 'config'"),
    ({"task": "toy", "model": {}, "config": [1]}, "not a usable toy checkpoint: its 'config' is a list"),
    ({"task": "toy", "model": {}, "config": {"width": "wide"}}, "not a usable toy checkpoint: width"),
    ({"task": "toy", "model": nn.Linear(4, 1).state_dict(), "config": {"width": 3}}, "do not fit"),
])
def test_load_task_model_refuses_unusable_files_in_one_line(tmp_path, checkpoint, message):
    path = _save(tmp_path / "run.pth", **checkpoint)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load_task_model(path, "toy", "toy", _rebuild)
    assert len(str(info.value).splitlines()) == 1


class Stop(Exception):
    pass


@pytest.mark.parametrize("task, task_class, argv", [
    ("lm", "LMTask", ["--context", "16", "--steps", "5"]),
    ("sr", "SRTask", ["--scale", "2", "--steps", "5"]),
    ("diffusion", "DiffusionTask", ["--steps", "5"]),
    ("convert", "ConvertTask", ["--source", "vit_tiny_patch16_224", "--teacher", "t.pth", "--steps", "5"]),
])
def test_a_train_command_checks_its_final_configuration_once(task, task_class, argv, monkeypatch, tmp_path):
    """The walk from the flags to the task's data: the configuration is checked once, as it will be trained."""
    module = importlib.import_module(f"polaformer.tasks.{task}.train")
    checks = counted(monkeypatch, module, f"check_{task}_config")

    def stop(cfg):
        raise Stop

    monkeypatch.setattr(module, task_class, stop)  # the data are the task's, past the walk that is tested
    with pytest.raises(Stop):
        main([task, "train", *argv, "--output", str(tmp_path / "run")])
    assert len(checks) == 1 and checks[0][0].train.steps == 5


def test_a_bad_configuration_of_a_train_command_is_still_refused(tmp_path, capsys):
    assert main(["lm", "train", "--attention", "pola", "--opts", "model.drop_rate", "1.5", "--output",
                 str(tmp_path / "run")]) == 2
    assert "model.drop_rate" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.drop_rate"):
        from polaformer.tasks.lm import lm_config

        lm_config(opts=["model.drop_rate", "1.5"])
