#!/usr/bin/env bash
# Run timm's own tests/test_models.py, of the installed timm version, against the PolaFormer models.
#
#   scripts/timm_conformance/run.sh [pytest arguments...]
#
# TIMM_TESTS_DIR (default /tmp/timm_conformance) is the scratch folder; timm's test file is taken
# from the timm sdist on PyPI (the same file as tests/test_models.py at the release tag of
# huggingface/pytorch-image-models), unless TIMM_TEST_MODELS points at a copy already on disk.
# POLA_TIMM_MODELS narrows the models (comma-separated patterns, default 'pola_*,POLA_*').
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
work=${TIMM_TESTS_DIR:-/tmp/timm_conformance}
version=$(python -c 'import timm; print(timm.__version__)')
mkdir -p "$work"
if [ -n "${TIMM_TEST_MODELS:-}" ]; then
    cp "$TIMM_TEST_MODELS" "$work/test_models.py"
elif [ ! -f "$work/test_models.py" ] || [ "$(cat "$work/.timm_version" 2>/dev/null)" != "$version" ]; then
    python -m pip download "timm==$version" --no-binary :all: --no-deps --quiet -d "$work/sdist"
    tar -xzf "$work/sdist/timm-$version.tar.gz" -C "$work/sdist" "timm-$version/tests/test_models.py"
    cp "$work/sdist/timm-$version/tests/test_models.py" "$work/test_models.py"
    echo "$version" > "$work/.timm_version"
fi
cp "$here/conftest.py" "$work/conftest.py"
cd "$work"
exec python -m pytest test_models.py -p no:cacheprovider -rs "$@"
