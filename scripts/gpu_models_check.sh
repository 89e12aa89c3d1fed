#!/usr/bin/env bash
# `polaformer bench gpu-models` on a lent CUDA machine, in one call (docs/gpu_models.md):
#
#   bash scripts/prepare_official.sh     # here, once: the official model files into .official/
#   bash scripts/gpu_models_check.sh     # there, from the repository root, with .official carried
#
# Every family eager (ours, official, softmax), then compiled, then PolaDiT and the LM, then the dense backbones,
# until GPU_MODELS_SECONDS (200) have passed: no row starts after that, and a row already started gets
# GPU_MODELS_GRACE (90) more seconds before SIGINT (the CSV holds every finished row either way). Writes env.txt,
# gpu_models.log and gpu_models.csv under $OUT (default /tmp/gpu_models_check). GPU_MODELS_ARGS replaces the row
# choices (default: --dense); PYTHON (python3, the card's interpreter with torch) runs it.
set -u -o pipefail

out=${OUT:-/tmp/gpu_models_check}
seconds=${GPU_MODELS_SECONDS:-200}
grace=${GPU_MODELS_GRACE:-90}
args=${GPU_MODELS_ARGS:---dense}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .official/PolaFormer ] && [ -d .official/PolaFormerPP ]; then
    export POLAFORMER_OFFICIAL_DIR="$PWD/.official/PolaFormer" POLAFORMERPP_OFFICIAL_DIR="$PWD/.official/PolaFormerPP"
else
    echo "no .official/ (run scripts/prepare_official.sh and carry .official): no official rows" | tee "$out/gpu_models.log"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$python" -c 'import torch, timm; print("torch", torch.__version__, "cuda", torch.version.cuda, "timm", timm.__version__)'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

# shellcheck disable=SC2086  # the argument string is a list of words
timeout -s INT -k 15 $((seconds + grace)) "$python" -m polaformer bench gpu-models --out "$out/gpu_models.csv" \
    --time-limit "$seconds" $args 2>&1 | tee -a "$out/gpu_models.log"
status=${PIPESTATUS[0]}
rows=0
[ -f "$out/gpu_models.csv" ] && rows=$(($(wc -l <"$out/gpu_models.csv") - 1))
echo "bench gpu-models exit status $status; $rows rows in $out/gpu_models.csv"
exit "$status"
