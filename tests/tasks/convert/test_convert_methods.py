"""Conversion done right (issue 54): a live gate for every source family with and without q/k/v biases and a report
whose words match the tensors; the attention weights the Hedgehog-style loss compares, against the layers' own
outputs in float64; per-layer transfer losses; LoRA fine-tuning merged into a plain checkpoint; PolaDiT through
``convert train``; timm's own weights from a local Hugging Face cache; every bad input a one-line error; the demo's
quick path end to end."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from cli_helpers import assert_unchanged, error_line, run_main, snapshot
from polaformer.checkpoint import load_checkpoint
from polaformer.layers import PolaCausalSelfAttention, PolaLinearAttention, SoftmaxCausalSelfAttention
from polaformer.tasks.convert import (
    AttentionTransfer,
    ConversionError,
    convert_model,
    family_of,
    freeze_for_transfer,
    target_of,
)
from polaformer.tasks.convert.transfer import pola_weights, softmax_weights
from polaformer.tasks.convert.weights import GATE_BIAS, GATE_WEIGHT, LOCAL_ZEROS, ZERO_BIAS, ZERO_BIAS_ROWS, gate_rows

VIT = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)
DIT = dict(attention="softmax", input_size=8, in_channels=1, hidden_size=16, depth=2, num_heads=2, num_classes=10)
LM = dict(attention="softmax", context=16, dim=16)
# family: (source name, its kwargs, how it drops its q/k/v biases (None: it has no such option), target kwargs,
# a batch of forward arguments)
SOURCES = {
    "deit": ("vit_tiny_patch16_224", VIT, {"qkv_bias": False}, {}, lambda: (torch.randn(2, 1, 8, 8),)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=128, embed_dim=8, depths=(1, 1, 1, 1),
                                                  num_heads=(2, 2, 2, 4), num_classes=3), {"qkv_bias": False}, {},
             lambda: (torch.randn(1, 3, 128, 128),)),
    "pvt_v2": ("pvt_v2_b0", dict(embed_dims=(8, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2),
                                 num_classes=3), {"qkv_bias": False}, {"img_size": 32},
               lambda: (torch.randn(2, 3, 32, 32),)),
    "dit": ("pola_dit_s_2", DIT, None, {},
            lambda: (torch.randn(2, 1, 8, 8), torch.rand(2) * 1000, torch.randint(0, 10, (2,)))),
    "lm": ("pola_lm_tiny", LM, {"attention_kwargs": {"qkv_bias": False}}, {},
           lambda: (torch.randint(0, 256, (2, 16)),)),
}
CASES = [(family, bias) for family, spec in SOURCES.items() for bias in ((True, False) if spec[2] else (True,))]


def _source(family, bias, seed=0):
    name, kwargs, no_bias, target_kwargs, inputs = SOURCES[family]
    kwargs = {**kwargs, **({} if bias else no_bias)}
    torch.manual_seed(seed)
    model = timm.create_model(name, **kwargs).eval()
    with torch.no_grad():
        for param in model.parameters():  # DiT's zero-initialised adaLN would make every block the identity
            param.add_(torch.randn_like(param) * 0.05)
    return model, name, kwargs, target_kwargs, inputs


def _gated_attentions(model):
    return {name: m for name, m in model.named_modules() if hasattr(m, "qkvg") or hasattr(m, "qg")}


@pytest.mark.parametrize("family, bias", CASES)
def test_every_converted_attention_branch_is_live_and_the_report_says_what_was_built(family, bias):
    source, name, kwargs, target_kwargs, inputs = _source(family, bias)
    assert any(m.bias is None for n, m in source.named_modules() if n.endswith((".qkv", ".q", ".kv"))) is not bias
    student, report = convert_model(source, *target_of(source, name, kwargs, "", target_kwargs))
    state = student.state_dict()
    # the input of every gated attention's output projection: (branch + local) x gate, never silenced
    entering = {}
    attentions = _gated_attentions(student)
    hooks = [m.proj.register_forward_pre_hook(lambda m, args, n=n: entering.__setitem__(n, args[0]))
             for n, m in attentions.items()]
    with torch.no_grad():
        student.eval()(*inputs())
    for hook in hooks:
        hook.remove()
    assert attentions and set(entering) == set(attentions)
    assert all(x.abs().amax() > 0 for x in entering.values()), {n: x.abs().amax() for n, x in entering.items()}
    # every word of the report about a new tensor holds of the tensor
    gate_notes = 0
    for key, note in report.new.items():
        value = state[key]
        gate = gate_rows(key, len(value))
        if note == GATE_WEIGHT:
            assert torch.all(value[gate[0]:gate[1]] == 0), key
            gate_notes += 1
        elif note.startswith(GATE_BIAS):
            assert torch.all(value[gate[0]:gate[1]] == 1), key
            assert (ZERO_BIAS_ROWS in note) is not bias
            if not bias:
                assert torch.all(value[:gate[0]] == 0), key
        elif note == ZERO_BIAS:
            assert not bias and torch.all(value == 0), key
        elif note == LOCAL_ZEROS:
            assert torch.all(value == 0), key
        else:
            assert re.fullmatch(r"(power|scale|s1|s2|positional_encoding): the Pola model's initial value", note), note
            assert key.endswith(note.split(":")[0])
    assert gate_notes == len(attentions)
    assert any(ZERO_BIAS_ROWS in note for note in report.new.values()) is not bias


@pytest.mark.parametrize("family", ["deit", "swin", "lm"])  # Pola-PVTv2 and PolaDiT always have gate biases
def test_a_target_built_without_a_gate_bias_is_refused(family):
    source, name, kwargs, target_kwargs, _ = _source(family, False)
    with pytest.raises(ConversionError, match=r"has no gate bias .*qkv_bias False.*silence every attention layer"):
        convert_model(source, *target_of(source, name, kwargs, "", {**target_kwargs, **SOURCES[family][2]}))


def _randomised(module):
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return module


def _two_streams(weights, v):
    v_same, v_opposite = v.chunk(2, dim=-1)
    return torch.cat([weights[0] @ v_same, weights[1] @ v_opposite], dim=-1)


def test_attention_weights_give_each_layers_own_output_in_float64():
    """The weights the attention-weight loss compares are the layers' own: applied to the values they reproduce
    the layer's output (where it has no local branch), to float64 rounding."""
    torch.manual_seed(0)
    b, n, c, heads = 2, 10, 16, 2
    x = torch.randn(b, n, c, dtype=torch.float64)
    # the vision layer (class token + a 3x3 grid), without local branch and gate
    layer = _randomised(PolaLinearAttention(c, heads, local="none", polarity_coefficients=False,
                                            num_prefix_tokens=1).double())
    v = layer.kv(x).chunk(2, dim=-1)[1].reshape(b, n, heads, -1).transpose(1, 2)
    out = _two_streams(pola_weights(layer, x, 3, 3), v).transpose(1, 2).reshape(b, n, c)
    torch.testing.assert_close(layer.proj(out), layer(x, 3, 3), rtol=0, atol=1e-12)
    # the causal layer, without conv: proj((W v) * gate)
    causal = _randomised(PolaCausalSelfAttention(c, heads, kernel_size=0).double())
    _, gate = causal.qg(x).chunk(2, dim=-1)
    v = causal.kv(x).chunk(2, dim=-1)[1].reshape(b, n, heads, -1).transpose(1, 2)
    out = _two_streams(pola_weights(causal, x), v).transpose(1, 2).reshape(b, n, c)
    torch.testing.assert_close(causal.proj(out * gate), causal(x), rtol=0, atol=1e-12)
    # the teachers: timm's Attention and the causal softmax layer
    vit = timm.create_model("vit_tiny_patch16_224", **{**VIT, "depth": 1}).double().blocks[0].attn
    lm = SoftmaxCausalSelfAttention(c, heads).double()
    for teacher, causal_mask in ((vit, False), (lm, True)):
        weights = softmax_weights(_randomised(teacher), x, causal_mask)
        v = teacher.qkv(x).reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)[2]
        out = teacher.proj((weights @ v).transpose(1, 2).reshape(b, n, c))
        torch.testing.assert_close(out, teacher(x), rtol=0, atol=1e-12)
        assert torch.allclose(weights.sum(-1), torch.ones((), dtype=torch.float64))
        if causal_mask:
            assert torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize("family", ["deit", "lm"])
