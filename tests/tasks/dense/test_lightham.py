"""LightHamHead against the official PolaFormer++ head (tests/data/, made by scripts/lightham_reference.py):
the same state_dict keys and shapes for the b1/b2/b3 configs, the same float64 outputs given the same NMF bases,
mmcv's initialisation; the recipes of configs/dense/ against the official configs, and the official evaluation
scale (tests/data/ade_test_sizes.json, made by scripts/ade_test_sizes_reference.py from mmcv's own code);
deterministic evaluation; ``segment train --decoder lightham`` end to end.

Tolerances (tests/README.md, tests/tolerances.py): the float64 fixture at 1e-10, far above reorder_rtol(n, float64)
through the head's convs and matrix decomposition steps (a few hundred terms per sum)."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from dense_helpers import SMALL, kwarg_flags
from polaformer.cli import main
from polaformer.engine.config import ConfigError
from polaformer.tasks.dense.config import load_recipe
from polaformer.tasks.dense.lightham import LightHamHead
from polaformer.tasks.dense.runner import DenseTask, Schedule
from polaformer.tasks.dense.segmentation import build_segmenter, evaluate_segmenter, mmseg_test_size

DATA = Path(__file__).resolve().parents[2] / "data"
MANIFEST = json.loads((DATA / "lightham_manifest.json").read_text())["configs"]
TEST_SIZES = json.loads((DATA / "ade_test_sizes.json").read_text())


@pytest.mark.parametrize("name", ["POLA_b1", "POLA_b2", "POLA_b3"])
def test_state_dict_matches_the_official_manifest_and_loads_strictly(name):
    cfg = json.loads((DATA / "lightham_manifest.json").read_text())["configs"][name]
    head = LightHamHead(cfg["in_channels"], cfg["num_classes"], channels=cfg["channels"],
                        ham_channels=cfg["ham_channels"], rank=cfg["rank"])
    assert {k: list(v.shape) for k, v in head.state_dict().items()} == cfg["state_dict"]
    head.load_state_dict({k: torch.zeros(shape) for k, shape in cfg["state_dict"].items()}, strict=True)


@pytest.mark.numerics
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
        torch.testing.assert_close(head(inputs, bases=tensors["bases"]), tensors["output_train"],
                                   rtol=1e-10, atol=1e-12)
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
    train = recipe["train"]
    assert (recipe["model"]["decoder"], train["lr"], train["head_lr_mult"]) == ("lightham", 6e-5, 10.0)


@pytest.mark.parametrize("name", ["POLA_b1", "POLA_b2", "POLA_b3"])
def test_recipes_are_the_official_configs(name):
    """configs/dense/lightham_pola_b*_160k.yaml against what the official config, its _base_ files and launch
    lines say (8 images per GPU on 8 GPUs, the parameter-wise keys, the schedule, the test scale)."""
    official = MANIFEST[name]["recipe"]
    recipe = load_recipe("segment", f"configs/dense/lightham_pola_b{name[-1]}_160k.yaml")
    data, train, model = recipe["data"], recipe["train"], recipe["model"]
    assert train["batch_size"] == official["images_per_gpu"] * official["gpus"] == 64
    assert (train["lr"], train["weight_decay"], sorted(train["no_decay_keys"]), train["head_lr_mult"]) == (
        official["lr"], official["weight_decay"], official["no_decay_keys"], official["head_lr_mult"])
    assert (train["warmup_steps"], train["power"], train["steps"]) == (
        official["warmup_iters"], official["power"], official["max_iters"])
    assert model["backbone_kwargs"]["drop_path_rate"] == official["drop_path_rate"]
    assert data["test_scale"] == official["test_scale"] == TEST_SIZES["scale"]
    assert official["test_size_divisor"] == TEST_SIZES["divisor"]


def test_weight_decay_spares_exactly_the_official_names():
    """The official paramwise custom_keys: no decay where the name holds 'norm' or 'pos_block'; biases and the
    head's GroupNorms are decayed (the default rule, for the other recipes, spares them)."""
    model = build_segmenter("lightham", "POLA_b0", 3, backbone_kwargs=SMALL["POLA_b0"], decoder_channels=32)
    names = {id(p): n for n, p in model.named_parameters()}
    for keys, spared in ((["norm", "pos_block"], lambda n: "norm" in n or "pos_block" in n),
                         ([], lambda n: n.endswith(".bias") or ".gn." in n or "norm" in n)):
        recipe = load_recipe("segment", overrides={"train.head_lr_mult": 10.0, "train.no_decay_keys": keys})
        task = DenseTask("segment", recipe, None, None, 3, ("a",) * 3, Schedule(steps=1, lr=1e-4, weight_decay=0.01))
        groups = task.build_optimizer(model).param_groups
        free = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
        decayed = {names[id(p)] for g in groups if g["weight_decay"] == 0.01 for p in g["params"]}
        assert free | decayed == set(names.values()) and not free & decayed
        assert free >= {n for n in names.values() if spared(n)}
        if keys:
            assert free == {n for n in names.values() if spared(n)} and free
            assert {"net.decode_head.squeeze.gn.weight", "net.decode_head.conv_seg.bias"} <= decayed


