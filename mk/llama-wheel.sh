#!/usr/bin/env bash
# Build llama-cpp-python for the CPU this runs on, once, and print the wheel's path.
#
#   mk/llama-wheel.sh [PYTHON]     -> prints .../llama_cpp_python-0.3.36-*.whl (builds it first if needed)
#
# Why not a plain `pip install llama-cpp-python`: it compiles llama.cpp with GGML_NATIVE, so the wheel
# holds this CPU's instructions, and pip's cache hands that wheel to any later install whatever CPU it
# runs on (a wheel built on an AVX-512 host dies with SIGILL on an AVX2 one). Here the wheel is kept
# under a key made of the CPU's feature flags, the compiler and the build flags: a host with other
# features builds its own.
#
# On x86-64 the build leaves out llama.cpp's AMX kernels (-mno-amx-*): on AMX Xeons (amx_int8 in
# /proc/cpuinfo) this llama.cpp places q4_0 weights in its AMX buffer and segfaults in the first
# decode (ggml-org/llama.cpp#20824). Weight repacking (AVX2/AVX-512 kernels) stays in; the engine
# chooses it at run time (config key `repack`).
#
# llama.cpp is patched before the build (mk/patches/, a numbered series applied in order by mk/llama-patches.sh;
# each patch says what and why): a lone row's KV is no longer split among the threads, so a request decoded alone
# gets the bits it gets beside others; with SYSHAX_FA_TILED=1 every query row takes the tiled path, a decode step's
# too, so a token's KV has the same bits from a prompt chunk of any size or a decode step, and the prefix cache can
# keep what a request generated; the tiled path's decode is made cheap, and 8 rows share a pass over repacked q4_0
# weights. A patch that does not apply exactly to this llama.cpp stops the build and is named. The engine proves at
# its warm-up which kind of llama.cpp it loaded (plugins/llamacpp/syshax_llamacpp/proofs.py: _proves_lone for the
# first, _proves_decode_kv -- a prefill-only worker's _proves_any_chunking -- for the second) and does without what
# it cannot prove.
#
# Cache: $SYSHAX_WHEEL_CACHE (default ~/.cache/syshax/wheels). About 5 minutes on 2 cores.
#
# SYSHAX_LLAMA_WHEEL=FILE takes a wheel built elsewhere instead of building one: make test-arm hands the emulated
# arm64 install the wheel mk/llama-arm-wheel.sh cross-compiled, since compiling under qemu takes over an hour.
set -euo pipefail
VERSION=0.3.36
PYTHON=${1:-python3}
CACHE=${SYSHAX_WHEEL_CACHE:-$HOME/.cache/syshax/wheels}

if [ -n "${SYSHAX_LLAMA_WHEEL:-}" ]; then
  case "$(basename "$SYSHAX_LLAMA_WHEEL")" in
    llama_cpp_python-"$VERSION"-*.whl) ;;
    *) echo "mk/llama-wheel.sh: SYSHAX_LLAMA_WHEEL=$SYSHAX_LLAMA_WHEEL is not a llama-cpp-python $VERSION wheel" >&2
       exit 2 ;;
  esac
  [ -f "$SYSHAX_LLAMA_WHEEL" ] || { echo "mk/llama-wheel.sh: SYSHAX_LLAMA_WHEEL=$SYSHAX_LLAMA_WHEEL does not exist" >&2
                                    exit 2; }
  echo "mk/llama-wheel.sh: taking $SYSHAX_LLAMA_WHEEL (SYSHAX_LLAMA_WHEEL) instead of building one" >&2
  echo "$SYSHAX_LLAMA_WHEEL"
  exit 0
fi

arch=$(uname -m)
cmake_args="-DGGML_NATIVE=ON"
if [ "$arch" = x86_64 ]; then
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake_args="$cmake_args -DCMAKE_C_FLAGS='$noamx' -DCMAKE_CXX_FLAGS='$noamx'"
fi
# x86 lists its features on "flags", ARM on "Features"; one line is enough (all cores alike)
features=$(grep -m1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ')
compiler=$( (${CC:-cc} --version 2>/dev/null || true) | head -1)
pyver=$("$PYTHON" -c 'import sys; print("%d%d" % sys.version_info[:2])')
# the changes to llama.cpp's source (see above): every patch of the series, its name and its content, in order, is
# part of the key
here=$(dirname "$0")
patches=$here/patches
series=$(cd "$patches" && LC_ALL=C ls -1 -- [0-9][0-9][0-9][0-9]-*.patch)
patch_sum=$(cd "$patches" && sha256sum $series | sha256sum | cut -c1-16)
key=$(printf '%s\n' "$VERSION" "$arch" "$features" "$compiler" "$cmake_args" "$pyver" "$patch_sum" | sha256sum | cut -c1-16)
dir=$CACHE/llama-cpp-python-$VERSION-$arch-$key

wheel() { ls "$dir"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1; }
if [ -n "$(wheel)" ]; then wheel; exit 0; fi

mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/build.XXXX")
trap 'rm -rf "$work"' EXIT
echo "mk/llama-wheel.sh: building llama-cpp-python $VERSION for this CPU ($arch, key $key); about 5 minutes" >&2
# --no-cache-dir: neither take a wheel built for another CPU from pip's cache nor put this one there
"$PYTHON" -m pip download -q --no-deps --no-cache-dir --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" >&2
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src=$work/llama_cpp_python-$VERSION
"$here/llama-patches.sh" "$src/vendor/llama.cpp" "$patches" >&2
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir -w "$work" "$src" >&2
mkdir -p "$dir"
mv "$work"/llama_cpp_python-"$VERSION"-*.whl "$dir"/
printf 'key inputs:\n  arch %s\n  cmake %s\n  compiler %s\n  python %s\n  source changes mk/patches %s, applied in order:\n%s\n'\
'  features %s\n' "$arch" "$cmake_args" "$compiler" "$pyver" "$patch_sum" "$(sed 's/^/    /' <<<"$series")" "$features" \
  > "$dir/BUILD-INFO"
wheel
