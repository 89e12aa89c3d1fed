"""No host synchronisation in a training step, checked without a GPU.

- The engine and the tasks: a classification run on the CPU records every op that reads a tensor's value on the
  host (``item``, ``is_nonzero``, ``equal``, ``tolist``, ...) with the code that asked for it. The only ones that
  polaformer's engine, tasks, layers and models ask for during training are the engine's reads of the losses,
  every ``read_every`` batches. Left out: reads inside ``polaformer/ops`` and ``polaformer/backends``, the
  value checks the ops make on CPU tensors only (the last tests show they stay off other devices), and reads
  inside torch itself (the optimizers' step counts and the data loader's seeds are CPU tensors whatever the
  device).
- The layers and models: every family's forward, backward and AdamW step on the ``meta`` device, which like
  CUDA skips the CPU-only checks, calls no op that needs a value, nor a copy from the host that waits.

tests/gpu/test_gpu_no_sync.py runs the same steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import pytest
import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import polaformer
from engine.test_engine import random_data, tiny_config
from polaformer.engine.loop import Engine, LoopSettings, StepOutput, Task, TrainingDivergedError
from polaformer.models.pola_dit import PolaDiT
from polaformer.models.pola_sr import PolaSR
from polaformer.tasks.classification import build_trainer
from polaformer.tasks.lra.model import LRAClassifier, LRAModelConfig

PACKAGE = Path(polaformer.__file__).parent
TORCH = Path(torch.__file__).parent
# torch's frames between the code that asks for a value and the dispatcher (Tensor methods, dynamo's guards)
PASSING = ("_tensor.py", "_compile.py", "_dynamo", "overrides.py", "utils/_python_dispatch.py")
VALUE_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
               "_unique2"}


def _passing(path: Path) -> bool:
    return path.is_relative_to(TORCH) and path.relative_to(TORCH).as_posix().startswith(PASSING)


def _caller(stack) -> str:
    """Where a read was asked for: the innermost frame outside torch's wrappers (PASSING), as ``path:function``,
    the path relative to the package for polaformer's own code."""
    frame = [f for f in stack if not _passing(Path(f.filename))][-1]
    path = Path(frame.filename)
    return f"{path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path}:{frame.name}"


