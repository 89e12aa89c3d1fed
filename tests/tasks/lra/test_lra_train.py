"""The LRA model, its step-based training (resume, checkpoints, CLI) and the recipe files.

Tolerances (tests/README.md, tests/tolerances.py): float32 padded batch against each sequence alone at 1e-6: padding
adds exact zeros to each sum, so only the blocking of the longer sums (37 tokens x 16 channels) differs; 1e-6 on these
unit-scale logits is probable_rtol of those sums at the attention's normalised weights."""
from __future__ import annotations

import json

import pytest
import torch

from call_counting import counted
from conftest import REPO
from polaformer.cli import main
from polaformer.engine.config import ConfigError
from polaformer.tasks.lra.attention import ATTENTIONS
from polaformer.tasks.lra.config import RECIPES, LRAConfigError, load_lra_config, lra_config
from polaformer.tasks.lra.data import TASKS, LRADataset, collate_lra
from polaformer.tasks.lra.listops import generate_listops
from polaformer.tasks.lra.model import LRAClassifier, LRAModelConfig
from polaformer.tasks.lra.train import LRASplits, load_lra_model, train_lra

CONFIGS = REPO / "configs" / "lra"
# Attentions whose output for a sequence does not depend on how much padding follows it
# (Nyström's landmarks average over the padded length).
PADDING_INVARIANT = sorted(set(ATTENTIONS) - {"nystrom"})


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    generate_listops(out, train=64, val=16, test=16, min_length=10, max_length=40, max_depth=3, seed=0,
                     progress=False)
    return out


def tiny_cfg(attention="pola", **train):
    settings = dict(batch_size=8, lr=1e-3, warmup_steps=2, steps=8, eval_every=4, save_every=2, seed=0)
    settings.update(train)
    return lra_config("listops", {"attention": attention, "model": dict(dim=16, hidden_dim=32, num_heads=2, head_dim=8),
                                  "train": settings})


@pytest.mark.parametrize("attention", PADDING_INVARIANT)
@pytest.mark.parametrize("dual", [False, True])
def test_padded_batch_gives_each_sequence_its_unpadded_logits(attention, dual):
    torch.manual_seed(0)
    cfg = LRAModelConfig(vocab_size=32, num_classes=10, max_len=64, dual=dual, dim=16, hidden_dim=32,
                         num_heads=2, head_dim=8, attention=attention)
    model = LRAClassifier(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 32, (n,), generator=gen) for n in (37, 5, 20)]
    if dual:
        items = [((s, torch.randint(1, 32, (n,), generator=gen)), 0) for s, n in zip(seqs, (9, 30, 2))]
    else:
        items = [(s, 0) for s in seqs]
    batch = collate_lra(items)
    logits = model(batch["tokens"], batch["padding_mask"], batch.get("tokens_b"), batch.get("padding_mask_b"))
    for i, item in enumerate(items):
        alone = collate_lra([item])
        expected = model(alone["tokens"], alone["padding_mask"], alone.get("tokens_b"), alone.get("padding_mask_b"))
        torch.testing.assert_close(logits[i : i + 1], expected, rtol=1e-6, atol=1e-6)


