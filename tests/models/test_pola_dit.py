"""pola_dit_*: the official PolaDiT's state_dict keys and shapes (manifest made from the official class by
scripts/dit_reference.py), a strict load of official weights with equal float64 outputs, the timestep embedding
and the sin-cos table, and one-line errors on bad inputs.

Tolerances (tests/README.md, tests/tolerances.py): the float64 fixture at 1e-10, far above reorder_rtol(n, float64)
through the tiny model (a few hundred terms per sum: 1e-13·κ per layer); the float32 timestep table against the
official one at float32's rounding of its arguments (_float32_rounding_bound)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

import polaformer.models  # noqa: F401  (registers pola_dit_*)
from dit_helpers import use_recorded_embedding
from polaformer.models.pola_dit import PolaDiT, sincos_pos_table, timestep_frequencies

DATA = Path(__file__).resolve().parent.parent / "data" / "pola_dit"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


def _ours(official_name: str) -> str:
    size, patch = official_name.removeprefix("DiT-").split("/")
    return f"pola_dit_{size.lower()}_{patch}"


@pytest.mark.parametrize("official", sorted(MANIFEST["models"]))
def test_state_dict_matches_official_manifest(official):
    record = MANIFEST["models"][official]
    with torch.device("meta"):
        model = timm.create_model(_ours(official))
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == record["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == record["num_params"]
    assert not model.pos_embed.requires_grad


@pytest.mark.numerics
def test_official_tiny_weights_load_strictly_and_match_in_float64(monkeypatch):
    """The network in float64 on the official float32 timestep embedding (recorded with the outputs): the
    embedding's last bits depend on the CPU's vector instructions (tests/dit_helpers.py), the rest must not."""
    ref = load_file(str(DATA / "tiny_float64.safetensors"))
    weights = {k.removeprefix("weights."): v for k, v in ref.items() if k.startswith("weights.")}
    model = PolaDiT(**MANIFEST["tiny"]).double().eval()
    model.load_state_dict(weights, strict=True)
    use_recorded_embedding(monkeypatch, ref["input.t"], ref["input.t_frequencies"])
    with torch.no_grad():
        out = model(ref["input.x"], ref["input.t"], ref["input.y"])
    assert out.shape == (3, 6, 8, 8)
    torch.testing.assert_close(out, ref["output"], rtol=1e-10, atol=1e-10)


def _float32_rounding_bound(t: torch.Tensor, dim: int) -> torch.Tensor:
    """|Δ| allowed between two float32 evaluations of [cos(t·f) ; sin(t·f)]: a frequency from another exp is
    off by an ulp (2^-24 relative), t·f rounds to float32 (another 2^-24 relative) and cos/sin err by an ulp or
    two; twice that, 2^-21·(1 + t·f)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    bound = 2.0 ** -21 * (1 + t.double()[:, None] * freqs)
    return torch.cat([bound, bound], dim=1)


@pytest.mark.numerics
def test_timestep_embedding_is_the_official_float32_table():
    """Equal to the official float32 table within float32's rounding, also when the frequencies come out an ulp
    off (what another instruction set's exp gives): the fixture holds on every CPU, a wrong formula does not."""
    ref = load_file(str(DATA / "tiny_float64.safetensors"))
    t, official = ref["input.t"], ref["input.t_frequencies"]
    ours = timestep_frequencies(t, official.shape[1])
    assert ours.dtype == torch.float32  # as the checkpoints were trained
    bound = _float32_rounding_bound(t, official.shape[1])
    assert ((ours.double() - official.double()).abs() <= bound).all()
    half = official.shape[1] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    for direction in (float("inf"), float("-inf")):
        args = t.float()[:, None] * freqs.nextafter(torch.tensor(direction))
        other = torch.cat([args.cos(), args.sin()], dim=1)
        assert ((other.double() - official.double()).abs() <= bound).all()
    assert (ours[0] == torch.cat([torch.ones(half), torch.zeros(half)])).all()  # t = 0 is exact everywhere
    wrong = timestep_frequencies(t, official.shape[1], max_period=1000.0)
    assert not ((wrong.double() - official.double()).abs() <= bound).all()


def _other_capabilities() -> list[str]:
    """The ATen CPU capabilities below this machine's own ('default', then the x86 levels): the tests of this
    process already ran under its own."""
    levels = ["default", "avx2", "avx512"]
    own = torch.backends.cpu.get_cpu_capability().lower()
    return levels[:levels.index(own)] if own in levels else []


def test_fixture_comparisons_hold_under_every_cpu_capability():
    """The float64 fixtures of PolaDiT and its sampler, run again with ATen's kernels forced to each other
    instruction set this CPU has (ATEN_CPU_CAPABILITY), in subprocesses side by side."""
    if not _other_capabilities():
        pytest.skip(f"no CPU capability below {torch.backends.cpu.get_cpu_capability()} here")
    tests = ["tests/models/test_pola_dit.py::test_official_tiny_weights_load_strictly_and_match_in_float64",
             "tests/models/test_pola_dit.py::test_timestep_embedding_is_the_official_float32_table",
             "tests/tasks/test_diffusion.py::test_sampling_chains_equal_the_official"]
    root = Path(__file__).resolve().parents[2]
    runs = {cap: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                   "-o", "addopts=", *tests], cwd=root, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1"})
            for cap in _other_capabilities()}
    for cap, run in runs.items():
        output = run.communicate(timeout=600)[0]
        assert run.returncode == 0, f"ATEN_CPU_CAPABILITY={cap}:\n{output[-3000:]}"


def test_pos_embed_is_the_official_table():
    ref = load_file(str(DATA / "tiny_float64.safetensors"))
    official = ref["weights.pos_embed"]  # computed in float64, stored as float32 by the official model
    torch.testing.assert_close(sincos_pos_table(16, 4).float().double().unsqueeze(0), official, rtol=0, atol=0)


def test_null_class_only_with_class_dropout():
    assert PolaDiT(input_size=4, patch_size=2, hidden_size=8, depth=1, num_heads=2, num_classes=3).null_class == 3
    model = PolaDiT(input_size=4, patch_size=2, hidden_size=8, depth=1, num_heads=2, num_classes=3,
                    class_dropout_prob=0)
    assert model.null_class is None and model.y_embedder.embedding_table.num_embeddings == 3


def test_softmax_baseline_has_the_original_dit_keys():
    model = PolaDiT(input_size=4, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2,
                    attention="softmax")
    keys = {k for k in model.state_dict() if k.startswith("blocks.0.attn.")}
    assert keys == {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight",
                    "blocks.0.attn.proj.bias"}
    x = torch.randn(2, 1, 4, 4)
    assert model(x, torch.tensor([3, 4]), torch.tensor([0, 1])).shape == (2, 2, 4, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_size=6, patch_size=4), "patch_size 4 must divide input_size 6"),
    (dict(attention="flash"), "unknown attention 'flash'"),
    (dict(class_dropout_prob=1.0), "class_dropout_prob must be in"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolaDiT(**{**dict(input_size=8, patch_size=2, hidden_size=8, depth=1, num_heads=2), **kwargs})


def test_wrong_image_size_is_one_line_error():
    model = PolaDiT(input_size=8, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2)
    with pytest.raises(ValueError, match=r"expects images of shape \(B, 1, 8, 8\), got \(2, 1, 16, 16\)"):
        model(torch.randn(2, 1, 16, 16), torch.zeros(2), torch.zeros(2, dtype=torch.long))


def test_pretrained_has_no_download():
    with pytest.raises(ValueError, match="no downloadable weights"):
        timm.create_model("pola_dit_s_2", pretrained=True)
