"""polaformer.accelerate: every family's fused CPU modules compute the plain model's function, with the same
state_dict keys, forward and backward; inference folding gives the same outputs.

Tolerances (tests/README.md, tests/tolerances.py): float64 fused against plain at 1e-10, far above reorder_rtol(n,
float64) for sums of at most 768 terms (1.7e-13·κ); float32 whole models against float64 at 1e-4 (gradients 2e-3 of
their largest entry) is probable_rtol of the largest reductions (768 terms: 2.6e-5), the errors of successive layers
adding at random rather than in the worst case."""
import copy

import pytest
import timm
import torch
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn

import polaformer.models  # noqa: F401  (registers the models)
from polaformer import accelerate
from polaformer.export import INT8_MIN_FEATURES, quantize_int8

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

# the smallest variant of each family and its input
SMALLEST = {
    "pola_deit_digits": (1, 8, 8),
    "pola_pvt_tiny": (3, 64, 64),
    "pola_pvt_v2_b0": (3, 64, 64),
    "pola_swin_t": (3, 64, 64),
    "POLA_b0": (3, 64, 64),
}


def _randomise_norm_statistics(model):
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
    return model


@pytest.fixture(scope="module", params=list(SMALLEST))
def case(request):
    torch.manual_seed(0)
    name = request.param
    model = _randomise_norm_statistics(timm.create_model(name, num_classes=7, drop_path_rate=0.0))
    return name, model, torch.randn(2, *SMALLEST[name])


def test_keys_are_unchanged_and_weights_move_both_ways(case):
    name, plain, _ = case
    fast = accelerate(copy.deepcopy(plain))
    assert list(fast.state_dict()) == list(plain.state_dict())
    swapped = {type(m).__name__ for m in fast.modules()} - {type(m).__name__ for m in plain.modules()}
    assert "OnednnLinear" in swapped  # every family has projections
    assert not any(type(m) is nn.Linear for m in fast.modules())
    other = timm.create_model(name, num_classes=7)
    other.load_state_dict(fast.state_dict(), strict=True)
    accelerate(other).load_state_dict(plain.state_dict(), strict=True)


def test_eval_outputs_equal_the_plain_model(case):
    _, plain, x = case
    fast = accelerate(copy.deepcopy(plain)).eval()
    with torch.no_grad():
        expected = copy.deepcopy(plain).double().eval()(x.double())
        torch.testing.assert_close(fast(x).double(), expected, rtol=1e-4, atol=1e-4)
        folded = accelerate(copy.deepcopy(plain).eval(), inference=True)
        torch.testing.assert_close(folded(x).double(), expected, rtol=1e-4, atol=1e-4)


def test_training_step_gradients_equal_the_plain_model(case):
    _, plain, x = case
    fast = accelerate(copy.deepcopy(plain)).train()
    reference = copy.deepcopy(plain).double().train()
    torch.manual_seed(3)
    fast(x).square().mean().backward()
    reference(x.double()).square().mean().backward()
    for (name, p), q in zip(fast.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        scale = q.grad.abs().max().item() + 1e-12
        assert (p.grad.double() - q.grad).abs().max().item() <= 2e-3 * scale + 1e-6, name


def test_float64_runs_the_plain_function_exactly(case):
    _, plain, x = case
    plain64 = copy.deepcopy(plain).double().eval()
    fast64 = accelerate(copy.deepcopy(plain64))
    with torch.no_grad():
        torch.testing.assert_close(fast64(x.double()), plain64(x.double()), rtol=1e-10, atol=1e-12)


def test_accelerate_returns_the_model_and_is_idempotent(case):
    _, plain, x = case
    fast = copy.deepcopy(plain).eval()
    assert accelerate(fast) is fast
    kinds = [type(m) for m in fast.modules()]
    accelerate(fast)
    assert [type(m) for m in fast.modules()] == kinds


def test_int8_models_accelerate_around_their_quantized_layers(case):
    """An int8 model keeps its quantized layers under accelerate (the fused MLPs that read a weight fall back where
    it is quantized); the fused float32 parts move its output by less than quantizing moved it from float32."""
    name, plain, x = case
    int8 = quantize_int8(plain.eval())
    quantized = {n for n, m in int8.named_modules() if isinstance(m, nnqd.Linear)}
    assert quantized and all(type(m) is nn.Linear for n, m in plain.named_modules() if n in quantized)
    narrow = [n for n, m in int8.named_modules() if isinstance(m, nn.Linear)]
    assert all(min(m.in_features, m.out_features) < INT8_MIN_FEATURES for n, m in plain.named_modules() if n in narrow)
    fast = accelerate(copy.deepcopy(int8), inference=True)
    assert {n for n, m in fast.named_modules() if isinstance(m, nnqd.Linear)} == quantized
    with torch.inference_mode():
        reference, slow = plain(x), int8(x)
        assert ((fast(x) - slow).abs().max() <= (slow - reference).abs().max()), name
    with pytest.raises(ValueError, match="quantize before polaformer.accelerate"):
        quantize_int8(accelerate(copy.deepcopy(plain)))
