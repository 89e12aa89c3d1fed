"""Softmax → Pola conversion for every pair: each source weight lands exactly where its map says, the new parts
are reported and initialised, foreign shapes are refused, the converted file loads strictly into the plain Pola
class, and the attention-transfer loss falls; then both engine stages on digits, resumed bit-identically, and on an
ImageNet-layout folder."""
from __future__ import annotations

import contextlib
import json
import re

import pytest
import timm
import torch
from PIL import Image
from torch import nn

from polaformer.checkpoint import load_checkpoint
from polaformer.cli import main
from polaformer.data.folder import model_transforms
from polaformer.tasks.convert import (
    AttentionTransfer,
    ConversionError,
    build_source,
    convert_model,
    family_of,
    freeze_for_transfer,
    save_converted,
    target_of,
)
from polaformer.tasks.convert.weights import FAMILIES
from tolerances import adam_drift_bound, assert_trainings_agree

VIT = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)
PAIRS = {  # family: (source name, source kwargs, target kwargs, a batch of forward arguments)
    "deit": ("vit_tiny_patch16_224", VIT, {}, lambda: (torch.randn(2, 1, 8, 8),)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=128, embed_dim=8, depths=(1, 1, 1, 1),
                                                  num_heads=(2, 2, 2, 4), num_classes=3), {},
             lambda: (torch.randn(1, 3, 128, 128),)),
    "pvt_v2": ("pvt_v2_b0", dict(embed_dims=(8, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2),
                                 num_classes=3), {"img_size": 32}, lambda: (torch.randn(2, 3, 32, 32),)),
    "dit": ("pola_dit_s_2", dict(attention="softmax", input_size=8, in_channels=1, hidden_size=16, depth=2,
                                 num_heads=2, num_classes=3), {},
            lambda: (torch.randn(2, 1, 8, 8), torch.rand(2) * 1000, torch.randint(0, 3, (2,)))),
    "lm": ("pola_lm_tiny", dict(attention="softmax", context=16, dim=16), {},
           lambda: (torch.randint(0, 256, (2, 16)),)),
}


@contextlib.contextmanager
def counting_forwards():
    """Module forward calls inside the block, as a one-item list."""
    calls = [0]
    handle = nn.modules.module.register_module_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def _teacher(family, tmp_path):
    """A softmax model with random (non-trivial) weights, saved and read back through the converter's loader."""
    name, kwargs, target_kwargs, inputs = PAIRS[family]
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs)
    with torch.no_grad():
        for param in model.parameters():  # DiT's zero-initialised adaLN would make every block the identity
            param.add_(torch.randn_like(param) * 0.05)
    path = tmp_path / f"{family}.pth"
    torch.save({"model": model.state_dict()}, path)
    return build_source(name, kwargs, path), model.state_dict(), name, kwargs, target_kwargs, inputs


@pytest.mark.parametrize("family", list(PAIRS))
def test_every_weight_copied_exactly_reported_and_loads_strictly(family, tmp_path):
    teacher, source_state, name, kwargs, target_kwargs, _ = _teacher(family, tmp_path)
    target, kw = target_of(teacher, name, kwargs, "", target_kwargs)
    student, report = convert_model(teacher, target, kw)
    state = student.state_dict()
    copied_rows = {}
    for key, value in source_state.items():
        parts = FAMILIES[family].map_key(key, set(state))
        if isinstance(parts, str):
            assert key in report.dropped
            continue
        for (dest, part, parts_total, _), chunk in zip(parts, value.chunk(len(parts))):
            rows = len(state[dest]) // parts_total
            assert torch.equal(state[dest][part * rows:part * rows + len(chunk)], chunk), (key, dest)
            copied_rows.setdefault(dest, set()).update(range(part * rows, part * rows + len(chunk)))
    # every parameter is either copied whole, or its remaining rows are reported new with their initialisation
    for key, param in student.named_parameters():
        rows = copied_rows.get(key, set())
        if len(rows) < len(param):
            assert key in report.new, key
    new_leaves = {re.sub(r".*\.", "", k) for k in report.new}
    assert {"weight", "bias"} <= new_leaves and new_leaves & {"power", "s1"}
    gate = [k for k in report.new if re.search(r"\.(qkvg|qg)\.bias$", k)]
    assert gate and all(torch.all(state[k][report.new_rows[k][0][0]:] == 1) for k in gate)  # gate 1 at first
    assert report.lines()[0].startswith("copied: ")
    # the file loads into the plain Pola class, strictly
    path = save_converted(student, report, target, kw, tmp_path / "converted.pth")
    plain = timm.create_model(target, **kw)
    load_checkpoint(plain, path, strict=True)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("family", list(PAIRS))