def test_model_checks_its_inputs():
    model = LRAClassifier(LRAModelConfig(vocab_size=8, num_classes=2, max_len=16, dim=8, hidden_dim=8,
                                         num_heads=2, head_dim=4))
    with pytest.raises(ValueError, match="exceeds the model's max_len 16"):
        model(torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens_b is only for dual"):
        model(torch.ones(1, 4, dtype=torch.long), None, torch.ones(1, 4, dtype=torch.long))


def test_recipe_files_match_the_built_in_recipes():
    for task, recipe in RECIPES.items():
        cfg = load_lra_config(CONFIGS / f"{task}.yaml")
        assert cfg.task == task
        for key, value in recipe.items():
            assert getattr(cfg.train, key) == pytest.approx(value), (task, key)
        assert cfg.train.steps == 50_000 and cfg.train.adam_eps == 1e-6 and cfg.train.clip_grad_value == 1.0
        assert cfg.model.to_dict() == dict(dim=64, hidden_dim=128, num_heads=2, head_dim=32, num_layers=2, dropout=0.1,
                                 attention_dropout=0.1)
        assert load_lra_config(task=task).train == cfg.train
    assert set(RECIPES) == set(TASKS)


@pytest.mark.parametrize(
    "text,message",
    [
        ("task: listops\ntrain: {batch_sise: 3}\n", "unknown config key 'train.batch_sise'"),
        ("task: listops\nmodel: {depth: 3}\n", "unknown config key 'model.depth'"),
        ("task: listops\nextra: 1\n", "unknown config key 'extra'"),
        ("task: listops\ntrain: {steps: many}\n", "train.steps expects int"),
        ("task: listops\ntrain: {lr: .nan}\n", "train.lr must be a finite number"),
        ("task: listops\ntrain: {limit_dev: 0}\n", "train.limit_dev must be a positive integer"),
        ("task: sorting\n", "unknown task 'sorting'"),
        ("[1, 2]\n", "mapping"),
    ],
)
def test_bad_config_files_give_one_line_errors(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_lra_config(path)


def test_training_writes_checkpoints_metrics_and_evaluates_the_best(listops_dir, tmp_path):
    summary = train_lra(tiny_cfg(), listops_dir, tmp_path / "run", show_progress=False)
    assert summary["steps"] == 8 and [r["step"] for r in summary["history"]] == [4, 8]
    assert {"best.pth", "last.pth", "metrics.json", "metrics.jsonl"} <= {p.name for p in (tmp_path / "run").iterdir()}
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8]
    # best.pth scores the test split exactly as the run reported
    model, checkpoint = load_lra_model(tmp_path / "run" / "best.pth")
    assert checkpoint["num_updates"] == summary["best_step"]
    from polaformer.tasks.lra.data import load_lra_split
    from polaformer.tasks.lra.train import _eval_loader, evaluate_lra

    test = evaluate_lra(model, _eval_loader(load_lra_split("listops", listops_dir, "test"), 8, 0))
    assert test["accuracy"] == summary["test_accuracy"]
    # the one-cycle schedule ends far below its peak
    assert summary["history"][-1]["lr"] < 1e-3 / 100


class Crash(Exception):
    pass


def test_interrupted_run_resumes_bit_identically(listops_dir, tmp_path):
    cfg = tiny_cfg(steps=10, eval_every=5, save_every=3)
    full = train_lra(cfg, listops_dir, tmp_path / "full", show_progress=False)

    def crash_at(step):
        if step == 7:
            raise Crash

    with pytest.raises(Crash):
        train_lra(cfg, listops_dir, tmp_path / "broken", show_progress=False, on_step=crash_at)
    assert torch.load(tmp_path / "broken" / "last.pth", weights_only=True)["num_updates"] == 6  # saved at step 6
    resumed = train_lra(cfg, listops_dir, tmp_path / "broken", resume="auto", show_progress=False)
    a = torch.load(tmp_path / "full" / "last.pth", weights_only=True)
    b = torch.load(tmp_path / "broken" / "last.pth", weights_only=True)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    assert resumed["test_accuracy"] == full["test_accuracy"]
    assert [r["dev_accuracy"] for r in resumed["history"]] == [r["dev_accuracy"] for r in full["history"]]


def test_resume_refuses_a_checkpoint_of_another_attention(listops_dir, tmp_path):
    train_lra(tiny_cfg(steps=4, eval_every=4), listops_dir, tmp_path / "run", show_progress=False)
    with pytest.raises(ConfigError, match="was trained with attention = 'pola', this run asks for 'softmax'"):
        train_lra(tiny_cfg(attention="softmax", steps=4, eval_every=4), listops_dir, tmp_path / "run",
                  resume="auto", show_progress=False)


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_cli_trains_every_attention_end_to_end(listops_dir, tmp_path, capsys, attention):
    out = tmp_path / attention
    code = main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", attention,
                 "--steps", "2", "--batch-size", "8", "--eval-every", "2", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"listops, {attention}, 2 steps" in printed and "test accuracy:" in printed
    summary = json.loads((out / "metrics.json").read_text())
    model_config = torch.load(out / "best.pth", weights_only=True)["model_config"]
    assert (model_config["dim"], model_config["num_heads"], model_config["max_len"]) == (64, 2, 2048)  # the paper's
    assert summary["config"]["train"]["warmup_steps"] == 0  # a 2-step run cannot warm up for 1000


def test_cli_attention_options_eval_and_errors(listops_dir, tmp_path, capsys):
    out = tmp_path / "pola"
    assert main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "pola",
                 "--attention-option", "alpha=7", "--attention-option", "gate_init=zeros", "--steps", "2",
                 "--batch-size", "8", "--eval-every", "2", "--output", str(out)]) == 0
    capsys.readouterr()
    model, checkpoint = load_lra_model(out / "best.pth")
    layer = model.blocks[0].attn.layer
    assert layer.alpha == 7 and checkpoint["config"]["attention_options"] == {"alpha": 7, "gate_init": "zeros"}

    assert main(["lra", "eval", "--checkpoint", str(out / "best.pth"), "--data", str(listops_dir)]) == 0
    assert "test accuracy:" in capsys.readouterr().out

    assert main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "pola",
                 "--attention-option", "alpah=7", "--steps", "2"]) == 2
    assert "unknown option(s) alpah" in capsys.readouterr().err
    assert main(["lra", "train", "--task", "text", "--data", str(tmp_path / "nowhere"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polaformer lra: error:") and len(err.strip().splitlines()) == 1
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    assert main(["lra", "eval", "--checkpoint", str(tmp_path / "bad.pth"), "--data", str(listops_dir)]) == 2
    assert "bad.pth" in capsys.readouterr().err


def test_cli_train_checks_the_final_configuration_once(listops_dir, tmp_path, monkeypatch, capsys):
    import polaformer.tasks.lra.config as lra_config_module

    checks = counted(monkeypatch, lra_config_module, "check_lra_config")
    ranges = counted(monkeypatch, lra_config_module, "check_settings")
    assert main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "pola",
                 "--attention-option", "alpha=5", "--steps", "2", "--batch-size", "8", "--eval-every", "2",
                 "--opts", "model.dim", "16", "model.head_dim", "8", "model.num_layers", "1", "--output",
                 str(tmp_path / "run")]) == 0
    assert len(checks) == 1 and len(ranges) == 1
    (checked,) = checks[0]  # the configuration as trained: flags, options and the shortened warm-up applied
    assert checked.attention == "pola" and checked.attention_options.to_dict() == {"alpha": 5}
    assert (checked.train.steps, checked.train.warmup_steps, checked.model.dim) == (2, 0, 16)


def test_cli_generate_listops_reports_labels_and_lengths(tmp_path, capsys):
    assert main(["lra", "generate", "listops", "--out", str(tmp_path), "--train", "20", "--val", "5", "--test", "5",
                 "--min-length", "10", "--max-length", "30", "--max-depth", "3"]) == 0
    printed = capsys.readouterr().out
    assert "train: 20 examples" in printed and "length histogram" in printed
    assert {p.name for p in tmp_path.iterdir()} >= {"basic_train.tsv", "basic_val.tsv", "basic_test.tsv"}


def test_train_lra_on_in_memory_splits_of_a_dual_task(tmp_path):
    """Retrieval (two documents per example) goes through the same loop."""
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(1, 512, (n,), generator=gen).numpy()

    pairs = LRADataset("retrieval", [rand(12) for _ in range(16)], [i % 2 for i in range(16)],
                       [rand(7) for _ in range(16)])
    cfg = tiny_cfg(attention="pacs", steps=2, eval_every=2, warmup_steps=0)
    cfg.task = "retrieval"
    summary = train_lra(cfg, None, tmp_path, splits=LRASplits(pairs, pairs, pairs), show_progress=False)
    assert summary["test_examples"] == 16 and summary["majority_class_test_accuracy"] == 50.0


def test_cli_refuses_an_option_value_the_layer_rejects(listops_dir, capsys):
    assert main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "pola",
                 "--attention-option", "gate_init=xavier", "--steps", "2"]) == 2
    assert "cannot build the pola model: unknown gate_init 'xavier'" in capsys.readouterr().err


