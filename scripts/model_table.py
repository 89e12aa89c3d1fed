"""Generate the README's model table: every registered polaformer model, its parameters and GMACs.

GMACs are counted with torch.utils.flop_counter on a meta-device model (no weights are
allocated), one image at the model's default input size, MACs = FLOPs / 2 (the convention of
the papers and of the reference manifests). The paper's figures sit beside ours.

    python scripts/model_table.py            # print the table
    python scripts/model_table.py --write    # replace the table in README.md
    python scripts/model_table.py --check    # exit 1 if README.md's table is stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import polaformer.models  # noqa: F401  (registers the models)

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- model-table:start -->", "<!-- model-table:end -->"

# (params M, GFLOPs) as printed by the papers: PolaFormer Tables 1 and 5, the PolaFormer++ README.
PAPER = {
    "pola_deit_tiny_patch16_224": (6.1, 1.2),
    "pola_pvt_tiny": (12, 2.0),
    "pola_pvt_small": (21, 4.1),
    "pola_pvt_v2_b0": (3.4, 0.6),
    "pola_pvt_v2_b1": (13, 2.2),
    "pola_swin_t": (29, 4.5),
    "pola_swin_s": (50, 8.7),
    "pola_swin_b": (88, 15.4),
    "POLA_b0": (7, 0.7),
    "POLA_b1": (9, 1.0),
    "POLA_b2": (16, 2.7),
    "POLA_b3": (27, 5.1),
    "POLA_b4": (50, 11),
    "POLA_b5": (97, 18),
}

# Where the counts differ from the paper for a reason we know.
NOTES = {
    "pola_pvt": "official code (as `build.py` builds it); 8-10% above the paper's Table 5 figures",
    "pola_pvt_v2": "no official code: FLatten's PVTv2 layout with Pola attention",
    "pola_deit": "no official code: see `polaformer/models/deit.py` for the layout choices",
    "pola_swin": "official code",
    "POLA": "official code (PolaFormer++)",
}


def model_names() -> list[str]:
    """Registered polaformer models, skipping lower-case aliases of official upper-case names."""
    names = timm.list_models(["pola_*", "POLA_*"])
    upper = {n.lower() for n in names if n != n.lower()}
    # the table is of image classifiers
    non_classifiers = set(timm.list_models(["pola_lm_*", "pola_sr_*", "pola_dit_*"]))
    return [n for n in names if n not in upper and n != "pola_deit_digits" and n not in non_classifiers]


def measure(name: str) -> tuple[int, float, tuple[int, ...]]:
    with torch.device("meta"):
        model = timm.create_model(name)
        size = model.pretrained_cfg["input_size"]
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, *size))
    params = sum(p.numel() for p in model.parameters())
    return params, counter.get_total_flops() / 2e9, size


def note_for(name: str) -> str:
    for prefix in sorted(NOTES, key=len, reverse=True):
        if name.startswith(prefix):
            return NOTES[prefix]
    return ""


def table() -> str:
    rows = [
        "| model | input | params (M) | paper params (M) | GMACs | paper GFLOPs | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in model_names():
        params, gmacs, size = measure(name)
        paper_params, paper_flops = PAPER.get(name, (None, None))
        fmt = lambda v: "—" if v is None else f"{v:g}"  # noqa: E731
        rows.append(
            f"| `{name}` | {size[1]}×{size[2]} | {params / 1e6:.2f} | {fmt(paper_params)} | {gmacs:.2f} | "
            f"{fmt(paper_flops)} | {note_for(name)} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in README.md")
    mode.add_argument("--check", action="store_true", help="fail if README.md's table is not current")
    args = parser.parse_args(argv)
    text = table()
    if not (args.write or args.check):
        print(text)
        return 0
    readme = README.read_text()
    if START not in readme or END not in readme:
        sys.exit(f"README.md lacks the {START} / {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{START}\n{text}\n{END}{tail}"
    if args.check:
        if updated != readme:
            print("README.md's model table is stale: run python scripts/model_table.py --write", file=sys.stderr)
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
