"""Shared checks for the model-zoo tests: manifests, FLOPs and reference vectors."""
import json

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import REFERENCE, load_vector, official_state_dict, require_reference
from polaformer.compat import from_official
from polaformer.models.pvt import HeldNorm


def load_manifest(name: str) -> dict:
    path = require_reference(REFERENCE / "manifests" / f"{name}.json")
    return json.loads(path.read_text())


def check_manifest(name: str) -> None:
    """Keys, shapes, parameter count and MACs of ``timm.create_model(name)`` against the official manifest.

    The manifest counts the official parameters. Pola-PVT holds the official final norm, which the
    official model builds but never applies, as buffers (``HeldNorm``: same keys and shapes, no
    parameter that never gets a gradient), so those elements are counted with the parameters here.
    """
    manifest = load_manifest(name)
    size = manifest["img_size"]
    with torch.device("meta"):
        model = timm.create_model(name)
        ours = {k: list(v.shape) for k, v in model.state_dict().items()}
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, 3, size, size))
    assert ours == {key: shape for key, shape, _ in manifest["state_dict"]}
    held = sum(b.numel() for m in model.modules() if isinstance(m, HeldNorm) for b in m.buffers())
    assert sum(p.numel() for p in model.parameters()) + held == manifest["num_params"]
    gmacs = counter.get_total_flops() / 2e9
    assert abs(gmacs / manifest["flops_fvcore_style_gmacs"] - 1) < 0.01


def check_vector(case: str, intermediate_outputs) -> None:
    """Strict float64 load of a whole-model vector; output and every stored intermediate within tolerance.

    ``intermediate_outputs(model, x)`` returns ``{name: tensor}`` for the names the vector lists.
    """
    record, tensors = load_vector(case)
    model = from_official(record).double()
    model.load_state_dict(official_state_dict(tensors), strict=True)
    model.eval()
    hint = record["tolerance_hint"]
    with torch.no_grad():
        out = model(tensors["input"])
        found = intermediate_outputs(model, tensors["input"])
    assert (out - tensors["output"]).abs().max().item() <= hint * max(1.0, record["output_abs_max"])
    listed = [k[len("intermediate."):] for k in tensors if k.startswith("intermediate.")]
    assert listed, "vector lists no intermediates"
    for name in listed:
        ref = tensors[f"intermediate.{name}"]
        got = found[name]
        assert got.shape == ref.shape, name
        assert (got - ref).abs().max().item() <= hint * max(1.0, ref.abs().max().item()), name


def capture(model, names, x, extra=None):
    """Run ``model(x)`` with forward hooks on the named sub-modules; returns their outputs."""
    outputs = {}
    modules = dict(model.named_modules())
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o)) for n in names]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    if extra:
        outputs.update(extra(model, x))
    return outputs
