"""``polaformer data shard``: an ImageNet-layout folder written as tar shards (:mod:`polaformer.data.shards`)."""
from __future__ import annotations

import argparse

from .common import add_command_group, add_overwrite, positive_int


def add_data_parser(commands) -> None:
    data = add_command_group(commands, "data", help="prepare data sets (tar shards from an image folder)",
                             description="Data preparation; see docs/data.md.", error_command="data")
    shard = data.add_parser(
        "shard", help="write DIR/train and DIR/val as tar shards (WebDataset layout) with an _info.json in OUT",
        description="Shuffles the training images (--seed) and cuts them into shards of --samples-per-shard "
                    "samples, KEY.jpg (the file's bytes) + KEY.cls (the class index); the validation images keep "
                    "the folder's order. OUT/_info.json lists the shards, their sample counts and the class names; "
                    "`polaformer train --data-path OUT` and timm (wds/NAME, --data-dir OUT) read them.",
    )
    shard.add_argument("source", metavar="DIR", help="ImageNet-layout folder: DIR/train/<class>/, DIR/val/<class>/")
    shard.add_argument("out", metavar="OUT", help="folder to write the shards and _info.json into")
    shard.add_argument("--samples-per-shard", type=positive_int, default=1000, metavar="N",
                       help="samples in each shard, the last of a split may hold fewer (default: %(default)s)")
    shard.add_argument("--seed", type=int, default=0, metavar="S", help="shuffle of the training images (default: 0)")
    shard.add_argument("--name", metavar="NAME", help="shard file prefix, NAME-train-000000.tar (default: DIR's name)")
    add_overwrite(shard, "shards and info file in OUT")
    shard.set_defaults(handler=cmd_shard)


def cmd_shard(args: argparse.Namespace) -> int:
    from ..data.shards import write_shards

    info = write_shards(args.source, args.out, samples_per_shard=args.samples_per_shard, seed=args.seed,
                        name=args.name, overwrite=args.overwrite)
    parts = [f"{split['num_samples']} {name} samples in {len(split['filenames'])} shards"
             for name, split in info["splits"].items()]
    print(f"wrote {' and '.join(parts)}, {len(info['classes'])} classes -> {args.out}")
    return 0
