"""The byte-level LM task: the seeded block split of the standard library's text, and a short run of
'polaformer lm train' that beats the unigram baseline on validation, then eval and sample from its checkpoint."""
from __future__ import annotations

import json

import torch

from polaformer.cli import main
from polaformer.data.text import BLOCK_BYTES
from polaformer.tasks.lm import stdlib_corpus, unigram_bits_per_byte


def test_split_is_seeded_capped_and_alike():
    train, valid = stdlib_corpus(max_bytes=5 * BLOCK_BYTES + 7, seed=0)
    assert len(train) == len(valid) == 5 * BLOCK_BYTES + 7
    again, _ = stdlib_corpus(max_bytes=5 * BLOCK_BYTES + 7, seed=0)
    other, _ = stdlib_corpus(max_bytes=5 * BLOCK_BYTES + 7, seed=1)
    assert torch.equal(train, again) and not torch.equal(train, other)
    train_blocks = {bytes(b.tolist()) for b in train[:5 * BLOCK_BYTES].reshape(5, -1)}
    assert not train_blocks & {bytes(b.tolist()) for b in valid[:5 * BLOCK_BYTES].reshape(5, -1)}
    # both splits draw blocks from the whole library: the training bytes' unigram model fits validation as well
    # as it fits the training bytes themselves
    train, valid = stdlib_corpus()
    assert abs(unigram_bits_per_byte(train, valid) - unigram_bits_per_byte(train, train)) < 0.05


def test_short_run_beats_unigram_then_evaluates_and_samples_past_its_context(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["lm", "train", "--context", "32", "--steps", "60", "--batch-size", "16", "--lr", "1e-2",
                 "--eval-every", "60", "--max-bytes", "40000", "--output", str(out),
                 "--opts", "train.eval_batches", "8", "train.warmup_steps", "6"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["best_valid_bpb"] < metrics["unigram_valid_bpb"] - 0.4, metrics
    capsys.readouterr()
    assert main(["lm", "eval", "--checkpoint", str(out / "best.pth"), "--batches", "2"]) == 0
    assert "valid bits/byte" in capsys.readouterr().out
    assert main(["lm", "sample", "--checkpoint", str(out / "best.pth"), "--prompt", "import ", "--length", "50",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import ") and len(text.encode("utf-8", errors="replace")) >= 50
