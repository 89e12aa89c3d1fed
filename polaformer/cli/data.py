"""``polaformer data shard|index``: an ImageNet-layout folder written as tar shards, or shards written elsewhere
counted into an info file (:mod:`polaformer.data.shards`)."""
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

    index = data.add_parser(
        "index", help="count the samples of shards written without an info file (DIR/train/*.tar, DIR/val/*.tar) "
                      "into DIR/_info.json",
        description="For shards written by webdataset's ShardWriter or other tools: reads every shard once "
                    "(member headers and .cls labels) and writes DIR/_info.json with each split's shards, their "
                    "sample counts and the number of classes (the largest label + 1). `polaformer train --data-path "
                    "DIR` counts the same on its own when the file is missing; with it, later runs skip the pass.",
    )
    index.add_argument("root", metavar="DIR", help="folder with train/*.tar and val/*.tar (or validation/*.tar)")
    add_overwrite(index, "an info file in DIR")
    index.set_defaults(handler=cmd_index)


def cmd_shard(args: argparse.Namespace) -> int:
    from ..data.shards import write_shards

    info = write_shards(args.source, args.out, samples_per_shard=args.samples_per_shard, seed=args.seed,
                        name=args.name, overwrite=args.overwrite)
    parts = [f"{split['num_samples']} {name} samples in {len(split['filenames'])} shards"
             for name, split in info["splits"].items()]
    print(f"wrote {' and '.join(parts)}, {len(info['classes'])} classes -> {args.out}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from ..data.shards import INFO_NAMES, write_index

    info = write_index(args.root, overwrite=args.overwrite)
    parts = [f"{split['num_samples']} {name} samples in {len(split['filenames'])} shards"
             for name, split in info["splits"].items()]
    print(f"counted {' and '.join(parts)}, {info['num_classes']} classes -> {args.root}/{INFO_NAMES[0]}")
    return 0
