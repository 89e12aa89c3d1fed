"""Whole-model speed against the official code: ``polaformer bench official`` under its historical path.

Same options (``--rounds N --floor --matmul-floor --compile --json FILE --markdown FILE`` ...); see
:mod:`polaformer.bench.official`.

    python benchmarks/bench_models_vs_official.py --rounds 5 --floor --matmul-floor
"""
import sys

from polaformer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "official", *sys.argv[1:]]))
