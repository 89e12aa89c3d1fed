"""accelerate(model, inference=True): PolaFormer++'s stem and PatchMerging convs with their BatchNorm folded in, GELU
fused.

Tolerances (tests/README.md, tests/tolerances.py): float64 folded against unfolded at 1e-12, far above reorder_rtol(n,
float64) (3x3 x 8 channels: 72 terms, 1.6e-14·κ); float32 against float64 at 1e-5 is probable_rtol of those 72 terms
(8e-6), and 1e-4 for the whole POLA_b0 model as in test_accelerate.py."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import polaformer.models.polapp as polapp
from polaformer import accelerate
from polaformer.backends.cpu.conv import conv2d_gelu, fold_batch_norm

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default


def _randomise_norms(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
                m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.num_features, generator=gen))
    return model


@pytest.mark.parametrize("bias,affine", [(True, True), (False, True), (True, False)])
def test_fold_batch_norm_equals_conv_then_norm_in_float64(bias, affine):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 10, 3, stride=2, padding=1, bias=bias).double()
    bn = _randomise_norms(nn.BatchNorm2d(10, affine=affine).double().eval()) if affine else nn.BatchNorm2d(
        10, affine=False).double().eval()
    if not affine:
        bn.running_mean.normal_(std=0.2)
        bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, 9, 11, dtype=torch.float64)
    weight, shift = fold_batch_norm(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                    bn.eps)
    assert weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(F.conv2d(x, weight, shift, 2, 1), bn(conv(x)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gelu", [False, True])
def test_conv2d_gelu_fused_and_plain_paths_agree(gelu):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 15, 13).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(12, 8, 3, 3) / 8, torch.randn(12)
    ref = F.conv2d(x.double(), weight.double(), bias.double(), 2, 1)
    ref = F.gelu(ref) if gelu else ref
    with torch.no_grad():
        fused = conv2d_gelu(x, weight, bias, 2, 1, gelu)  # oneDNN with GELU as a post-op
    torch.testing.assert_close(fused.double(), ref, rtol=1e-5, atol=1e-5)
    plain = conv2d_gelu(x.double(), weight.double(), bias.double(), (2, 2), (1, 1), gelu)  # float64: F.conv2d
    torch.testing.assert_close(plain, ref, rtol=1e-12, atol=1e-12)


@pytest.fixture
def model():
    return _randomise_norms(polapp.POLA_b0(num_classes=10)).eval()


def test_inference_folding_gives_the_unfolded_output(model):
    plain = copy.deepcopy(model)
    accelerate(model, inference=True)
    names = {type(m).__name__ for m in model.modules()}
    assert "BatchNorm2d" in names  # only the head's norm, which follows a 1x1 conv, is left
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 1
    assert sum(type(m).__name__ == "FoldedConv2d" for m in model.modules()) == 7  # four stem convs, three mergings
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        folded = model(x)
        reference = plain.double()(x.double())
    torch.testing.assert_close(folded.double(), reference, rtol=1e-4, atol=1e-5)


def test_inference_folding_refuses_a_model_in_training_mode(model):
    with pytest.raises(ValueError, match="model.eval"):
        accelerate(model.train(), inference=True)


def test_folded_model_drops_the_norm_keys_and_refuses_unfolded_weights_loudly(model):
    plain_keys = set(model.state_dict())
    folded = accelerate(copy.deepcopy(model), inference=True)
    assert "patch_embed.proj.1.running_var" in plain_keys
    assert "patch_embed.proj.1.running_var" not in folded.state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        folded.load_state_dict(model.state_dict())
