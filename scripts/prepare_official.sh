#!/usr/bin/env bash
# The authors' model files for `polaformer bench gpu-models` (and `bench official`), extracted from local git
# mirrors into the ignored folder .official/ so that a GPU run can carry them (docs/benchmarks.md):
#
#   bash scripts/prepare_official.sh     # from the repository root
#
# .official/PolaFormer    models/ (pola_pvt.py, pola_swin.py) of ZacharyMeng/PolaFormer
# .official/PolaFormerPP  polaformer++/models/ (pola.py) and downstream/dit/ (DiT models.py) of ZacharyMeng/PolaFormerPP
#
# POLAFORMER_MIRROR and POLAFORMERPP_MIRROR name the git directories (default: /work/.mirror/ZacharyMeng+*/repo).
# Nothing is fetched and nothing in .official/ is ever committed.
set -euo pipefail

pola=${POLAFORMER_MIRROR:-/work/.mirror/ZacharyMeng+PolaFormer/repo}
polapp=${POLAFORMERPP_MIRROR:-/work/.mirror/ZacharyMeng+PolaFormerPP/repo}
dest=.official

extract() {  # git dir, target folder, paths
    local git_dir=$1 target=$2
    shift 2
    git --git-dir="$git_dir" rev-parse --verify -q HEAD >/dev/null || { echo "no git repository at $git_dir" >&2; exit 1; }
    rm -rf "$target"
    mkdir -p "$target"
    git --git-dir="$git_dir" archive HEAD -- "$@" | tar -x -C "$target"
    git --git-dir="$git_dir" rev-parse HEAD >"$target/COMMIT"
}

extract "$pola" "$dest/PolaFormer" LICENSE models
extract "$polapp" "$dest/PolaFormerPP" polaformer++/models downstream/dit/models.py downstream/dit/LICENSE.txt
echo "POLAFORMER_OFFICIAL_DIR=$PWD/$dest/PolaFormer POLAFORMERPP_OFFICIAL_DIR=$PWD/$dest/PolaFormerPP ($(du -sh "$dest" | cut -f1))"
