"""``polaformer detect`` and ``polaformer segment`` end to end: a couple of steps on the embedded scenes and on
tiny COCO-format / ADE20K-layout folders, then eval, predict, resume and the one-line errors.

Tolerances (tests/README.md): an eval command scores the weights the training scored, with its BatchNorms folded into
the convs (another float32 rounding); AP and mIoU count argmax decisions, which agree unless two scores of a pixel or
box lie within that rounding (about 1e-6 relative) of each other, so they are compared at pytest.approx's 1e-6."""
import json

import pytest
import torch
from PIL import Image

from dense_helpers import kwarg_flags, write_ade, write_coco
from polaformer.cli import main
from polaformer.engine.config import ConfigError
from polaformer.tasks.dense.config import load_recipe

TINY = ["--steps", "2", "--batch-size", "2", "--no-progress", "--device", "cpu"]
DIGITS = ["--train-size", "4", "--val-size", "2"]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("detector, backbone", [("maskrcnn", "pola_pvt_v2_b0"), ("retinanet", "pola_swin_t"),
                                                ("fcos", "pola_deit_tiny_patch16_224")])
def test_detect_train_eval_predict_on_digits(tmp_path, capsys, detector, backbone):
    out_dir = tmp_path / "run"
    code, out, err = run(["detect", "train", "--detector", detector, "--backbone", backbone, *kwarg_flags(backbone),
                          *TINY, *DIGITS, "--output", str(out_dir)], capsys)
    assert code == 0, err
    metrics = last_json(out)
    assert 0 <= metrics["bbox_AP"] <= 1 and ("segm_AP" in metrics) == (detector == "maskrcnn")
    assert (out_dir / "last.pth").is_file() and (out_dir / "best.pth").is_file()
    assert json.loads((out_dir / "metrics.json").read_text())["step"] == 2
    code, out, err = run(["detect", "eval", "--checkpoint", str(out_dir / "last.pth"), "--val-size", "2",
                          "--device", "cpu"], capsys)
    assert code == 0, err
    assert last_json(out)["bbox_AP"] == pytest.approx(metrics["bbox_AP"])
    if detector == "maskrcnn":
        from polaformer.tasks.dense.data import DigitScenes

        image = DigitScenes("val", size=1)[0][0]
        Image.fromarray((image.permute(1, 2, 0) * 255).byte().numpy()).save(tmp_path / "scene.png")
        code, out, err = run(["detect", "predict", "--checkpoint", str(out_dir / "best.pth"),
                              str(tmp_path / "scene.png"), "--out", str(tmp_path / "pred"), "--score-threshold", "0",
                              "--device", "cpu"], capsys)
        assert code == 0, err
        drawn = Image.open(tmp_path / "pred" / "scene.png")
        assert drawn.size == (128, 128)


def test_detect_on_a_coco_folder_and_resume(tmp_path, capsys):
    images, ann = write_coco(tmp_path / "coco")
    data = ["--train-images", str(images), "--train-annotations", str(ann),
            "--val-images", str(images), "--val-annotations", str(ann)]
    out_dir = tmp_path / "run"
    common = ["detect", "train", "--detector", "maskrcnn", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"),
              *data, "--batch-size", "2", "--no-progress", "--device", "cpu", "--output", str(out_dir)]
    code, out, err = run([*common, "--steps", "1"], capsys)
    assert code == 0, err
    code, out, err = run([*common, "--steps", "2", "--resume", "auto"], capsys)
    assert code == 0, err
    assert torch.load(out_dir / "last.pth", weights_only=True)["num_updates"] == 2
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    code, out, err = run(["detect", "eval", "--checkpoint", str(out_dir / "last.pth"), "--val-images", str(images),
                          "--val-annotations", str(ann), "--device", "cpu"], capsys)
    assert code == 0, err
    assert {"bbox_AP", "segm_AP"} <= set(last_json(out))


@pytest.mark.parametrize("decoder, backbone", [("fpn", "pola_pvt_tiny"), ("upernet", "POLA_b0")])
def test_segment_train_eval_on_digits(tmp_path, capsys, decoder, backbone):
    out_dir = tmp_path / "run"
    code, out, err = run(["segment", "train", "--decoder", decoder, "--backbone", backbone, *kwarg_flags(backbone),
                          *TINY, *DIGITS, "--output", str(out_dir)], capsys)
    assert code == 0, err
    miou = last_json(out)["mIoU"]
    assert 0 <= miou <= 1
    code, out, err = run(["segment", "eval", "--checkpoint", str(out_dir / "best.pth"), "--val-size", "2",
                          "--device", "cpu"], capsys)
    assert code == 0, err
    assert last_json(out)["mIoU"] == pytest.approx(miou)


def test_segment_on_an_ade_folder(tmp_path, capsys):
    root = write_ade(tmp_path / "ade")
    out_dir = tmp_path / "run"
    code, out, err = run(["segment", "train", "--decoder", "fpn", "--backbone", "pola_pvt_v2_b0",
                          *kwarg_flags("pola_pvt_v2_b0"), "--root", str(root), "--num-classes", "3",
                          "--crop-size", "32", *TINY, "--output", str(out_dir)], capsys)
    assert code == 0, err
    code, out, err = run(["segment", "eval", "--checkpoint", str(out_dir / "last.pth"), "--root", str(root),
                          "--device", "cpu"], capsys)
    assert code == 0, err
    assert 0 <= last_json(out)["mIoU"] <= 1


