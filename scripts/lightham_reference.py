"""Make the LightHamHead reference data in tests/data/ from the official PolaFormer++ head.

Reads ``downstream/segmentation/mmseg/models/decode_heads/ham_head.py`` from a git mirror of
ZacharyMeng/PolaFormerPP (nothing of it is stored in this repository), imports it in a temporary folder
beside small stand-ins for the mmcv/mmseg names it imports (mmcv's ``ConvModule`` layout: ``conv`` then a
norm named by its abbreviation, ``gn``; mmseg's ``BaseDecodeHead``: ``conv_seg`` and ``Dropout2d``), and writes

- ``lightham_manifest.json``: state_dict keys and shapes of the head in the official configs
  ``configs/PolaPP/polapp_b{1,2,3}.py`` (150 classes), and the recipe those configs, their ``_base_`` files and
  the README's / run.sh's launch lines state (images per GPU, GPUs, optimizer, parameter-wise keys, schedule,
  the ADE20K test pipeline's scale and divisor);
- ``lightham_tiny.safetensors``: a float64 head on a tiny config, its weights, inputs, NMF bases and outputs
  (eval mode, and train mode with the dropout removed), the config in the metadata.

    python scripts/lightham_reference.py [--mirror DIR] [--out tests/data]

Last run on ZacharyMeng/PolaFormerPP fd26f5e1c1bcc3210f4d583294ebf9a4d01d62dc (the commit is written into the
manifest).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

HEAD = "downstream/segmentation/mmseg/models/decode_heads/ham_head.py"
SEGMENTATION = "downstream/segmentation"
# in_channels of the decode head in the official configs (stages 2-4 of PolaPP b1/b2/b3)
CONFIGS = {"POLA_b1": [64, 192, 384], "POLA_b2": [128, 256, 512], "POLA_b3": [128, 320, 512]}
TINY = dict(in_channels=[4, 8, 8], channels=32, ham_channels=32, rank=4, num_classes=3, batch=2, size=8)

MMCV_CNN = '''
from torch import nn
NORMS = {"GN": ("gn", lambda c, cfg: nn.GroupNorm(cfg["num_groups"], c)),
         "BN": ("bn", lambda c, cfg: nn.BatchNorm2d(c)), "SyncBN": ("bn", lambda c, cfg: nn.BatchNorm2d(c))}

class ConvModule(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, conv_cfg=None, norm_cfg=None, act_cfg=dict(type="ReLU")):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, bias=norm_cfg is None)
        self.norm_name = None
        if norm_cfg is not None:
            self.norm_name, make = NORMS[norm_cfg["type"]]
            self.add_module(self.norm_name, make(out_channels, norm_cfg))
        self.activate = nn.ReLU() if act_cfg is not None else None

    def forward(self, x):
        x = self.conv(x)
        if self.norm_name:
            x = getattr(self, self.norm_name)(x)
        return self.activate(x) if self.activate is not None else x
'''
MMSEG_OPS = '''
import torch.nn.functional as F
def resize(input, size=None, mode="nearest", align_corners=None):
    return F.interpolate(input, size=size, mode=mode, align_corners=align_corners)
'''
BUILDER = '''
class _Registry:
    def register_module(self):
        return lambda cls: cls
HEADS = _Registry()
'''
DECODE_HEAD = '''
from torch import nn
class BaseDecodeHead(nn.Module):
    def __init__(self, in_channels, channels, *, num_classes, dropout_ratio=0.1, conv_cfg=None, norm_cfg=None,
                 act_cfg=dict(type="ReLU"), in_index=-1, input_transform=None, loss_decode=None, ignore_index=255,
                 align_corners=False):
        super().__init__()
        self.in_channels, self.channels, self.num_classes, self.in_index = in_channels, channels, num_classes, in_index
        self.conv_cfg, self.norm_cfg, self.act_cfg, self.align_corners = conv_cfg, norm_cfg, act_cfg, align_corners
        self.conv_seg = nn.Conv2d(channels, num_classes, kernel_size=1)
        self.dropout = nn.Dropout2d(dropout_ratio) if dropout_ratio > 0 else None

    def _transform_inputs(self, inputs):
        return [inputs[i] for i in self.in_index]

    def cls_seg(self, feat):
        if self.dropout is not None:
            feat = self.dropout(feat)
        return self.conv_seg(feat)
'''


def import_official(mirror: Path, folder: Path):
    source = subprocess.run(["git", "-C", str(mirror), "show", f"HEAD:{HEAD}"], check=True, capture_output=True,
                            text=True).stdout
    files = {"mmcv/__init__.py": "", "mmcv/cnn.py": MMCV_CNN, "mmseg/__init__.py": "", "mmseg/ops.py": MMSEG_OPS,
             "mmseg/models/__init__.py": "", "mmseg/models/builder.py": BUILDER,
             "mmseg/models/decode_heads/__init__.py": "", "mmseg/models/decode_heads/decode_head.py": DECODE_HEAD,
             "mmseg/models/decode_heads/ham_head.py": source}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    sys.path.insert(0, str(folder))
    from mmseg.models.decode_heads import ham_head

    return ham_head


def _show(mirror: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(mirror), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _config(mirror: Path, path: str, folder: Path) -> dict:
    """The variables of an official config file (dict literals; its ``_base_`` files are read apart)."""
    file = folder / Path(path).name
    file.write_text(_show(mirror, path))
    return runpy.run_path(str(file))


def official_recipe(mirror: Path, name: str, folder: Path) -> dict:
    """What ``configs/PolaPP/polapp_bN.py``, its ``_base_`` files and the launch lines of the README and run.sh
    say about training and evaluating the LightHam segmenter."""
    number = name.removeprefix("POLA_b")
    config = _config(mirror, f"{SEGMENTATION}/configs/PolaPP/polapp_b{number}.py", folder)
    schedule = _config(mirror, f"{SEGMENTATION}/configs/_base_/schedules/schedule_160k_adamw.py", folder)
    dataset = _config(mirror, f"{SEGMENTATION}/configs/_base_/datasets/ade20k_repeat.py", folder)
    launches = set()
    for path in (f"{SEGMENTATION}/README.md", f"{SEGMENTATION}/run.sh"):
        launches |= {int(gpus) for gpus in re.findall(rf"dist_train\.sh configs/PolaPP/polapp_b{number}\.py (\d+)",
                                                      _show(mirror, path))}
    (gpus,) = launches  # one GPU count, stated alike everywhere
    keys = config["optimizer"]["paramwise_cfg"]["custom_keys"]
    flip_aug = next(step for step in dataset["test_pipeline"] if step["type"] == "MultiScaleFlipAug")
    multiple = next(step for step in flip_aug["transforms"] if step["type"] == "ResizeToMultiple")
    return {
        "images_per_gpu": config["data"]["samples_per_gpu"], "gpus": gpus,
        "lr": config["optimizer"]["lr"], "weight_decay": config["optimizer"]["weight_decay"],
        "no_decay_keys": sorted(k for k, v in keys.items() if v.get("decay_mult") == 0),
        "head_lr_mult": keys["head"]["lr_mult"], "warmup_iters": config["lr_config"]["warmup_iters"],
        "power": config["lr_config"]["power"], "max_iters": schedule["runner"]["max_iters"],
        "drop_path_rate": config["model"]["backbone"]["drop_path_rate"],
        "test_scale": list(flip_aug["img_scale"]), "test_size_divisor": multiple["size_divisor"],
    }


def build(ham_head, in_channels, channels, ham_channels, rank, num_classes):
    with contextlib.redirect_stdout(io.StringIO()):  # the official NMF2D prints its settings
        return ham_head.LightHamHead(
            in_channels=in_channels, in_index=list(range(1, 1 + len(in_channels))), channels=channels,
            ham_channels=ham_channels, ham_kwargs=dict(MD_R=rank), dropout_ratio=0.1, num_classes=num_classes,
            norm_cfg=dict(type="GN", num_groups=32, requires_grad=True), align_corners=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=Path("/work/.mirror/ZacharyMeng+PolaFormerPP/repo"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ham_head = import_official(args.mirror, Path(tmp))
        commit = subprocess.run(["git", "-C", str(args.mirror), "rev-parse", "HEAD"], check=True, capture_output=True,
                                text=True).stdout.strip()
        manifest = {"source": f"ZacharyMeng/PolaFormerPP@{commit}:{HEAD}", "configs": {}}
        for name, in_channels in CONFIGS.items():
            head = build(ham_head, in_channels, 512, 512, 16, 150)
            manifest["configs"][name] = {
                "in_channels": in_channels, "channels": 512, "ham_channels": 512, "rank": 16, "num_classes": 150,
                "state_dict": {k: list(v.shape) for k, v in head.state_dict().items()},
                "recipe": official_recipe(args.mirror, name, Path(tmp)),
            }
        (args.out / "lightham_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

        torch.manual_seed(0)
        cfg = TINY
        head = build(ham_head, cfg["in_channels"], cfg["channels"], cfg["ham_channels"], cfg["rank"],
                     cfg["num_classes"]).double()
        with torch.no_grad():  # GroupNorm starts at (1, 0): randomise it so the test sees its parameters
            for key, value in head.state_dict().items():
                if ".gn." in key:
                    weight = key.endswith("weight")
                    value.copy_(torch.rand_like(value) + 0.5 if weight else torch.randn_like(value) * 0.1)
        b, s = cfg["batch"], cfg["size"]
        # a stage-1 map the head skips, then strides 8/16/32 as relative sizes
        inputs = [torch.randn(b, 2, 2 * s, 2 * s, dtype=torch.float64)]
        inputs += [torch.randn(b, c, s // 2 ** i, s // 2 ** i, dtype=torch.float64)
                   for i, c in enumerate(cfg["in_channels"])]
        bases = F.normalize(torch.rand(b, cfg["ham_channels"], cfg["rank"], dtype=torch.float64), dim=1)
        ham_head.NMF2D._build_bases = lambda self, B, S, D, R, cuda=False: bases.clone()
        head.eval()
        with torch.no_grad():
            out_eval = head(inputs)
            head.train()
            head.dropout = None
            out_train = head(inputs)
        tensors = {f"weight.{k}": v.contiguous() for k, v in head.state_dict().items()}
        tensors.update({f"input.{i}": x for i, x in enumerate(inputs)})
        tensors.update(bases=bases, output_eval=out_eval, output_train=out_train)
        meta = {k: json.dumps(v) for k, v in cfg.items()}
        save_file(tensors, str(args.out / "lightham_tiny.safetensors"), metadata=meta)
    print(f"wrote {args.out / 'lightham_manifest.json'} and {args.out / 'lightham_tiny.safetensors'}")


if __name__ == "__main__":
    main()
