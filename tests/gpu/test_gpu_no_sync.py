"""On a CUDA device: a training step of every model family (forward in bf16 autocast, backward, AdamW) and the
engine's steps through the real loop wait for the device nowhere: they run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at every operation that would (a value read on the
host, a blocking copy, a synchronisation). Skipped without CUDA; tests/engine/test_no_host_sync.py checks the same
without a GPU as far as the CPU can tell."""
from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.test_engine import random_data, tiny_config  # noqa: E402
from engine.test_no_host_sync import FAMILIES, training_step  # noqa: E402
from polaformer.tasks.classification import build_trainer  # noqa: E402


@contextmanager
def syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_waits_for_the_device_nowhere(family):
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    model = model.cuda().train()
    inputs = tuple(x.cuda() for x in inputs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        return training_step(model, inputs, optimizer, torch.autocast("cuda", dtype=torch.bfloat16))

    step()  # warm-up: the kernels compile and tune, the optimizer makes its state, lazy buffers move over
    with syncs_raise():
        loss = step()
    assert torch.isfinite(loss)


def test_the_engine_s_steps_wait_for_the_device_nowhere(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "DEVICE", "cuda", "AMP", "true", "AMP_DTYPE", "bfloat16", "TRAIN.EPOCHS", "1",
                      "TRAIN.EMA.ENABLE", "true", "TRAIN.EMA.DECAY", "0.9")  # 6 batches, gradient clipping on
    trainer = build_trainer(cfg, data=random_data())
    trainer.settings.read_every = 6  # the epoch's only read, after its last batch
    step, batches = trainer.task.step, [0]

    def step_checked_from_the_second_batch(*args):
        batches[0] += 1
        if batches[0] == 2:  # after a warm-up batch, as above
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        if batches[0] == 6:  # the read after this batch waits, by design
            torch.cuda.set_sync_debug_mode("default")
        return step(*args)

    monkeypatch.setattr(trainer.task, "step", step_checked_from_the_second_batch)
    try:
        summary = trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    assert batches[0] == 6 and math.isfinite(summary["epochs"][0]["train_loss"])
