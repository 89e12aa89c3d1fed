#!/usr/bin/env bash
# Issue 52's speed tables on a lent GPU, in one call (docs/gpu.md, "Measuring issue 52's targets"):
#
#   bash scripts/gpu_speed_tables.sh           # on the card, from the repository root (.official carried if made)
#   bash scripts/gpu_speed_tables.sh --smoke   # here, on the CPU: every command once, the kernels in Triton's
#                                              # interpreter (checks the commands; no timing)
#
# Phases, in the order of their value (GPU_TABLES_PHASES, default all five), each given its share of
# GPU_TABLES_SECONDS (540) as --time-limit (no row starts after it; a started row gets GPU_TABLES_GRACE, 60, more):
#   ops     polaformer bench gpu: the Pola/PaCS kernels against SDPA, eager, compiled and CUDA-graphed, at the model
#           shapes, DiT 4k-32k and causal 4k-32k tokens (the op targets: <= 2x SDPA forward, <= 1.5x forward+backward,
#           >= 10x SDPA at 16k)
#   models  polaformer bench gpu-models at 224²: every family train and infer, eager, compiled, reduce-overhead
#   long    Pola-DeiT-T at 1024² (4,096 tokens), PolaDiT-S/2 on 128² and 256² latents (4k, 16k tokens), the LM at
#           8,192 tokens, against their softmax models, eager and compiled
#   dense   the backbones' features_only forward+backward at 512² and 1024², eager and compiled
#   tests   the compiled families in every inductor mode (tests/backends/triton/test_compile_models.py on CUDA)
# Writes env.txt, <phase>.log and <phase>.csv under $OUT (default /tmp/gpu_speed_tables); PYTHON (python3) runs it.
set -u -o pipefail

smoke=""
[ "${1:-}" = "--smoke" ] && smoke="--smoke"
out=${OUT:-/tmp/gpu_speed_tables}
total=${GPU_TABLES_SECONDS:-540}
grace=${GPU_TABLES_GRACE:-60}
phases=${GPU_TABLES_PHASES:-ops models long dense tests}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$smoke" ]; then
    export TRITON_INTERPRET=1
    phases=${GPU_TABLES_PHASES:-ops models long}
fi
if [ -d .official/PolaFormer ] && [ -d .official/PolaFormerPP ]; then
    export POLAFORMER_OFFICIAL_DIR="$PWD/.official/PolaFormer" POLAFORMERPP_OFFICIAL_DIR="$PWD/.official/PolaFormerPP"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$python" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# seconds of each phase: its weight over the weights of the phases run
declare -A weight=([ops]=3 [models]=4 [long]=3 [dense]=2 [tests]=2)
sum=0
for phase in $phases; do sum=$((sum + ${weight[$phase]:-1})); done

run() {  # run PHASE SECONDS ARGS...: polaformer ARGS, bounded, logged
    local phase=$1 seconds=$2
    shift 2
    echo "== $phase ($seconds s): polaformer $*" | tee "$out/$phase.log"
    timeout -s INT -k 15 $((seconds + grace)) "$python" -m polaformer "$@" 2>&1 | tee -a "$out/$phase.log"
    echo "== $phase exit status ${PIPESTATUS[0]}" | tee -a "$out/$phase.log"
}

status=0
for phase in $phases; do
    seconds=$((total * ${weight[$phase]:-1} / sum))
    limit=(--time-limit "$seconds")
    case $phase in
        ops)
            run ops "$seconds" bench gpu --out "$out/ops.csv" --overwrite --models pola_pvt pola_swin dit causal \
                --dtypes bf16 --variants compiled graph "${limit[@]}" $smoke || status=1 ;;
        models)
            run models "$seconds" bench gpu-models --out "$out/models.csv" --overwrite \
                --variants eager compile reduce-overhead "${limit[@]}" $smoke || status=1 ;;
        long)
            for size in pola_deit_tiny_patch16_224=1024 pola_dit_s_2=128 pola_dit_s_2=256 pola_lm_small=8192; do
                name=${size%=*}
                run "long-${size//=/-}" $((seconds / 4)) bench gpu-models --out "$out/long-${size//=/-}.csv" \
                    --overwrite --models "$name" --impls ours softmax --size "$size" --batch-scale 0.125 \
                    --variants eager compile --time-limit $((seconds / 4)) $smoke || status=1
            done ;;
        dense)
            run dense "$seconds" bench gpu-models --out "$out/dense.csv" --overwrite --dense-only \
                --variants eager compile "${limit[@]}" $smoke || status=1 ;;
        tests)
            echo "== tests: tests/backends/triton/test_compile_models.py" | tee "$out/tests.log"
            timeout -s INT -k 15 $((seconds + grace)) "$python" -m pytest -n 0 -q -p no:cacheprovider \
                tests/backends/triton/test_compile_models.py 2>&1 | tee -a "$out/tests.log" || status=1 ;;
        *) echo "unknown phase $phase (known: ops models long dense tests)"; status=2 ;;
    esac
done
exit "$status"
