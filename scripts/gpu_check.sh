#!/usr/bin/env bash
# The GPU checks, in one call of at most ~9 minutes on a lent CUDA machine (docs/gpu.md, "Benchmark"):
#
#   bash scripts/gpu_check.sh          # from the repository root; carry .whl and .fbi_la when prepared
#
# 1. the Triton kernel tests and tests/gpu (every family's training step, no host sync), on CUDA;
# 2. `polaformer bench gpu` until its time limit, the long and causal rows (the peers) first.
# Installs nothing but the wheels in .whl/ (into /tmp/site); flash-bidirectional-linear-attention's source is
# taken from .fbi_la/ when present. Writes env.txt, pytest.log, bench.log and gpu.csv under $OUT (default
# /tmp/gpu_check). GPU_CHECK_SECONDS (540) bounds the whole script, GPU_CHECK_TEST_SECONDS (240) the tests;
# BENCH_ARGS replaces the benchmark's row choice; PYTHON (python3, the card's interpreter with torch) runs it all.
set -u -o pipefail

out=${OUT:-/tmp/gpu_check}
budget=${GPU_CHECK_SECONDS:-540}
test_budget=${GPU_CHECK_TEST_SECONDS:-240}
bench_args=${BENCH_ARGS:---models dit causal pola_pvt pola_swin}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -d .fbi_la/flash_bla ]; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.fbi_la"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$python" - <<'EOF'
import importlib
for name in ("torch", "triton", "timm", "fla", "flash_bla"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"), getattr(module, "__file__", None) or list(module.__path__))
    except ImportError as error:
        print(name, "missing:", error)
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# -x: the first failure is the one to read; the benchmark runs either way.
timeout -s INT "$test_budget" "$python" -m pytest -x -q -p no:cacheprovider -n 4 tests/backends/triton tests/gpu \
    2>&1 | tee "$out/pytest.log"
tests=$?

left=$((budget - SECONDS))
if [ "$left" -gt 90 ]; then
    # --time-limit stops starting rows; a row already started (a compile, an autotune) gets the last minute.
    # shellcheck disable=SC2086  # bench_args is a list of words
    timeout -s INT "$left" "$python" -m polaformer bench gpu --out "$out/gpu.csv" --time-limit $((left - 60)) \
        $bench_args 2>&1 | tee "$out/bench.log"
else
    echo "no time left for the benchmark ($left s)" | tee "$out/bench.log"
fi
rows=0
[ -f "$out/gpu.csv" ] && rows=$(($(wc -l <"$out/gpu.csv") - 1))
echo "tests exit status $tests; $rows benchmark rows in $out/gpu.csv"
exit "$tests"