class ValueReads(TorchDispatchMode):
    """Records the ops that read values on the host (see VALUE_READS), and copies from the host to another
    device that wait for it: (``context()``, op name, where it was called from). ``only_devices`` skips ops on
    CPU tensors."""

    def __init__(self, only_devices: bool = False, context=lambda: None):
        super().__init__()
        self.only_devices, self.context = only_devices, context
        self.calls: list[tuple] = []

    def record(self, name: str) -> None:
        self.calls.append((self.context(), name, _caller(traceback.extract_stack()[:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        reads = name in VALUE_READS and (not self.only_devices or any(t.device.type != "cpu" for t in tensors))
        if name == "_to_copy" and tensors:
            reads = self._blocking_upload(tensors[0], kwargs.get("device"), kwargs.get("non_blocking", False))
        elif name == "copy_":
            reads = self._blocking_upload(args[1], args[0].device, args[2] if len(args) > 2 else
                                          kwargs.get("non_blocking", False))
        if reads:
            self.record(name)
        return func(*args, **kwargs)

    @staticmethod
    def _blocking_upload(source, device, non_blocking: bool) -> bool:
        return (device is not None and source.device.type == "cpu" and torch.device(device).type != "cpu"
                and not non_blocking)


@contextmanager
def uploads_recorded():
    """Yields the places where host data is made into a tensor on another device (``torch.tensor(data,
    device=...)`` and the like: a copy that waits for the device, for which the dispatcher sees no op).
    Not active while a model is built under ``torch.device(...)``, which recognises torch's own functions."""
    made = []

    def recording(original, device_of):
        def make(*args, **kwargs):
            device = device_of(args, kwargs)
            if device is not None and torch.device(device).type != "cpu" and not torch.is_tensor(args[-1]):
                made.append(_caller(traceback.extract_stack()[:-1]))
            return original(*args, **kwargs)
        return make

    def device_kwarg(args, kwargs):
        return kwargs.get("device")

    with (mock.patch.object(torch, "tensor", recording(torch.tensor, device_kwarg)),
          mock.patch.object(torch, "as_tensor", recording(torch.as_tensor, device_kwarg)),
          mock.patch.object(torch.Tensor, "new_tensor", recording(
              torch.Tensor.new_tensor, lambda args, kwargs: kwargs.get("device", args[0].device)))):
        yield made


# --- the engine and the tasks ----------------------------------------------------------------

def test_the_loop_reads_the_losses_only_every_read_every_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAFORMER_NATIVE", "0")  # the ops' torch formulation: no kernels to build first
    trainer = build_trainer(tiny_config(tmp_path, "TRAIN.EPOCHS", "1"), data=random_data())  # 6 batches
    trainer.settings.read_every = 4
    state = {"batch": 0, "training": True}  # the batch trained last, until the evaluation starts
    reads = ValueReads(context=lambda: state["batch"] if state["training"] else None)
    step, evaluate, tolist = trainer.task.step, trainer.task.evaluate, torch.Tensor.tolist

    def counted_step(*args):
        state["batch"] += 1
        return step(*args)

    def marked_evaluate(*args):
        state["training"] = False
        return evaluate(*args)

    def recorded_tolist(tensor):
        reads.record("tolist")
        return tolist(tensor)

    monkeypatch.setattr(trainer.task, "step", counted_step)
    monkeypatch.setattr(trainer.task, "evaluate", marked_evaluate)
    monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)
    try:
        with reads:
            trainer.fit()
    finally:
        trainer.close()
    training = [(batch, name, where) for batch, name, where in reads.calls if batch is not None]
    assert any(where.startswith("ops/") for _, _, where in training)  # the recorder sees the CPU-only checks
    ours = [call for call in training if not call[2].startswith(("/", "ops/", "backends/"))]
    assert ours == [(4, "tolist", "engine/loop.py:_read"), (6, "tolist", "engine/loop.py:_read")]


class DivergingTask(Task):
    """A linear model whose loss is NaN at its second batch."""

    name = "diverging"
    best_files = {}

    def __init__(self):
        self.train_set = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
        self.batches = 0

    def build(self, engine, resuming):
        return nn.Linear(3, 2)

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_scheduler(self, optimizer, updates_per_epoch, total_updates):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def step(self, model, batch, device):
        self.batches += 1
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        return StepOutput(loss * float("nan") if self.batches == 2 else loss, len(y))


@pytest.mark.parametrize("read_every, batches_run", [(None, 2), (4, 4)])
def test_a_divergence_names_its_step_at_the_next_read(tmp_path, read_every, batches_run):
    # On the CPU the engine reads every batch; with reads every 4 batches it trains on to the 4th.
    task = DivergingTask()
    engine = Engine(task, LoopSettings(output=tmp_path, batch_size=1, steps=8, device="cpu", show_progress=False,
                                       read_every=read_every))
    try:
        with pytest.raises(TrainingDivergedError, match=r"^training diverged at step 2, loss nan "):
            engine.fit()
    finally:
        engine.close()
    assert task.batches == batches_run
    assert not (tmp_path / "last.pth").exists()


# --- the layers and models -------------------------------------------------------------------

def _image_model(name, size, **kwargs):
    return lambda: (timm.create_model(name, num_classes=10, **kwargs), (torch.randn(2, *size),))


def _lra(attention):
    def make():
        cfg = LRAModelConfig(vocab_size=32, num_classes=3, max_len=32, attention=attention, dropout=0.0,
                             attention_dropout=0.0)
        tokens = torch.randint(0, 32, (2, 32))
        padding = torch.arange(32) >= torch.tensor([32, 5])[:, None]
        return LRAClassifier(cfg), (tokens, padding)
    return make


# name -> () -> (a tiny model of the family, CPU inputs of one batch)
FAMILIES = {
    "pola_pvt": _image_model("pola_pvt_tiny", (3, 64, 64), depths=(1, 1, 1, 1)),
    "pola_pvt_v2": _image_model("pola_pvt_v2_b0", (3, 64, 64), depths=(1, 1, 1, 1)),
    "pola_swin": _image_model("pola_swin_t", (3, 64, 64), depths=(2, 1, 1, 1)),  # a shifted block in stage 1
    "pola_deit": _image_model("pola_deit_digits", (1, 8, 8)),
    "polaformer_pp": _image_model("POLA_b0", (3, 64, 64), depths=(1, 1, 1, 1)),
    "pola_dit": lambda: (PolaDiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=1, num_heads=2,
                                 num_classes=3),
                         (torch.randn(2, 4, 8, 8), torch.rand(2) * 999, torch.randint(0, 3, (2,)))),
    "pola_sr": lambda: (PolaSR(upscale=2, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4),
                        (torch.rand(2, 3, 8, 8),)),
    "pola_lm": lambda: (timm.create_model("pola_lm_tiny", context=16), (torch.randint(0, 256, (2, 16)),)),
    "pola_lm_pacs": lambda: (timm.create_model("pola_lm_tiny", context=16, attention="pacs"),
                             (torch.randint(0, 256, (2, 16)),)),
    "lra_pola": _lra("pola"),
    "lra_pacs": _lra("pacs"),
}


def training_step(model, inputs, optimizer, autocast=nullcontext()):
    """Forward (under ``autocast``), backward and optimizer step; returns the loss (any loss will do: the point
    is the step)."""
    with autocast:
        loss = model(*inputs).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_of_every_family_reads_no_value_off_the_cpu(family):
    with torch.device("meta"):  # built there too: no weights to initialise
        model, inputs = FAMILIES[family]()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    reads = ValueReads(only_devices=True)
    with reads, uploads_recorded() as uploads:
        training_step(model, inputs, optimizer)
    assert reads.calls == [] and uploads == []


def test_the_diffusion_loss_reads_no_value_off_the_cpu():
    # the variational bound's tables are made on the device, and the drawn steps and noise copied without a wait
    from polaformer.tasks.diffusion.gaussian import diffusion_loss, make_scheduler

    scheduler = make_scheduler()
    with torch.device("meta"):
        model = PolaDiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=1, num_heads=2,
                        num_classes=3)
        images, labels = torch.empty(2, 4, 8, 8), torch.zeros(2, dtype=torch.long)
    diffusion_loss(model, scheduler, images, labels)  # the scheduler moves its table over once
    reads = ValueReads(only_devices=True)
    with reads, uploads_recorded() as uploads:
        diffusion_loss(model, scheduler, images, labels)["loss"].mean().backward()
    assert reads.calls == [] and uploads == []


def test_the_recorders_see_value_reads_and_blocking_uploads():
    reads = ValueReads(only_devices=True)
    x = torch.ones(2, device="meta")
    with reads, uploads_recorded() as uploads:
        torch.ones(2).to("meta")
        torch.ones(2).to("meta", non_blocking=True)
        x.copy_(torch.ones(2))
        with pytest.raises(RuntimeError):  # meta tensors have no values: the read fails after being recorded
            bool(x.sum())
        torch.ones(2).sum().item()  # a CPU tensor: not a device sync
        torch.tensor([1.0, 2.0], device="meta")
        x.new_tensor([3.0])
        torch.as_tensor(x, device="meta")  # already there: no copy
        torch.tensor([4.0])
    assert [name for _, name, _ in reads.calls] == ["_to_copy", "copy_", "_local_scalar_dense"]
    functions = [where.rsplit(":", 1)[1] for where in uploads]
    assert functions == ["test_the_recorders_see_value_reads_and_blocking_uploads"] * 2
