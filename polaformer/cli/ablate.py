"""``polaformer ablate``: the component ablations of paper Table 3 (:mod:`polaformer.tasks.classification.ablation`)."""
from __future__ import annotations

import argparse

from .common import positive_int


def add_ablate_parser(commands) -> None:
    ablate = commands.add_parser(
        "ablate",
        help="train each row of an ablation file (paper Table 3) with several seeds; table + chart",
        description="Trains every ABLATION.ROWS entry of FILE (attention switches polarity, polarity_coefficients, "
                    "local) with every seed in ABLATION.SEEDS, each run in OUTPUT/<row>/seed<k> (finished runs are "
                    "read back, not retrained), then writes OUTPUT/ablation.md, ablation.csv and ablation.png: final "
                    "test top-1 as mean ± std beside the paper's numbers. See docs/ablations.md.",
    )
    ablate.add_argument("--config", "--cfg", required=True, metavar="FILE", help="ablation file (configs/ablations/)")
    ablate.add_argument("--data-path", metavar="DIR",
                        help="ImageNet-layout folder for the ImageNet rows (DATA.DATA_PATH)")
    ablate.add_argument("--output", metavar="DIR", help="output folder (default: runs/ablations/<config file name>)")
    ablate.add_argument("--seeds", nargs="+", type=int, metavar="S", help="seeds to train (ABLATION.SEEDS)")
    ablate.add_argument("--rows", nargs="+", metavar="NAME", help="train only these rows (by NAME)")
    ablate.add_argument("--epochs", type=positive_int, metavar="N", help="epochs per run (TRAIN.EPOCHS)")
    ablate.add_argument("--device", help="'cpu', 'cuda', ... (DEVICE)")
    ablate.add_argument("--overwrite", action="store_true", help="retrain runs that already finished in OUTPUT")
    ablate.add_argument(
        "--opts", nargs="+", default=[], metavar="KEY VALUE",
        help="config overrides as KEY VALUE pairs, e.g. --opts TRAIN.EPOCHS 5 ABLATION.SEEDS [0,1]",
    )
    ablate.set_defaults(handler=cmd_ablate)


def cmd_ablate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..engine import ConfigError
    from ..tasks.classification.ablation import load_ablation, run_ablation

    opts = list(args.opts)
    for key, value in (("DATA.DATA_PATH", args.data_path), ("TRAIN.EPOCHS", args.epochs), ("DEVICE", args.device)):
        if value is not None:
            opts += [key, str(value)]
    if args.seeds is not None:
        opts += ["ABLATION.SEEDS", str(list(args.seeds))]
    train_cfg, rows, seeds, reference = load_ablation(args.config, opts)
    if args.rows:
        unknown = sorted(set(args.rows) - {row.name for row in rows})
        if unknown:
            known = ", ".join(r.name for r in rows)
            raise ConfigError(f"unknown rows {', '.join(unknown)} (in {args.config}: {known})")
        rows = [row for row in rows if row.name in args.rows]
    output = args.output or str(Path("runs") / "ablations" / Path(args.config).stem)
    run_ablation(train_cfg, rows, seeds, output, reference=reference, overwrite=args.overwrite)
    return 0
