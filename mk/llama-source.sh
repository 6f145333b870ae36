#!/usr/bin/env bash
# Unpack llama.cpp's HF -> GGUF converter from the llama-cpp-python sdist, once, and print its folder.
#
#   mk/llama-source.sh [PYTHON]     -> prints .../llama-src-0.3.36 (unpacks it first if needed)
#
# Why the sdist's converter and not the gguf package from the index: a GGUF is only what llama.cpp
# expects when it was written by the converter of the very llama.cpp that loads it. The gguf package on
# the index (0.19 in the venv) trails llama.cpp's tree (new keys, tensor names, vocab fixes), and
# convert_hf_to_gguf.py is not on the index at all. llama-cpp-python 0.3.36 vendors the llama.cpp we
# build (mk/llama-wheel.sh), so its sdist holds the matching converter and gguf-py.
#
# Only what the converter needs is kept (a few MB of a 75 MB sdist):
#   convert_hf_to_gguf.py        the entry point; it puts gguf-py/ first on sys.path itself
#   conversion/                  the model classes convert_hf_to_gguf.py imports (one module per family)
#   gguf-py/                     the gguf package of this llama.cpp (run the converter with PYTHONPATH=<dir>/gguf-py
#                                too, so a subprocess never picks the venv's gguf)
#   models/templates/            chat templates some converter classes read, and the tests give their models
#   models/ggml-vocab-{gpt-neox,llama-spm}.gguf   built-in vocabs conversion/base.py reads (_set_vocab_builtin)
#   LICENSE
#
# pip download keeps pip's own cache (no --no-cache-dir, unlike mk/llama-wheel.sh: an sdist is the same on
# every CPU), so unpacking again after the cache folder was wiped costs no download.
# SYSHAX_LLAMA_SDIST=path/to/llama_cpp_python-0.3.36.tar.gz uses that file instead of pip download (offline).
#
# Cache: ${SYSHAX_LLAMA_SRC_CACHE:-~/.cache/syshax}/llama-src-0.3.36. The folder appears whole or not at all
# (unpacked beside it, then renamed), so a folder that exists is complete and two runs at once are harmless.
set -euo pipefail
VERSION=0.3.36
PYTHON=${1:-python3}
CACHE=${SYSHAX_LLAMA_SRC_CACHE:-$HOME/.cache/syshax}
dir=$CACHE/llama-src-$VERSION

if [ -f "$dir/convert_hf_to_gguf.py" ]; then echo "$dir"; exit 0; fi

mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/.llama-src.XXXX")
trap 'rm -rf "$work"' EXIT
if [ -n "${SYSHAX_LLAMA_SDIST:-}" ]; then
  sdist=$SYSHAX_LLAMA_SDIST
else
  # --no-deps: the sdist only, not its build requirements (nothing is built here)
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" >&2
  sdist=$work/llama_cpp_python-$VERSION.tar.gz
fi
top=llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir "$work/src"
# --strip-components=3 drops llama_cpp_python-X/vendor/llama.cpp/
tar xzf "$sdist" -C "$work/src" --strip-components=3 --wildcards \
  "$top/LICENSE" "$top/convert_hf_to_gguf.py" "$top/conversion/*" "$top/gguf-py/*" "$top/models/templates/*" \
  "$top/models/ggml-vocab-gpt-neox.gguf" "$top/models/ggml-vocab-llama-spm.gguf"
# every module convert_hf_to_gguf.py imports from its own tree must be here, or the first conversion fails late
for need in convert_hf_to_gguf.py conversion/__init__.py conversion/base.py gguf-py/gguf/__init__.py; do
  [ -f "$work/src/$need" ] || { echo "mk/llama-source.sh: $need missing from $sdist" >&2; exit 1; }
done
# mv -T fails if another run got there first (its folder is whole too): then keep that one
mv -T "$work/src" "$dir" 2>/dev/null || [ -f "$dir/convert_hf_to_gguf.py" ]
echo "$dir"
