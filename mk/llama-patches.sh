#!/usr/bin/env bash
# Apply syshax's llama.cpp patch series (mk/patches/NNNN-*.patch, in order) to a llama.cpp source tree.
#
#   mk/llama-patches.sh LLAMA_CPP_DIR [PATCH_DIR]     (the sdist's vendor/llama.cpp; PATCH_DIR defaults to the
#                                                      patches/ beside this script)
#
# mk/llama-wheel.sh runs it before it builds; tests/plugins/test_llama_patch.py runs it on a pristine copy. Each patch must
# apply exactly where it was written: a hunk whose context is not found, or is found only some lines away (an
# offset, which `git apply` accepts and says so with -v), is refused, and the patch is named. A new llama.cpp is
# never patched blindly: mk/patches/README.md says how to move the series to it.
set -euo pipefail
tree=$1
patches=$(cd "${2:-$(dirname "$0")/patches}" && pwd)
cd "$tree"
# the sdist's vendor/llama.cpp holds a .git file (its submodule's git dir is shipped too): `git apply` then runs in
# that repository, whose top is this folder, so the paths of the patches land here either way
shopt -s nullglob
series=("$patches"/[0-9][0-9][0-9][0-9]-*.patch)
[ ${#series[@]} -gt 0 ] || { echo "mk/llama-patches.sh: no NNNN-*.patch in $patches" >&2; exit 1; }
for p in "${series[@]}"; do
  name=$(basename "$p")
  # no --3way and no fuzz: git apply wants every context line as it is; -v says where a hunk moved
  if ! check=$(git apply --check -v "$p" 2>&1) || grep -q '(offset ' <<<"$check"; then
    printf '%s\n' "$check" >&2
    echo "mk/llama-patches.sh: $name does not apply cleanly to $tree; this llama.cpp needs the series moved to it" \
         "(mk/patches/README.md)" >&2
    exit 1
  fi
  git apply "$p"
done
