"""Make the super-resolution test data from the official PolaFormer++ SR class (not run in CI).

    python scripts/make_sr_reference.py /path/to/PolaFormerPP

reads ``downstream/sr/basicsr/archs/mambairv2light_arch.py`` and the lightSR option files of an official
checkout, stubs what that file imports but never uses here (basicsr's registry and helpers, mamba_ssm's
selective scan, einops), and writes

- ``tests/data/pola_sr_manifest.json``: state_dict keys, shapes and parameter counts of the ×2/×3/×4
  lightSR configurations;
- ``tests/data/pola_sr_reference.safetensors``: a tiny float64 model (its state_dict under ``state.``, its
  weights perturbed away from their initial constants), an input whose size is not a multiple of the window
  and the official output for it.
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
OPTIONS = "downstream/sr/options/train/mambairv2/train_MambaIRv2_lightSR_x{scale}.yml"
DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
# the tiny configuration of the float64 comparison (also written into the file's metadata)
TINY = dict(embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=4, mlp_ratio=1.0, upscale=3)
TINY_INPUT = (2, 3, 7, 10)


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def load_official(checkout: Path):
    from timm.layers import to_2tuple

    class Registry:
        def register(self):
            return lambda cls: cls

    for package in ("basicsr", "basicsr.archs", "basicsr.utils", "mamba_ssm", "mamba_ssm.ops"):
        _stub(package)
    _stub("basicsr.archs.arch_util", to_2tuple=to_2tuple, trunc_normal_=torch.nn.init.trunc_normal_)
    _stub("basicsr.utils.registry", ARCH_REGISTRY=Registry())
    _stub("mamba_ssm.ops.selective_scan_interface", selective_scan_fn=None, selective_scan_ref=None)
    if importlib.util.find_spec("einops") is None:
        _stub("einops", rearrange=None, repeat=None)  # used by the selective scan only
    spec = importlib.util.spec_from_file_location("official_sr_arch", checkout / ARCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MambaIRv2Light


def official_config(checkout: Path, scale: int) -> dict:
    """The ``network_g`` block of the ×3/×4 training options (×2 has no file: the ×3 one with upscale 2)."""
    options = yaml.safe_load((checkout / OPTIONS.format(scale=min(max(scale, 3), 4))).read_text())["network_g"]
    options.pop("type")
    return {**options, "upscale": scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of ZacharyMeng/PolaFormerPP")
    args = parser.parse_args()
    official = load_official(args.checkout)

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


if __name__ == "__main__":
    main()
