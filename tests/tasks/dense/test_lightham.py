"""LightHamHead against the official PolaFormer++ head (tests/data/, made by scripts/lightham_reference.py):
the same state_dict keys and shapes for the b1/b2/b3 configs, the same float64 outputs given the same NMF bases;
deterministic evaluation; ``segment train --decoder lightham`` end to end."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from polaformer.cli import main
from polaformer.tasks.dense.config import load_recipe
from polaformer.tasks.dense.lightham import LightHamHead
from polaformer.tasks.dense.runner import DenseTask, Schedule
from polaformer.tasks.dense.segmentation import build_segmenter
from polaformer.engine.config import ConfigError

from dense_helpers import SMALL, kwarg_flags

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize("name", ["POLA_b1", "POLA_b2", "POLA_b3"])
def test_state_dict_matches_the_official_manifest_and_loads_strictly(name):
    cfg = json.loads((DATA / "lightham_manifest.json").read_text())["configs"][name]
    head = LightHamHead(cfg["in_channels"], cfg["num_classes"], channels=cfg["channels"],
                        ham_channels=cfg["ham_channels"], rank=cfg["rank"])
    assert {k: list(v.shape) for k, v in head.state_dict().items()} == cfg["state_dict"]
    head.load_state_dict({k: torch.zeros(shape) for k, shape in cfg["state_dict"].items()}, strict=True)


def test_float64_outputs_equal_the_official_head_given_the_same_bases():
    with safe_open(DATA / "lightham_tiny.safetensors", "pt") as f:
        cfg = {k: json.loads(v) for k, v in f.metadata().items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    head = LightHamHead(cfg["in_channels"], cfg["num_classes"], channels=cfg["channels"],
                        ham_channels=cfg["ham_channels"], rank=cfg["rank"]).double()
    head.load_state_dict({k[len("weight."):]: v for k, v in tensors.items() if k.startswith("weight.")}, strict=True)
    inputs = [tensors[f"input.{i}"] for i in range(len(cfg["in_channels"]) + 1)]
    with torch.no_grad():
        torch.testing.assert_close(head.eval()(inputs, bases=tensors["bases"]), tensors["output_eval"],
                                   rtol=1e-10, atol=1e-12)
        head.train().dropout = nn.Identity()
        torch.testing.assert_close(head(inputs, bases=tensors["bases"]), tensors["output_train"], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="bases must have shape"):
        head(inputs, bases=tensors["bases"][:, :, :1])


def test_bases_are_seeded_eval_deterministic_and_checked():
    torch.manual_seed(0)
    head = LightHamHead([4, 8], 3, channels=32, ham_channels=32, rank=4, dropout=0.0)
    inputs = [torch.rand(1, 4, 8, 8), torch.rand(1, 8, 4, 4)]
    with torch.no_grad():
        head.eval()
        assert torch.equal(head(inputs), head(inputs))
        head.hamburger.ham.eval_seed = 1
        other = head(inputs)
        head.hamburger.ham.eval_seed = 0
        assert not torch.allclose(head(inputs), other)  # the bases matter, and eval_seed picks them
        head.train()
        torch.manual_seed(5)
        first = head(inputs)
        torch.manual_seed(5)
        assert torch.equal(head(inputs), first)
    with pytest.raises(ValueError, match="multiple of 32"):
        LightHamHead([4], 3, channels=48)


def test_head_learning_rate_multiplier():
    model = build_segmenter("lightham", "POLA_b0", 3, backbone_kwargs=SMALL["POLA_b0"], decoder_channels=32)
    recipe = load_recipe("segment", overrides={"train.head_lr_mult": 10.0})
    task = DenseTask("segment", recipe, None, None, 3, ("a", "b", "c"), Schedule(steps=1, lr=1e-4, weight_decay=0.01))
    groups = task.build_optimizer(model).param_groups
    head = {id(p) for p in model.net.decode_head.parameters()}
    for group in groups:
        in_head = {id(p) in head for p in group["params"]}
        assert len(in_head) <= 1 and group["lr"] == pytest.approx(1e-3 if in_head == {True} else 1e-4)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    with pytest.raises(ConfigError, match="multiple of 32 for lightham"):
        load_recipe("segment", overrides={"model.decoder": "lightham", "model.decoder_channels": 48})
    recipe = load_recipe("segment", "configs/dense/lightham_pola_b2_160k.yaml")
    assert (recipe["model"]["decoder"], recipe["train"]["lr"], recipe["train"]["head_lr_mult"]) == ("lightham", 6e-5, 10.0)


def test_segment_train_eval_lightham(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code = main(["segment", "train", "--decoder", "lightham", "--backbone", "POLA_b0", *kwarg_flags("POLA_b0"),
                 "--opts", "model.decoder_channels", "32", "--steps", "2", "--batch-size", "2", "--train-size", "4",
                 "--val-size", "2", "--no-progress", "--device", "cpu", "--output", str(out_dir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    miou = json.loads(out.strip().splitlines()[-1])["mIoU"]
    code = main(["segment", "eval", "--checkpoint", str(out_dir / "best.pth"), "--val-size", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["mIoU"] == pytest.approx(miou)
