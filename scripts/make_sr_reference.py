"""Make the super-resolution test data from the official PolaFormer++ SR code (not run in CI).

    python scripts/make_sr_reference.py /path/to/PolaFormerPP

reads ``downstream/sr/basicsr/archs/mambairv2light_arch.py``, ``downstream/sr/basicsr/models/
mambairv2light_model.py`` and the lightSR option files of an official checkout, stubs what those files import
but never use here (basicsr's registries, its ``SRModel`` base class and helpers, mamba_ssm's selective scan,
einops), and writes

- ``tests/data/pola_sr_manifest.json``: state_dict keys, shapes and parameter counts of the ×2/×3/×4
  lightSR configurations;
- ``tests/data/pola_sr_reference.safetensors``: a tiny float64 model (its state_dict under ``state.``, its
  weights perturbed away from their initial constants), an input whose size is not a multiple of the window
  and the official output for it;
- ``tests/data/pola_sr_chop.json``: how the official test (``MambaIRv2LightModel.test``) partitions large
  images, for several sizes and scales: run on an image whose pixels hold their own row and column, with a
  probe network in place of the model, it records which window of the padded image each piece reads (and the
  sums of what it reads) and where the merged output takes each piece's pixels from.

Last run on ZacharyMeng/PolaFormerPP at commit fd26f5e1c1bcc3210f4d583294ebf9a4d01d62dc (torch 2.14.1, CPU).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

ARCH = "downstream/sr/basicsr/archs/mambairv2light_arch.py"
TEST_MODEL = "downstream/sr/basicsr/models/mambairv2light_model.py"
OPTIONS = "downstream/sr/options/train/mambairv2/train_MambaIRv2_lightSR_x{scale}.yml"
DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
# the tiny configuration of the float64 comparison (also written into the file's metadata)
TINY = dict(embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=4, mlp_ratio=1.0, upscale=3)
TINY_INPUT = (2, 3, 7, 10)
# (LR height, width), scale: one piece, 2x2 pieces, 3x1 and 4x3 with reflect padding on both sides
CHOP_CASES = [((57, 199), 2), ((200, 203), 3), ((431, 90), 4), ((650, 410), 2)]


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def load_official(checkout: Path):
    from timm.layers import to_2tuple

    class Registry:
        def register(self):
            return lambda cls: cls

    for package in ("basicsr", "basicsr.archs", "basicsr.models", "basicsr.utils", "mamba_ssm", "mamba_ssm.ops"):
        _stub(package)
    _stub("basicsr.archs.arch_util", to_2tuple=to_2tuple, trunc_normal_=torch.nn.init.trunc_normal_)
    _stub("basicsr.utils.registry", ARCH_REGISTRY=Registry(), MODEL_REGISTRY=Registry())
    _stub("basicsr.models.sr_model", SRModel=type("SRModel", (), {}))  # the test method needs none of it
    _stub("mamba_ssm.ops.selective_scan_interface", selective_scan_fn=None, selective_scan_ref=None)
    if importlib.util.find_spec("einops") is None:
        _stub("einops", rearrange=None, repeat=None)  # used by the selective scan only
    arch, test_model = (_module(name, checkout / path) for name, path in (("official_sr_arch", ARCH),
                                                                           ("official_sr_model", TEST_MODEL)))
    return arch.MambaIRv2Light, test_model.MambaIRv2LightModel


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _PieceProbe(torch.nn.Module):
    """Stands in for the network in the official test: records each piece it is given (its first pixel holds the
    row and column it was cut at, its channel sums what padding put in) and answers with its number and each
    output pixel's row and column within the piece."""

    def __init__(self, scale: int):
        super().__init__()
        self.scale, self.reads = scale, []

    def forward(self, piece: torch.Tensor) -> torch.Tensor:
        number = len(self.reads)
        self.reads.append([int(piece[0, 0, 0, 0]), int(piece[0, 1, 0, 0]), *piece.shape[-2:],
                           float(piece[0, 0].sum()), float(piece[0, 1].sum())])
        h, w = piece.shape[-2] * self.scale, piece.shape[-1] * self.scale
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack([torch.full((h, w), number), rows, cols])[None].to(piece.dtype)


def chop_partitions(test_model) -> list[dict]:
    """For each of ``CHOP_CASES``: the pieces the official test reads (``[top, left, height, width, row sum,
    column sum]``) and, per piece, the output window it fills (``[top, left, height, width]``) and the pixel of
    the piece's output that window starts at (``[row, column]``)."""
    cases = []
    for (h, w), scale in CHOP_CASES:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        tester = test_model.__new__(test_model)  # only test() runs: it needs lq, opt and net_g
        tester.lq = torch.stack([rows, cols, torch.zeros_like(rows)])[None].double()
        tester.opt, tester.net_g = {"scale": scale}, _PieceProbe(scale)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # its merge buffer takes the default dtype
        try:
            tester.test()
        finally:
            torch.set_default_dtype(default)
        out = tester.output[0]
        assert out.shape[-2:] == (h * scale, w * scale)
        writes = []
        for number in range(len(tester.net_g.reads)):
            mine = out[0] == number
            where = mine.nonzero()
            (top, left), (bottom, right) = where.min(0).values.tolist(), where.max(0).values.tolist()
            assert mine[top:bottom + 1, left:right + 1].all() and mine.sum() == len(where)
            start = [int(out[1, top, left]), int(out[2, top, left])]
            assert (out[1, top:bottom + 1, left] == torch.arange(start[0], start[0] + bottom - top + 1)).all()
            writes.append({"window": [top, left, bottom - top + 1, right - left + 1], "from": start})
        cases.append({"size": [h, w], "scale": scale, "reads": tester.net_g.reads, "writes": writes})
    return cases


def official_config(checkout: Path, scale: int) -> dict:
    """The ``network_g`` block of the ×3/×4 training options (×2 has no file: the ×3 one with upscale 2)."""
    options = yaml.safe_load((checkout / OPTIONS.format(scale=min(max(scale, 3), 4))).read_text())["network_g"]
    options.pop("type")
    return {**options, "upscale": scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of ZacharyMeng/PolaFormerPP")
    args = parser.parse_args()
    official, test_model = load_official(args.checkout)

    manifest = {}
    for scale in (2, 3, 4):
        config = official_config(args.checkout, scale)
        model = official(**config)
        manifest[f"x{scale}"] = {
            "config": config,
            "parameters": sum(p.numel() for p in model.parameters()),
            "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        }
        print(f"x{scale}: {manifest[f'x{scale}']['parameters']:,} parameters")
    text = json.dumps(manifest, indent=1)
    # each shape on one line
    text = re.sub(r"\[\s+([^\[\]]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    (DATA / "pola_sr_manifest.json").write_text(text + "\n")

    torch.manual_seed(0)
    model = official(img_size=16, in_chans=3, img_range=1.0, upsampler="pixelshuffledirect",
                     resi_connection="1conv", **TINY).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.rand(TINY_INPUT, dtype=torch.float64)
        y = model(x)
    tensors = {f"state.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors.update(input=x, output=y.contiguous())
    save_file(tensors, DATA / "pola_sr_reference.safetensors", metadata={"config": json.dumps(TINY)})
    print(f"tiny x{TINY['upscale']}: output {tuple(y.shape)}")

    cases = chop_partitions(test_model)
    (DATA / "pola_sr_chop.json").write_text(json.dumps({"source": TEST_MODEL, "cases": cases}, indent=1) + "\n")
    print(f"chop: {', '.join(str(len(c['reads'])) for c in cases)} pieces")


if __name__ == "__main__":
    main()
