"""Entry point for ``python -m polaformer`` and the ``polaformer`` console script."""
import sys

from polaformer._startup import interrupt_exits


def run() -> int:
    with interrupt_exits(True):  # the command's imports and argument parsing, before main() reports interrupts
        from polaformer.cli import main

        return main()


if __name__ == "__main__":
    sys.exit(run())