def test_transfer_loss_falls_and_copied_rows_stay(family, tmp_path):
    teacher, _, name, kwargs, target_kwargs, inputs = _teacher(family, tmp_path)
    student, report = convert_model(teacher, *target_of(teacher, name, kwargs, "", target_kwargs))
    before = {k: v.clone() for k, v in student.state_dict().items()}
    trained = freeze_for_transfer(student, report)
    transfer = AttentionTransfer(teacher, student, family_of(teacher))
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(1)
    batch = inputs()
    losses = []
    for _ in range(4):
        loss = transfer.loss(*batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    after = student.state_dict()
    for key, value in before.items():  # only the new rows moved: every copied row is still the teacher's
        kept = torch.ones(len(value), dtype=torch.bool) if value.dim() else torch.tensor(True)
        for start, end in report.new_rows.get(key, []):
            kept[start:end] = False
        assert torch.equal(after[key][kept], value[kept]), key
    assert any(not torch.equal(after[k], before[k]) for k in trained)
    transfer.remove()


def test_shapes_or_weights_without_counterpart_are_refused(tmp_path, capsys):
    teacher, *_ = _teacher("deit", tmp_path)
    with pytest.raises(ConversionError, match=r"shape mismatch: source cls_token \(1, 1, 16\) -> cls_token \(1, 1, 32"):
        convert_model(teacher, "pola_deit_tiny_patch16_224", {**VIT, "num_heads": 4, "embed_dim": 32})
    qk_norm = timm.create_model("vit_tiny_patch16_224", **VIT, qk_norm=True)
    with pytest.raises(ConversionError, match=r"q_norm\.weight .* has no counterpart"):
        convert_model(qk_norm, "pola_deit_tiny_patch16_224", VIT)
    pola = timm.create_model("pola_lm_tiny", context=16)
    with pytest.raises(ConversionError, match="conversion starts from attention='softmax'"):
        target_of(pola, "pola_lm_tiny", {})
    assert main(["convert", "train", "--source", "vit_tiny_patch16_224", "--output", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().endswith("name the softmax model (model.source) and its trained weights "
                                                    "(model.teacher, or model.pretrained true for timm's own)")
    assert main(["convert", "weights", "--source", "swin_tiny_patch4_window7_224",
                 "--weights", str(tmp_path / "deit.pth"), "--output", str(tmp_path / "y.pth")]) == 2
    assert "does not fit SwinTransformer" in capsys.readouterr().err


def test_cli_weights_then_both_stages_on_digits_resume_bit_identically(tmp_path, capsys):
    teacher, *_ = _teacher("deit", tmp_path)
    source = ["--source", "vit_tiny_patch16_224", *sum((["--source-kwarg", f"{k}={v}"] for k, v in VIT.items()), [])]
    out = tmp_path / "converted.pth"
    assert main(["convert", "weights", *source, "--weights", str(tmp_path / "deit.pth"), "--output", str(out)]) == 0
    assert "blocks.N.attn.qkvg.weight <- gate rows" in capsys.readouterr().out
    plain = timm.create_model("pola_deit_tiny_patch16_224", **{k: v for k, v in VIT.items()})
    load_checkpoint(plain, out, strict=True)
    assert main(["convert", "weights", *source, "--weights", str(tmp_path / "deit.pth"), "--output", str(out),
                 "--target-kwarg", "embed_dim=32"]) == 2  # exists (no --overwrite): refused before any work
    run = ["convert", "train", "--stage", "transfer", *source, "--teacher", str(tmp_path / "deit.pth"),
           "--batch-size", "8", "--eval-every", "2", "--opts", "data.augment", "false"]
    assert main([*run, "--steps", "4", "--output", str(tmp_path / "whole")]) == 0
    assert main([*run, "--steps", "2", "--output", str(tmp_path / "part")]) == 0
    assert main([*run, "--steps", "4", "--output", str(tmp_path / "part"), "--resume", "auto"]) == 0
    whole, part = (torch.load(tmp_path / d / "last.pth", weights_only=True)["model"] for d in ("whole", "part"))
    assert all(torch.equal(whole[k], part[k]) for k in whole)
    history = json.loads((tmp_path / "whole" / "metrics.json").read_text())["history"]
    assert len(history) == 2 and all("top1" in h for h in history)
    finetune = ["convert", "train", "--stage", "finetune", *source, "--teacher", str(tmp_path / "deit.pth"),
                "--init", str(tmp_path / "whole" / "last.pth"), "--steps", "2", "--batch-size", "8"]
    with counting_forwards() as plain_calls:
        assert main([*finetune, "--output", str(tmp_path / "finetune")]) == 0
    assert "finetune: valid top-1" in capsys.readouterr().out  # data.valid_fraction of the training images
    plain = timm.create_model("pola_deit_tiny_patch16_224", **VIT)
    load_checkpoint(plain, tmp_path / "finetune" / "last.pth", strict=True)
    # the engine's execution keys, as for every task: the same steps recomputed, or captured by dynamo
    expected = torch.load(tmp_path / "finetune" / "last.pth", weights_only=True)["model"]
    for key, value in (("train.grad_checkpointing", "true"), ("train.compile", "eager")):
        with counting_forwards() as calls:
            assert main([*finetune, "--output", str(tmp_path / key), "--opts", key, value]) == 0
        got = torch.load(tmp_path / key / "last.pth", weights_only=True)["model"]
        # AdamW at lr 1e-3, 2 steps: the compiled model runs the plain modules, not the fused CPU ones, and their
        # rounding can turn an update (tolerances.assert_trainings_agree); recomputation repeats it bit for bit
        assert_trainings_agree(got, expected, adam_drift_bound([1e-3] * 2, (0.9, 0.999)))
        if key == "train.grad_checkpointing":
            assert calls[0] > plain_calls[0]  # the student's blocks ran again in the backward pass


def _image_folder(root, classes=3, per_split=(4, 2)):
    """root/{train,val}/<class>/<i>.png: 32×32 images whose colour says the class (plus noise)."""
    generator = torch.Generator().manual_seed(0)
    for split, count in zip(("train", "val"), per_split):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                pixels = torch.rand(32, 32, 3, generator=generator) * 80 + 60 * c
                Image.fromarray(pixels.byte().numpy()).save(root / split / f"c{c}" / f"{i}.png")
    return root


def test_both_stages_on_an_image_folder_with_the_teachers_transforms(tmp_path, capsys):
    kwargs = {**VIT, "img_size": 32, "patch_size": 8, "in_chans": 3, "num_classes": 3}
    torch.manual_seed(0)
    teacher = timm.create_model("vit_tiny_patch16_224", **kwargs)
    torch.save({"model": teacher.state_dict()}, tmp_path / "deit.pth")
    data = _image_folder(tmp_path / "images")
    # the teacher's own data config (ViT: mean and std 0.5) at the size it was built for, not pretrained_cfg's 224
    _, evaluation, shape = model_transforms(teacher)
    gray = evaluation(Image.new("RGB", (48, 40), (128, 128, 128)))
    assert shape == (3, 32, 32) and gray.shape == shape and gray.abs().max() < 0.01
    source = ["--source", "vit_tiny_patch16_224", "--teacher", str(tmp_path / "deit.pth"),
              *sum((["--source-kwarg", f"{k}={v}"] for k, v in kwargs.items()), []), "--batch-size", "4"]
    transfer = ["convert", "train", "--stage", "transfer", *source, "--data-path", str(data), "--steps", "6",
                "--eval-every", "3", "--lr", "1e-2", "--opts", "train.warmup_steps", "0", "data.augment", "false"]
    assert main([*transfer, "--output", str(tmp_path / "transfer")]) == 0
    history = json.loads((tmp_path / "transfer" / "metrics.json").read_text())["history"]
    assert len(history) == 2 and history[1]["train_loss"] < history[0]["train_loss"], history
    assert all(0 <= h["top1"] <= 100 for h in history)
    assert main(["convert", "train", "--stage", "finetune", *source, "--data-path", str(data), "--steps", "2",
                 "--init", str(tmp_path / "transfer" / "last.pth"), "--output", str(tmp_path / "finetune")]) == 0
    assert "finetune: val top-1" in capsys.readouterr().out
    plain = timm.create_model("pola_deit_tiny_patch16_224", **kwargs)
    load_checkpoint(plain, tmp_path / "finetune" / "last.pth", strict=True)
    # one-line errors: a split missing, a head that does not match the folder's classes
    (data / "val").rename(tmp_path / "val")
    assert main([*transfer, "--output", str(tmp_path / "no_val")]) == 2
    assert re.search(r"missing folder .*val: expected .*/train/<class>/<image>", capsys.readouterr().err)
    two = _image_folder(tmp_path / "two", classes=2)
    assert main([*transfer, "--data-path", str(two), "--output", str(tmp_path / "two_out")]) == 2  # the last wins
    assert capsys.readouterr().err.strip().endswith("has 2 classes, vit_tiny_patch16_224's head 3: convert a teacher "
                                                    "trained on these classes")
    gray_kwargs = {**kwargs, "in_chans": 1}
    torch.save({"model": timm.create_model("vit_tiny_patch16_224", **gray_kwargs).state_dict()}, tmp_path / "gray.pth")
    gray_source = ["--source", "vit_tiny_patch16_224", "--teacher", str(tmp_path / "gray.pth"),
                   *sum((["--source-kwarg", f"{k}={v}"] for k, v in gray_kwargs.items()), [])]
    assert main(["convert", "train", *gray_source, "--data-path", str(two), "--output", str(tmp_path / "gray")]) == 2
    assert capsys.readouterr().err.strip().endswith("gives RGB images; vit_tiny_patch16_224 takes 1 channels")


def test_demo_refuses_an_earlier_demo_before_any_training(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    assert main(["convert", "demo", "--out", str(tmp_path), "--quick"]) == 2
    assert "results.json already exists" in capsys.readouterr().err
    (tmp_path / "results.json").unlink()
    (tmp_path / "digits").mkdir()
    assert main(["convert", "demo", "--out", str(tmp_path), "--quick"]) == 2
    assert capsys.readouterr().err.strip().endswith("--overwrite replaces the demo's runs, or choose another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits"]  # nothing written, nothing lost
