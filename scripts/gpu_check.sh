#!/usr/bin/env bash
# The GPU checks, in one call of at most ~9 minutes on a lent CUDA machine (docs/gpu.md, "Benchmark"):
#
#   bash scripts/gpu_check.sh          # from the repository root; carry .whl and .fbi_la when prepared
#
# 1. the Triton kernel tests and tests/gpu (every family's training step, no host sync), on CUDA;
# 2. `polaformer bench gpu`, eager only, every group, until its time limit (the long and causal rows, with the
#    peers, first), then the compiled and CUDA-graph columns for a few groups with the time that is left.
# Installs nothing but the wheels in .whl/ (into /tmp/site); flash-bidirectional-linear-attention's source is
# taken from .fbi_la/ when present. Writes env.txt, pytest.log, bench.log, gpu.csv and gpu_compiled.csv under $OUT
# (default /tmp/gpu_check). GPU_CHECK_SECONDS (540) bounds the whole script, GPU_CHECK_TEST_SECONDS (240) the
# tests, GPU_CHECK_EAGER_SECONDS (150) the eager benchmark; BENCH_ARGS and COMPILED_ARGS replace the two benchmark
# runs' row choices; PYTHON (python3, the card's interpreter with torch) runs it all.
set -u -o pipefail

out=${OUT:-/tmp/gpu_check}
budget=${GPU_CHECK_SECONDS:-540}
test_budget=${GPU_CHECK_TEST_SECONDS:-240}
eager_budget=${GPU_CHECK_EAGER_SECONDS:-150}
bench_args=${BENCH_ARGS:---models dit causal pola_pvt pola_swin}
compiled_args=${COMPILED_ARGS:---models pola_pvt dit --dtypes bf16}
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

# at most 20 failures: the first ones are the ones to read; the benchmark runs either way.
timeout -s INT -k 15 "$test_budget" "$python" -m pytest --maxfail=20 -q -p no:cacheprovider -n 8 \
    tests/backends/triton tests/ops/test_numerics.py tests/gpu 2>&1 | tee "$out/pytest.log"
tests=$?

# bench NAME SECONDS ARGS...: one benchmark run into $out/NAME.csv, stopped (its rows kept) at SECONDS.
# --time-limit stops starting rows; a row already started (a compile, an autotune) gets the last 30 s.
bench() {
    local name=$1 seconds=$2
    shift 2
    if [ "$seconds" -le 45 ]; then
        echo "no time left for $name ($seconds s)" | tee -a "$out/bench.log"
        return
    fi
    timeout -s INT -k 15 "$seconds" "$python" -m polaformer bench gpu --out "$out/$name.csv" \
        --time-limit $((seconds - 30)) "$@" 2>&1 | tee -a "$out/bench.log"
}
left=$((budget - SECONDS))
# shellcheck disable=SC2086  # the argument strings are lists of words
bench gpu $((left < eager_budget ? left : eager_budget)) --variants $bench_args
# shellcheck disable=SC2086
bench gpu_compiled $((budget - SECONDS)) --variants compiled graph $compiled_args
rows=0
for csv in "$out"/gpu*.csv; do
    [ -f "$csv" ] && rows=$((rows + $(wc -l <"$csv") - 1))
done
echo "tests exit status $tests; $rows benchmark rows in $out/gpu*.csv"
exit "$tests"
