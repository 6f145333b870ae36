#!/usr/bin/env bash
# Cross-compile llama-cpp-python (with the patch series, mk/patches/) into an aarch64 wheel on an x86-64 host, once,
# and print the wheel's path.
#
#   mk/llama-arm-wheel.sh [PYTHON]     -> prints .../llama_cpp_python-0.3.36-*-linux_aarch64.whl
#
# Why: on an ARM server mk/llama-wheel.sh compiles llama.cpp for the CPU it runs on (about 5 minutes). Under
# qemu-user on an x86 host (make test-arm) the same compile takes over an hour, so the emulated install is handed
# this wheel instead (SYSHAX_LLAMA_WHEEL=FILE, which mk/llama-wheel.sh honours). llama-cpp-python loads llama.cpp
# through ctypes, so its wheel is Python and shared libraries: nothing in it is built for the host's Python.
#
# The target is ${SYSHAX_ARM_ARCH:-armv8.2-a+dotprod+fp16}: a Kunpeng 920 (NEON, dot product, FP16, no SVE or
# i8mm), which qemu's "max" CPU also runs. OpenMP and llama.cpp's ARM repacking of q4_0 stay on, as in a native
# build. Needs Debian's crossbuild-essential-arm64 and cmake. Cache: ${SYSHAX_ARM_CACHE:-~/.cache/syshax/arm},
# keyed by the target, the cross compiler and the patch series; about 5 minutes on 2 cores the first time. PYTHON
# needs pip and the wheel package (make test-arm's venv has both).
set -euo pipefail
VERSION=0.3.36
PYTHON=${1:-python3}
ARCH_FLAGS=${SYSHAX_ARM_ARCH:-armv8.2-a+dotprod+fp16}
CACHE=${SYSHAX_ARM_CACHE:-$HOME/.cache/syshax/arm}
here=$(cd "$(dirname "$0")" && pwd)
patches=$here/patches

for tool in aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ cmake; do
  command -v "$tool" >/dev/null || {
    echo "mk/llama-arm-wheel.sh: $tool is missing; apt-get install crossbuild-essential-arm64 cmake" >&2; exit 2; }
done
series=$(cd "$patches" && LC_ALL=C ls -1 -- [0-9][0-9][0-9][0-9]-*.patch)
compiler=$(aarch64-linux-gnu-gcc --version | head -1)
key=$(cd "$patches" && { echo "$VERSION $ARCH_FLAGS $compiler"; sha256sum $series; } | sha256sum | cut -c1-16)
dir=$CACHE/wheel-$VERSION-$key

wheel() { ls "$dir"/llama_cpp_python-"$VERSION"-*linux_aarch64.whl 2>/dev/null | head -1; }
if [ -n "$(wheel)" ]; then wheel; exit 0; fi

mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/build.XXXX")
trap 'rm -rf "$work"' EXIT
echo "mk/llama-arm-wheel.sh: cross-compiling llama-cpp-python $VERSION for $ARCH_FLAGS (key $key); about 5 minutes" >&2
sdist=${SYSHAX_LLAMA_SDIST:-}
if [ -z "$sdist" ]; then
  "$PYTHON" -m pip download -q --no-deps --no-cache-dir --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" >&2
  sdist=$work/llama_cpp_python-$VERSION.tar.gz
fi
tar xzf "$sdist" -C "$work"
src=$work/llama_cpp_python-$VERSION
"$here/llama-patches.sh" "$src/vendor/llama.cpp" "$patches" >&2
cmake_args="-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64"
cmake_args="$cmake_args -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++"
cmake_args="$cmake_args -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=$ARCH_FLAGS"
# scikit-build-core names the wheel for the host; the libraries inside are aarch64, so the tag is set to say so
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir -w "$work/out" "$src" >&2
built=$(ls "$work"/out/llama_cpp_python-"$VERSION"-*.whl)
# an ELF's machine field (bytes 18-19) is b7 00 for aarch64
machine=$("$PYTHON" -c 'import sys, zipfile
print(zipfile.ZipFile(sys.argv[1]).read("llama_cpp/lib/libggml-cpu.so")[18:20].hex())' "$built")
if [ "$machine" != b700 ]; then
  echo "mk/llama-arm-wheel.sh: $built holds no aarch64 libggml-cpu.so; see the build above" >&2; exit 1
fi
"$PYTHON" -m wheel tags --remove --platform-tag linux_aarch64 "$built" >&2
mkdir -p "$dir"
mv "$work"/out/llama_cpp_python-"$VERSION"-*linux_aarch64.whl "$dir"/
printf 'llama-cpp-python %s cross-compiled with mk/patches for %s\n  compiler %s\n%s\n' \
  "$VERSION" "$ARCH_FLAGS" "$compiler" "$(sed 's/^/    /' <<<"$series")" > "$dir/BUILD-INFO"
wheel