def test_cli_curves_plots_runs_side_by_side(listops_dir, tmp_path, capsys):
    for attention in ("pola", "softmax"):
        train_lra(tiny_cfg(attention=attention, steps=4, eval_every=2), listops_dir, tmp_path / attention,
                  show_progress=False)
    png = tmp_path / "curves.png"
    assert main(["lra", "curves", str(tmp_path / "pola"), str(tmp_path / "softmax"), "--out", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "pola: best dev" in printed and "softmax: best dev" in printed and "majority class" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["lra", "curves", str(tmp_path), "--out", str(png)]) == 2
    assert "curves.png already exists: --overwrite replaces it" in capsys.readouterr().err
    assert main(["lra", "curves", str(tmp_path), "--out", str(png), "--overwrite"]) == 2
    assert "holds no metrics.json" in capsys.readouterr().err


def test_cli_run_folder_guarantees_come_from_the_engine(listops_dir, tmp_path, capsys, monkeypatch):
    """A finished run is refused unless continued or replaced, a busy folder is refused naming its holder,
    and Ctrl-C ends with status 130 naming the last checkpoint: the guarantees every engine task has."""
    from polaformer.engine.output import OutputLock
    from polaformer.tasks.lra.train import LRATask

    out = tmp_path / "run"
    base = ["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "pola", "--batch-size", "8",
            "--eval-every", "2", "--output", str(out)]
    assert main([*base, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "2"]) == 2
    assert "already holds a run (last.pth" in capsys.readouterr().err
    assert main([*base, "--steps", "4", "--resume", "auto"]) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    assert main([*base, "--steps", "2", "--overwrite"]) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2]

    lock = OutputLock(out)
    try:
        assert main([*base, "--steps", "2", "--resume", "auto"]) == 2
    finally:
        lock.release()
    assert "is in use by process" in capsys.readouterr().err

    step = LRATask.step
    calls = []

    def interrupt_at_third_step(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self, *args)

    monkeypatch.setattr(LRATask, "step", interrupt_at_third_step)
    assert main([*base, "--steps", "6", "--overwrite"]) == 130
    assert capsys.readouterr().err.strip().endswith(f"interrupted; last saved checkpoint: {out / 'last.pth'}")
    assert not (out / ".polaformer.lock").exists()


