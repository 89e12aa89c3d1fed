"""On a CUDA device: every model family and the LRA model train three steps in bf16 autocast with finite losses and
gradients, close to the same steps in fp32, and ``polaformer throughput --device cuda`` runs. Skipped without CUDA
(CI has no GPU); the Triton kernels themselves are tested in tests/backends/triton, on CUDA when present."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import timm  # noqa: E402

import polaformer.models  # noqa: E402,F401  (registers the models)
from models.test_timm_conformance import SMALLEST  # noqa: E402
from polaformer.tasks.lra.model import LRAClassifier, LRAModelConfig  # noqa: E402

STEPS = 3
# bf16 keeps 8 bits of mantissa: after three steps the losses and logits of the two runs differ by a few
# percent at most (relative RMS).
BF16_TOLERANCE = 5e-2


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def train_steps(model, batch, loss_fn, autocast: bool):
    """Three SGD steps; returns (losses, logits of the last step). Asserts finite losses and gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(*batch["inputs"])
            loss = loss_fn(logits.float(), batch["target"])
        loss.backward()
        assert torch.isfinite(loss), loss
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), name
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), logits.detach().float()


def check_bf16_against_fp32(model, batch, loss_fn):
    model_bf16 = copy.deepcopy(model)
    losses, logits = train_steps(model, batch, loss_fn, autocast=False)
    losses_bf16, logits_bf16 = train_steps(model_bf16, batch, loss_fn, autocast=True)
    assert relative_rms(losses_bf16, losses) < BF16_TOLERANCE
    assert relative_rms(logits_bf16, logits) < BF16_TOLERANCE


@pytest.mark.parametrize("name", list(SMALLEST))
def test_model_trains_in_bf16_autocast_like_fp32(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, drop_rate=0.0, drop_path_rate=0.0).cuda().train()
    batch = {"inputs": (torch.randn(4, *SMALLEST[name], device="cuda"),),
             "target": torch.randint(0, 10, (4,), device="cuda")}
    check_bf16_against_fp32(model, batch, torch.nn.functional.cross_entropy)


@pytest.mark.parametrize("attention", ["pola", "pacs", "softmax"])
def test_lra_model_trains_in_bf16_autocast_like_fp32(attention):
    torch.manual_seed(0)
    cfg = LRAModelConfig(vocab_size=32, num_classes=3, max_len=128, attention=attention, dropout=0.0,
                         attention_dropout=0.0)
    model = LRAClassifier(cfg).cuda().train()
    tokens = torch.randint(0, 32, (4, 128), device="cuda")
    padding = torch.arange(128, device="cuda") >= torch.tensor([128, 100, 37, 1], device="cuda")[:, None]
    batch = {"inputs": (tokens, padding), "target": torch.randint(0, 3, (4,), device="cuda")}
    check_bf16_against_fp32(model, batch, torch.nn.functional.cross_entropy)


@pytest.mark.parametrize("amp", [False, True])
def test_throughput_command_on_cuda(amp):
    command = [sys.executable, "-m", "polaformer", "throughput", "--model", "POLA_b0", "--batch-size", "4",
               "--iters", "2", "--warmup", "1", "--device", "cuda", *(["--amp"] if amp else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "images/s" in result.stdout and "cuda" in result.stdout