def test_one_line_errors(tmp_path, capsys):
    images, ann = write_coco(tmp_path / "coco")
    data = json.loads(ann.read_text())
    data["annotations"][0]["bbox"] = [0, 0, -1, 4]
    ann.write_text(json.dumps(data))
    for argv, message in [
        (["detect", "train", "--train-images", str(images), "--train-annotations", str(ann), "--val-images",
          str(images), "--val-annotations", str(ann)], "bbox must be"),
        (["detect", "train", "--train-images", str(images)], "data.train_annotations"),
        (["detect", "train", "--backbone", "nope", *TINY], "unknown backbone 'nope'"),
        (["detect", "eval", "--checkpoint", str(tmp_path / "none.pth")], "none.pth"),
        (["segment", "train", "--root", str(tmp_path / "nowhere"), *TINY], "no such folder"),
        (["segment", "train", "--config", str(tmp_path / "missing.yaml")], "config file not found"),
        (["segment", "train", "--opts", "train.lrr", "1e-3"], "unknown config key 'train.lrr'"),
        (["segment", "train", "--opts", "train.lr", ".nan"], "train.lr must be a finite number > 0"),
        (["detect", "train", "--opts", "train.batch_size", "two"], "train.batch_size expects int"),
    ]:
        code, out, err = run(argv, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)


def test_recipes_take_base_files_opts_and_flags_in_that_order(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "task: segment\ntrain: {lr: 0.5, seed: 3}\nmodel: {backbone_kwargs: {depth: 1}}\n")
    (tmp_path / "run.yaml").write_text("BASE: base.yaml\ntrain: {lr: 0.25}\n")
    recipe = load_recipe("segment", tmp_path / "run.yaml", {"train.seed": 7},
                         opts=["train.lr", "0.125", "train.seed", "5"])
    assert recipe["train"]["lr"] == 0.125 and recipe["train"]["seed"] == 7
    assert recipe["model"]["backbone_kwargs"] == {"depth": 1} and "task" not in recipe
    with pytest.raises(ConfigError, match="is a 'segment' recipe, not a 'detect' one"):
        load_recipe("detect", tmp_path / "run.yaml")


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_epochs_flag_takes_whole_and_fractional_epochs(task):
    """--epochs is parsed as a float, so both recipes hold train.epochs as one (segment's once refused 2.0)."""
    for epochs in (2.0, 2.5):
        assert load_recipe(task, None, {"train.epochs": epochs})["train"]["epochs"] == epochs


def test_paper_recipes_load():
    recipe = load_recipe("detect", "configs/dense/maskrcnn_pola_swin_t_3x.yaml")
    assert recipe["train"]["epochs"] == 36 and recipe["train"]["lr"] == 1e-4 and recipe["train"]["weight_decay"] == 0.05
    assert recipe["model"]["detector"] == "maskrcnn" and recipe["train"]["milestones"] == [0.75, 0.9167]
    assert load_recipe("detect", "configs/dense/retinanet_pola_pvt_tiny_1x.yaml")["train"]["epochs"] == 12
    sem = load_recipe("segment", "configs/dense/semfpn_pola_pvt_tiny_40k.yaml")
    assert (sem["train"]["steps"], sem["train"]["lr"], sem["train"]["weight_decay"]) == (40000, 2e-4, 1e-3)
    assert load_recipe("segment", "configs/dense/upernet_pola_swin_t_160k.yaml")["train"]["steps"] == 160000
    with pytest.raises(ConfigError, match="unknown config key 'train.lr_rate'"):
        load_recipe("segment", overrides={"train.lr_rate": 1})


def test_run_folder_guarantees_and_checkpoints_of_the_earlier_layout(tmp_path, capsys):
    """The engine's guarantees hold for dense tasks (a finished run refused, a busy folder refused), and a
    checkpoint in the layout dense training wrote before the one engine still evaluates and resumes."""
    from polaformer.engine.output import OutputLock

    out_dir = tmp_path / "run"
    train = ["segment", "train", "--decoder", "fpn", "--backbone", "pola_pvt_tiny", *kwarg_flags("pola_pvt_tiny"),
             "--batch-size", "2", "--no-progress", "--device", "cpu", *DIGITS]
    code, out, err = run([*train, "--steps", "1", "--output", str(out_dir)], capsys)
    assert code == 0, err
    code, out, err = run([*train, "--steps", "1", "--output", str(out_dir)], capsys)
    assert code == 2 and "already holds a run" in err
    lock = OutputLock(out_dir)
    try:
        code, out, err = run([*train, "--steps", "2", "--resume", "auto", "--output", str(out_dir)], capsys)
    finally:
        lock.release()
    assert code == 2 and "is in use by process" in err

    new = torch.load(out_dir / "last.pth", weights_only=True)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    # the recipe as earlier versions laid it out: batch and workers in data, clipping as train.clip_grad
    config = {**new["config"], "data": dict(new["config"]["data"]), "train": dict(new["config"]["train"])}
    config["data"]["batch_size"], config["data"]["workers"] = (config["train"].pop(key) for key in ("batch_size",
                                                                                                   "num_workers"))
    config["train"]["clip_grad"] = config["train"].pop("clip_grad_norm")
    torch.save({"task": "segment", "config": config, "model": new["model"], "step": 1, "metrics": new["metrics"],
                "best": new["best"]["mIoU"], "optimizer": new["optimizer"]}, old_dir / "last.pth")
    code, out, err = run(["segment", "eval", "--checkpoint", str(old_dir / "last.pth"), "--val-size", "2",
                          "--device", "cpu"], capsys)
    assert code == 0, err
    assert last_json(out)["mIoU"] == pytest.approx(new["metrics"]["mIoU"])
    code, out, err = run([*train, "--steps", "2", "--resume", "auto", "--output", str(old_dir)], capsys)
    assert code == 0, err
    assert torch.load(old_dir / "last.pth", weights_only=True)["num_updates"] == 2