def test_checkpoints_of_the_earlier_lra_layout_still_evaluate_and_resume(listops_dir, tmp_path, capsys):
    """Before the one engine, LRA wrote its own layout: 'step' counted updates, 'scheduler', one 'rng'."""
    cfg = tiny_cfg(steps=4, eval_every=2, save_every=2)

    def crash_at(step):
        if step == 3:
            raise Crash

    with pytest.raises(Crash):
        train_lra(cfg, listops_dir, tmp_path / "new", show_progress=False, on_step=crash_at)
    new = torch.load(tmp_path / "new" / "last.pth", weights_only=True)
    assert new["num_updates"] == 2
    window = new["window"][0]
    old = {"model": new["model"], "optimizer": new["optimizer"], "scheduler": new["lr_scheduler"],
           "scaler": new["scaler"], "step": 2, "best": {"accuracy": new["best"]["dev_accuracy"], "step": 2},
           "history": new["history"],
           "window": {"loss": window["loss_sum"], "correct": 0.0, "seen": window["samples"], "time": 0.0},
           "rng": new["rng"][0], "config": new["config"], "model_config": new["model_config"]}
    (tmp_path / "old").mkdir()
    torch.save(old, tmp_path / "old" / "last.pth")
    assert main(["lra", "eval", "--checkpoint", str(tmp_path / "old" / "last.pth"), "--data", str(listops_dir)]) == 0
    assert "step 2) <-" in capsys.readouterr().out
    summary = train_lra(cfg, listops_dir, tmp_path / "old", resume="auto", show_progress=False)
    assert [r["step"] for r in summary["history"]] == [2, 4] and summary["steps"] == 4


def test_config_takes_base_files_and_opts(tmp_path):
    (tmp_path / "base.yaml").write_text("task: text\ntrain: {lr: 0.5, seed: 3}\nmodel: {num_layers: 1}\n")
    (tmp_path / "run.yaml").write_text("BASE: base.yaml\ntrain: {lr: 0.25}\n")
    cfg = load_lra_config(tmp_path / "run.yaml",
                          opts=["train.seed", "5", "attention", "pola", "attention_options.alpha", "3"])
    assert (cfg.task, cfg.train.lr, cfg.train.seed, cfg.model.num_layers) == ("text", 0.25, 5, 1)
    assert cfg.train.warmup_steps == RECIPES["text"]["warmup_steps"]  # the file's task chose the recipe
    assert cfg.attention_options.to_dict() == {"alpha": 3}
    with pytest.raises(LRAConfigError, match="config for task 'text', not 'listops'"):
        load_lra_config(tmp_path / "run.yaml", task="listops")


def test_cli_opts_reach_the_run(listops_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--attention", "softmax",
                 "--steps", "2", "--batch-size", "8", "--eval-every", "2", "--output", str(out),
                 "--opts", "model.num_layers", "1", "model.dim", "16", "model.hidden_dim", "16", "model.head_dim", "8"])
    err = capsys.readouterr().err
    assert code == 0, err
    saved = json.loads((out / "metrics.json").read_text())["config"]
    assert saved["model"]["num_layers"] == 1 and saved["model"]["dim"] == 16
    code = main(["lra", "train", "--task", "listops", "--data", str(listops_dir), "--output", str(tmp_path / "x"),
                 "--opts", "train.stepz", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown config key 'train.stepz'" in err and err.count("\n") == 1