def test_convmodules_start_as_mmcv_initialises_them():
    """mmcv's ConvModule calls kaiming_init at construction (normal, fan_out, ReLU, bias 0) and sets its norm to
    (1, 0); mmseg's BaseDecodeHead then draws conv_seg from N(0, 0.01)."""
    torch.manual_seed(0)
    head = LightHamHead([128, 256, 512], 150, channels=512, ham_channels=512)
    convs = {"squeeze": head.squeeze, "ham_in": head.hamburger.ham_in, "ham_out": head.hamburger.ham_out,
             "align": head.align}
    for name, module in convs.items():
        weight = module.conv.weight
        expected = math.sqrt(2.0 / weight.shape[0])  # fan_out of a 1x1 conv: its output channels
        assert abs(weight.std().item() / expected - 1) < 0.02, name
        assert abs(weight.mean().item()) < 0.05 * expected, name
        if module.conv.bias is not None:
            assert not module.conv.bias.any(), name
        if hasattr(module, "gn"):
            assert (module.gn.weight == 1).all() and not module.gn.bias.any()
    assert abs(head.conv_seg.weight.std().item() / 0.01 - 1) < 0.02 and not head.conv_seg.bias.any()


@pytest.mark.parametrize("case", TEST_SIZES["cases"], ids=lambda c: "{}x{}".format(*c["size"]))
def test_ade_test_size_is_mmcvs(case):
    assert list(mmseg_test_size(*case["size"], scale=TEST_SIZES["scale"], divisor=TEST_SIZES["divisor"])) == \
        case["final"]


def test_evaluation_rescales_to_the_official_size_and_scores_at_the_image_size():
    seen = []

    class Recorder(nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            seen.append(tuple(x.shape[-2:]))
            logits = torch.zeros(1, 2, *x.shape[-2:])
            logits[:, 1, :, x.shape[-1] // 2:] = 1  # class 1 on the right half, at any size
            return logits

    case = next(c for c in TEST_SIZES["cases"] if c["size"] == [333, 777])
    h, w = case["size"]
    label = torch.zeros(h, w, dtype=torch.int64)
    label[:, w // 2 + 2:] = 1
    batch = ([torch.rand(3, h, w)], [{"semantic": label}])
    result = evaluate_segmenter(Recorder(), [batch], 2, test_scale=tuple(TEST_SIZES["scale"]))
    assert seen == [tuple(case["final"])] and result["aAcc"] > 0.99
    assert load_recipe("segment", overrides={"data.format": "ade", "data.root": "x"})["data"]["test_scale"] == \
        TEST_SIZES["scale"]
    evaluate_segmenter(Recorder(), [batch], 2)
    assert seen[-1] == (h, w)


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
