"""The exported formulations of the bidirectional ops (what torch.export and the ONNX exporters see), against
the naive float64 references: zeros, key padding, odd value widths, RoPE; and at large magnitudes, finite and
equal to the log-domain graph form. Export is for inference: forward only."""
import pytest
import torch

import polaformer.ops.pacs.op as pacs_op
import polaformer.ops.pola.op as pola_op
from polaformer.ops import (
    learnable_power,
    naive_pacs_linear_attention,
    naive_pola_linear_attention,
    pacs_linear_attention,
    pacs_temperature,
    pola_linear_attention,
    rope_2d,
    rope_angles,
)
from polaformer.ops.pacs.formulation import pacs_attention_graph
from polaformer.ops.pola.formulation import pola_attention_graph

F64 = torch.float64


@pytest.fixture
def exported(monkeypatch):
    """The ops as torch.export sees them, with the export forms counted."""
    calls = []
    for module, name in ((pola_op, "pola_attention_export"), (pacs_op, "pacs_attention_export")):
        form = module._FORMS["export"]
        monkeypatch.setattr(module, "capturing", lambda: True)
        monkeypatch.setattr(module, "exporting", lambda: True)
        def counted(*args, _form=form, _name=name):
            calls.append(_name)
            return _form(*args)

        monkeypatch.setitem(module._FORMS, "export", counted)
    return calls


def _close(out, ref, rel):
    assert out.shape == ref.shape
    err, tol = (out - ref).abs().max().item(), rel * max(1.0, ref.abs().max().item())
    assert err <= tol, f"max |diff| {err:.3e} > {tol:.3e}"


def _pola_inputs(n, m, d, dv, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, t, w, generator=gen, dtype=dtype) for t, w in ((n, d), (m, d), (m, dv)))
    q[0, 0, 0, 0] = k[0, 1, 2, 1] = 0.0  # exact zeros land in neither half
    q[1, 2, 3] = 0.0  # a query row of zeros: output 0
    power = learnable_power(torch.randn(1, 3, 1, d, generator=gen, dtype=dtype), 4.0)
    return q, k, v, power


@pytest.mark.parametrize("n, m, d, dv", [(11, 7, 4, 6), (9, 9, 4, 5), (6, 5, 3, 3), (40, 40, 8, 8)])
def test_pola_export_form_equals_the_reference(exported, n, m, d, dv):
    q, k, v, power = _pola_inputs(n, m, d, dv, seed=n + dv)
    _close(pola_linear_attention(q, k, v, power), naive_pola_linear_attention(q, k, v, power), 1e-12)
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[1, m // 2:] = True
    _close(pola_linear_attention(q, k, v, power, key_padding_mask=mask),
           naive_pola_linear_attention(q, k, v, power, key_padding_mask=mask), 1e-12)
    assert exported == ["pola_attention_export"] * 2


@pytest.mark.parametrize("magnitude", [1e2, 1e8, 1e30])
def test_pola_export_form_stays_finite_and_exact_at_large_magnitudes(exported, magnitude):
    # |x|^p of these overflows float32 (and float64 past 1e61); the shifts keep every exponent <= 0
    q, k, v, power = _pola_inputs(13, 13, 4, 4, seed=3, dtype=torch.float32)
    q, k = q * magnitude, k * magnitude
    out = pola_linear_attention(q, k, v, power)
    ref = pola_attention_graph(q.double(), k.double(), v.double(), power.double(), 1e-6, None, 13)
    assert torch.isfinite(out).all()
    _close(out.double(), ref, 1e-5)  # float32 rounding of the exponents, times p


def _pacs_inputs(side, d, dv, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    n = side * side
    q, k, v = (torch.randn(2, 2, n, w, generator=gen, dtype=dtype) for w in (d, d, dv))
    q[0, 0, 0, 0] = 0.0
    temps = [pacs_temperature(torch.randn(1, 2, 1, 2 * d, generator=gen, dtype=dtype)) for _ in range(2)]
    sin, cos = rope_2d(rope_angles(2 * 2 * d, 2, dtype=dtype), side, side)
    return q, k, v, temps, sin, cos


@pytest.mark.parametrize("rope", [False, True])
def test_pacs_export_form_equals_the_reference(exported, rope):
    q, k, v, temps, sin, cos = _pacs_inputs(3, 8, 6, seed=5)
    tables = (sin, cos) if rope else (None, None)
    _close(pacs_linear_attention(q, k, v, *temps, *tables), naive_pacs_linear_attention(q, k, v, *temps, *tables),
           1e-12)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 5:] = True
    _close(pacs_linear_attention(q, k, v, *temps, key_padding_mask=mask),
           naive_pacs_linear_attention(q, k, v, *temps, key_padding_mask=mask), 1e-12)
    assert exported == ["pacs_attention_export"] * 2


@pytest.mark.parametrize("magnitude", [10.0, 60.0])
def test_pacs_export_form_is_finite_where_plain_features_overflow(exported, magnitude):
    # features e^|x| up to e^200: beyond float32 unless shifted. (The export form's limit, docs/export.md: a key
    # channel whose largest value exceeds every channel a query row uses by about 80.)
    q, k, v, temps, sin, cos = _pacs_inputs(3, 4, 4, seed=7, dtype=torch.float32)
    q, k = q * magnitude, k * magnitude
    out = pacs_linear_attention(q, k, v, *temps)
    ref = pacs_attention_graph(q.double(), k.double(), v.double(), *(t.double() for t in temps), None, None,
                                         1e-6, None, 9)
    assert torch.isfinite(out).all()
    _close(out.double(), ref, 1e-4)  # float32 rounding of exponents up to 60·3.5, relative
