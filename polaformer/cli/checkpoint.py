"""``polaformer checkpoint``: work on checkpoint files themselves (docs/training.md)."""
from __future__ import annotations

from .common import add_command_group, add_overwrite

__all__ = ["add_checkpoint_parser"]


def add_checkpoint_parser(commands) -> None:
    sub = add_command_group(commands, "checkpoint", "work on checkpoint files",
                            "Work on checkpoint files: make a sharded checkpoint of a 'train.parallel: fsdp' run "
                            "one ordinary file. See docs/training.md.", error_command="checkpoint")
    merge = sub.add_parser("consolidate", help="one checkpoint file from a sharded one (fsdp runs)")
    merge.add_argument("source", metavar="CHECKPOINT", help="last.pth or best.pth of a 'parallel: fsdp' run")
    merge.add_argument("output", metavar="OUT", help="the single-file checkpoint to write")
    add_overwrite(merge, "an OUT file")
    merge.set_defaults(handler=cmd_consolidate)


def cmd_consolidate(args) -> int:
    from ..engine.output import claim_outputs
    from ..engine.parallel import consolidate

    target, = claim_outputs([args.output], args.overwrite, option="OUT")
    print(consolidate(args.source, target))
    return 0