def test_per_layer_and_attention_weight_losses_fall_and_only_new_tensors_move(family):
    source, name, kwargs, target_kwargs, inputs = _source(family, True)
    student, report = convert_model(source, *target_of(source, name, kwargs, "", target_kwargs))
    freeze_for_transfer(student, report)
    outputs_only = AttentionTransfer(source, student, family_of(source))
    torch.manual_seed(1)
    batch = inputs()
    plain = outputs_only.layer_losses(*batch).detach()
    outputs_only.remove()
    transfer = AttentionTransfer(source, student, family_of(source), attention_weight=1.0)
    layers = transfer.layer_losses(*batch)
    assert layers.shape == (2,) and torch.all(layers > plain)  # the cross-entropy added to each layer's loss
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = transfer.loss(*batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    transfer.remove()


def test_the_attention_weight_loss_refuses_blocks_it_cannot_pair(tmp_path):
    source, *_ = _source("swin", True)
    student, _ = convert_model(source, *target_of(source, SOURCES["swin"][0], SOURCES["swin"][1]))
    with pytest.raises(ConversionError, match="attention-weight loss needs attention layers matched one to one"):
        AttentionTransfer(source, student, family_of(source), attention_weight=1.0)


def _saved(model, path):
    torch.save({"model": model.state_dict()}, path)
    return path


def _flags(name, kwargs):
    return ["--source", name, *sum((["--source-kwarg", f"{k}={v}"] for k, v in kwargs.items()), [])]


def test_lora_trains_adapters_and_pola_tensors_only_and_merges_into_a_plain_checkpoint(tmp_path, capsys):
    source, name, kwargs, *_ = _source("deit", False)
    teacher = _saved(source, tmp_path / "deit.pth")
    run = ["convert", "train", *_flags(name, kwargs), "--teacher", teacher, "--batch-size", "8",
           "--opts", "data.augment", "false", "data.valid_fraction", "0.1"]
    assert run_main([*run, "--stage", "transfer", "--steps", "2", "--output", tmp_path / "transfer"], capsys)[0] == 0
    summary = json.loads((tmp_path / "transfer" / "metrics.json").read_text())
    assert len(summary["layer_losses"]) == 2 and summary["evaluated_on"] == "valid"
    code, out, _ = run_main([*run, "--stage", "finetune", "--lora", "2", "--steps", "3", "--lr", "1e-2",
                             "--init", tmp_path / "transfer" / "last.pth", "--output", tmp_path / "lora"], capsys)
    assert code == 0 and "merged -> " in out
    target, target_kwargs = target_of(source, name, kwargs)
    start = timm.create_model(target, **target_kwargs)
    load_checkpoint(start, tmp_path / "transfer" / "last.pth", strict=True)
    merged = timm.create_model(target, **target_kwargs)
    load_checkpoint(merged, tmp_path / "lora" / "merged.pth", strict=True)  # the plain class, strictly
    before, after = start.state_dict(), merged.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    projections = {k for k in moved if re.fullmatch(r"blocks\.\d\.attn\.(qkvg|proj)\.weight", k)}
    own = {k for k in moved if re.fullmatch(r"blocks\.\d\.attn\.(power|scale|dwc\.weight|dwc\.bias)", k)}
    assert moved == projections | own and len(projections) == 4, moved - projections - own
    for key in projections:  # a rank-2 update (float32 merge: singular values past 2 are rounding)
        singular = torch.linalg.svdvals((after[key] - before[key]).double())
        assert singular[2] < 1e-5 * singular[0], (key, singular[:4])
    trained = json.loads((tmp_path / "lora" / "metrics.json").read_text())["trained_parameters"]
    lora = 2 * 2 * ((16 + 64) + (16 + 16))  # rank x blocks x (in + out) of qkvg and proj
    assert trained == lora + sum(p.numel() for k, p in start.named_parameters() if k in
                                 {f"blocks.{i}.attn.{t}" for i in range(2) for t in ("power", "scale", "dwc.weight",
                                                                                         "dwc.bias")})



def test_lora_run_resumes_bit_identically_and_merges_the_same_weights(tmp_path, capsys, caplog):
    """last.pth of a LoRA run holds the adapters: 2 steps, then resumed to 4, equal 4 steps in one run."""
    source, name, kwargs, *_ = _source("deit", False)
    teacher = _saved(source, tmp_path / "deit.pth")
    run = ["convert", "train", *_flags(name, kwargs), "--teacher", teacher, "--batch-size", "8", "--stage",
           "finetune", "--lora", "2", "--lr", "1e-2", "--opts", "data.augment", "false", "data.valid_fraction", "0.1"]
    assert run_main([*run, "--steps", "4", "--output", tmp_path / "whole"], capsys)[0] == 0
    assert run_main([*run, "--steps", "2", "--output", tmp_path / "part"], capsys)[0] == 0
    with caplog.at_level(logging.INFO, logger="polaformer.engine"):
        code, out, _ = run_main([*run, "--steps", "4", "--output", tmp_path / "part", "--resume", "auto"], capsys)
    assert code == 0 and "merged -> " in out
    assert re.search(r"resumed from .*part/last\.pth: .*, 2 updates", caplog.text), caplog.text
    whole, part = (torch.load(tmp_path / d / "merged.pth", weights_only=True)["model"] for d in ("whole", "part"))
    assert whole.keys() == part.keys() and all(torch.equal(whole[k], part[k]) for k in whole)
    adapters = torch.load(tmp_path / "part" / "last.pth", weights_only=True)["model"]
    assert any("lora_" in k for k in adapters)  # what the resumed run continued from

def test_polaformer_train_finetune_with_lora_writes_a_merged_checkpoint(tmp_path, capsys):
    kwargs = dict(patch_size=2, embed_dim=16, depth=1, num_heads=2)
    start = timm.create_model("pola_deit_digits", **kwargs)
    _saved(start, tmp_path / "start.pth")
    code, _, _ = run_main(["train", "--model", "pola_deit_digits", *sum((["--model-kwarg", f"{k}={v}"]
                                                                        for k, v in kwargs.items()), []),
                           "--epochs", "1", "--finetune", tmp_path / "start.pth", "--lora", "2",
                           "--output", tmp_path / "run"], capsys)
    assert code == 0
    merged = tmp_path / "run" / "merged.pth"
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["merged"] == str(merged)
    plain = timm.create_model("pola_deit_digits", **kwargs)
    load_checkpoint(plain, merged, strict=True)
    before, after = start.state_dict(), plain.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved <= {"blocks.0.attn.qkvg.weight", "blocks.0.attn.proj.weight", "blocks.0.attn.power",
                     "blocks.0.attn.scale", "blocks.0.attn.dwc.weight", "blocks.0.attn.dwc.bias", "head.weight",
                     "head.bias"} and "head.weight" in moved and "blocks.0.attn.qkvg.weight" in moved, moved
    code, out, _ = run_main(["eval", "--checkpoint", merged], capsys)  # a checkpoint of the plain model
    assert code == 0 and "test top-1" in out


def test_dit_transfer_then_noise_distillation_through_convert_train(tmp_path, capsys):
    source, name, kwargs, *_ = _source("dit", True)
    teacher = _saved(source, tmp_path / "dit.pth")
    run = ["convert", "train", *_flags(name, kwargs), "--teacher", teacher, "--batch-size", "8"]
    assert run_main([*run, "--stage", "transfer", "--steps", "4", "--eval-every", "2", "--lr", "1e-2",
                     "--output", tmp_path / "transfer"], capsys)[0] == 0
    history = json.loads((tmp_path / "transfer" / "metrics.json").read_text())["history"]
    assert history[1]["train_loss"] < history[0]["train_loss"] and len(history[1]["layer_losses"]) == 2
    code, out, _ = run_main([*run, "--stage", "finetune", "--steps", "2", "--init", tmp_path / "transfer" / "last.pth",
                             "--output", tmp_path / "finetune"], capsys)
    assert code == 0 and re.search(r"finetune: valid ε-MSE \d\.\d{4}", out)
    target, target_kwargs = target_of(source, name, kwargs)
    plain = timm.create_model(target, **target_kwargs)
    load_checkpoint(plain, tmp_path / "finetune" / "last.pth", strict=True)
    assert plain.attention == "pacs"


def _folder(root, size, classes=3):
    """root/{train,val}/<class>/<i>.png: RGB images whose colour says the class."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 4), ("val", 2)):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                pixels = torch.rand(size, size, 3, generator=generator) * 80 + 60 * c
                Image.fromarray(pixels.byte().numpy()).save(root / split / f"c{c}" / f"{i}.png")
    return root


@pytest.mark.parametrize("family", ["swin", "pvt_v2", "lm"])
def test_both_stages_through_convert_train_for_swin_pvt_and_the_text(family, tmp_path, capsys):
    source, name, kwargs, target_kwargs, _ = _source(family, False)
    teacher = _saved(source, tmp_path / "teacher.pth")
    data = (["--data", "stdlib", "--opts", "data.max_bytes", "200000", "train.eval_batches", "1"] if family == "lm"
            else ["--data-path", _folder(tmp_path / "images", 128 if family == "swin" else 32)])
    run = ["convert", "train", *_flags(name, kwargs), "--teacher", teacher, "--batch-size", "2", "--steps", "2",
           *sum((["--target-kwarg", f"{k}={v}"] for k, v in target_kwargs.items()), [])]
    assert run_main([*run, "--stage", "transfer", "--output", tmp_path / "transfer", *data], capsys)[0] == 0
    layers = json.loads((tmp_path / "transfer" / "metrics.json").read_text())["layer_losses"]
    matched = [n for n, _ in source.named_modules() if re.fullmatch(family_of(source).teacher_modules, n)]
    assert len(layers) == len(matched) and all(loss >= 0 for loss in layers)  # one per matched layer
    code, out, _ = run_main([*run, "--stage", "finetune", "--init", tmp_path / "transfer" / "last.pth",
                             "--output", tmp_path / "finetune", *data], capsys)
    assert code == 0 and re.search(r"finetune: (val top-1|valid bits/byte)", out)
    target, kw = target_of(source, name, kwargs, "", target_kwargs)
    load_checkpoint(timm.create_model(target, **kw), tmp_path / "finetune" / "last.pth", strict=True)


def _hub_cache(root, repo, state):
    """``root`` in huggingface_hub's cache layout holding ``state`` as the repo's model.safetensors."""
    commit = "0" * 40
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "snapshots" / commit / "model.safetensors")


def test_pretrained_teacher_from_a_local_hub_cache_offline(tmp_path):
    name = "vit_tiny_patch16_224"
    kwargs = dict(img_size=32, embed_dim=16, depth=1, num_heads=2)
    torch.manual_seed(0)
    state = timm.create_model(name, **kwargs).state_dict()
    repo = timm.models.get_pretrained_cfg(name).hf_hub_id
    _hub_cache(tmp_path / "hub", repo, state)
    root = str(Path(__file__).resolve().parents[3])  # this checkout's polaformer in the child process
    python_path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"),
           "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONPATH": python_path}
    command = [sys.executable, "-m", "polaformer", "convert", "weights", *_flags(name, kwargs), "--pretrained",
               "--output", str(tmp_path / "converted.pth")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    converted = torch.load(tmp_path / "converted.pth", weights_only=True)["model"]
    for key in ("patch_embed.proj.weight", "blocks.0.mlp.fc1.weight", "head.weight", "pos_embed"):
        assert torch.equal(converted[key], state[key]), key
    assert torch.equal(converted["blocks.0.attn.qkvg.weight"][:48], state["blocks.0.attn.qkv.weight"])
    # without the file in the cache: one line, nothing written
    empty = {**env, "HF_HUB_CACHE": str(tmp_path / "empty")}
    done = subprocess.run(command[:-1] + [str(tmp_path / "other.pth")], env=empty, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and not (tmp_path / "other.pth").exists()
    assert re.search(r"cannot fetch timm's pretrained weights of 'vit_tiny_patch16_224' .*HF_HUB_OFFLINE=1",
                     error_line(done.stderr, logs_allowed=True))


VIT_FLAGS = _flags("vit_tiny_patch16_224", VIT)
TRAIN = ["convert", "train", *VIT_FLAGS, "--teacher", "{tmp}/deit.pth", "--output", "{tmp}/out", "--steps", "1"]
ERRORS = [
    ("lora in transfer", [*TRAIN, "--stage", "transfer", "--lora", "4"],
     r"finetune\.lora \(--lora\) is for the finetune stage"),
    ("attention weight in finetune", [*TRAIN, "--attention-weight", "1"],
     r"transfer\.attention_weight \(--attention-weight\) is for the transfer stage"),
    ("lora negative", [*TRAIN, "--stage", "finetune", "--lora", "-1"], r"finetune\.lora must be .*got -1"),
    ("attention weight negative", [*TRAIN, "--attention-weight", "-0.5"],
     r"transfer\.attention_weight must be .*got -0\.5"),
    ("attention weight on swin", ["convert", "train", *_flags(*SOURCES["swin"][:2]), "--teacher", "{tmp}/swin.pth",
                                  "--output", "{tmp}/out", "--stage", "transfer", "--attention-weight", "1"],
     r"transfer\.attention_weight needs attention layers matched one to one \(deit, lm sources\), not swin"),
    ("teacher and pretrained", [*TRAIN, "--pretrained"], r"model\.teacher .* and model\.pretrained true both name"),
    ("no weights", ["convert", "weights", *VIT_FLAGS, "--output", "{tmp}/c.pth"],
     r"give the source's trained weights: --weights FILE or --pretrained"),
    ("weights and pretrained", ["convert", "weights", *VIT_FLAGS, "--weights", "{tmp}/deit.pth", "--pretrained",
                                "--output", "{tmp}/c.pth"], r"--weights FILE or --pretrained \(timm's own\), one of"),
    ("no timm weights", ["convert", "weights", *_flags("pola_lm_tiny", LM), "--pretrained", "--output",
                         "{tmp}/c.pth"], r"timm has no pretrained weights of 'pola_lm_tiny'"),
    ("dit on text", ["convert", "train", *_flags("pola_dit_s_2", DIT), "--teacher", "{tmp}/dit.pth", "--data",
                     "stdlib", "--output", "{tmp}/out"], r"a DiT converts on the digits images .*not stdlib"),
    ("dit in colour", ["convert", "train", *_flags("pola_dit_s_2", {**DIT, "in_channels": 3}), "--teacher",
                       "{tmp}/dit3.pth", "--output", "{tmp}/out"], r"grey images of 10 classes; .* takes 3 channels"),
    ("bias-less target", ["convert", "weights", *_flags("vit_tiny_patch16_224", {**VIT, "qkv_bias": False}),
                          "--weights", "{tmp}/deit_nobias.pth", "--target-kwarg", "qkv_bias=False", "--output",
                          "{tmp}/c.pth"], r"has no gate bias"),
    ("train lora without finetune", ["train", "--model", "pola_deit_digits", "--lora", "2", "--output", "{tmp}/out"],
     r"MODEL\.LORA 2 \(--lora\) adapts weights it starts from: give MODEL\.PRETRAINED \(--finetune FILE\)"),
    ("digits validation too small", [*TRAIN, "--opts", "data.valid_fraction", "0.001"],
     r"data\.valid_fraction 0\.001 holds out 2 of the 1437 training images: each split needs one per class \(10\)"),
    ("text without validation", ["convert", "train", *_flags("pola_lm_tiny", LM),
                                 "--teacher", "{tmp}/lm.pth", "--data", "stdlib", "--output", "{tmp}/out",
                                 "--opts", "data.valid_fraction", "0"], r"data\.valid_fraction must be above 0"),
    ("demo seeds", ["convert", "demo", "--out", "{tmp}/demo", "--quick", "--seeds", "0"],
     r"--seeds must be at least 1, got 0"),
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    _saved(timm.create_model("vit_tiny_patch16_224", **VIT), root / "deit.pth")
    _saved(timm.create_model("vit_tiny_patch16_224", **VIT, qkv_bias=False), root / "deit_nobias.pth")
    _saved(timm.create_model(*SOURCES["swin"][:1], **SOURCES["swin"][1]), root / "swin.pth")
    _saved(timm.create_model("pola_dit_s_2", **DIT), root / "dit.pth")
    _saved(timm.create_model("pola_lm_tiny", **LM), root / "lm.pth")
    _saved(timm.create_model("pola_dit_s_2", **{**DIT, "in_channels": 3}), root / "dit3.pth")
    return root


@pytest.mark.parametrize("argv, message", [case[1:] for case in ERRORS], ids=[case[0] for case in ERRORS])
def test_bad_inputs_are_one_line_errors_and_write_nothing(teachers, argv, message, capsys):
    before = snapshot(teachers)
    code, _, err = run_main([a.replace("{tmp}", str(teachers)) for a in argv], capsys)
    assert code == 2
    assert re.search(message, error_line(err, logs_allowed=True)), err
    assert_unchanged(before, teachers)
    assert snapshot(teachers) == before


def test_demo_quick_path_end_to_end(tmp_path, capsys):
    code, out, _ = run_main(["convert", "demo", "--out", tmp_path, "--quick"], capsys)
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    for part in ("digits", "lm"):
        rows = {row["run"]: row for row in results[part]["rows"]}
        assert {"Pola: transfer + fine-tune", "Pola: fine-tune only, same steps", "Pola: transfer + LoRA fine-tune",
                "Pola: from scratch, same steps", "Pola: transfer (+ attention weights) + fine-tune"} <= set(rows)
        assert all(len(row["scores"]) == 2 for row in rows.values())  # the quick path's two seeds
        assert rows["Pola: transfer + LoRA fine-tune"]["trained"] < 0.5
        assert results[part]["layer_losses"] and results[part]["tried"]
    assert len(results["dit"]["rows"]) == 4
    table = (tmp_path / "table.md").read_text()
    assert "mean ± sd over 2 seeds" in table and "Rates chosen on" in table and table.strip() in out
