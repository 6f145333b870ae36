#!/usr/bin/env bash
# Cross-compile the patched llama.cpp (mk/patches/, as mk/llama-wheel.sh builds it) for a Kunpeng 920 (ARMv8.2-A with
# dot product and FP16, no SVE), then run it under qemu-user on a GGUF: the patch series compiles and serves on ARM.
#
#   mk/llama-arm-cross.sh MODEL.gguf [PROMPT]     -> prints the greedy text of 24 tokens, the first token's 5 likeliest
#                                                    with their logprobs (llama-server under qemu, and this host's
#                                                    own with SYSHAX_X86_LLAMA_SERVER=PATH), the build's folder
#
# Needs Debian's crossbuild-essential-arm64 and qemu-user (apt-get install crossbuild-essential-arm64 qemu-user).
# The build (llama.cpp's own `llama-simple` and `llama-server`, statically linked) is cached under
# ${SYSHAX_ARM_CACHE:-~/.cache/syshax/arm}, keyed by the patch series; about 8 minutes on 2 cores the first time.
# qemu runs it about 20 times slower than the hardware would: the default model's 24 tokens take a minute.
# issue 53: this is the compile-and-run check; `make test-arm` (a Debian arm64 root, syshax installed in it)
# builds on it.
set -euo pipefail
VERSION=0.3.36
MODEL=${1:?usage: mk/llama-arm-cross.sh MODEL.gguf [PROMPT]}
PROMPT=${2:-The capital of France is}
ARCH_FLAGS=${SYSHAX_ARM_ARCH:-armv8.2-a+dotprod+fp16}  # Kunpeng 920 (TaiShan v110)
CACHE=${SYSHAX_ARM_CACHE:-$HOME/.cache/syshax/arm}
here=$(cd "$(dirname "$0")" && pwd)
patches=$here/patches

for tool in aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ qemu-aarch64 cmake; do
  command -v "$tool" >/dev/null || { echo "mk/llama-arm-cross.sh: $tool is missing; apt-get install crossbuild-essential-arm64 qemu-user cmake" >&2; exit 2; }
done
series=$(cd "$patches" && LC_ALL=C ls -1 -- [0-9][0-9][0-9][0-9]-*.patch)
key=$(cd "$patches" && { echo "$VERSION $ARCH_FLAGS"; sha256sum $series; } | sha256sum | cut -c1-16)
dir=$CACHE/llama-$VERSION-$key
binary=$dir/llama-simple
server=$dir/llama-server

if [ ! -x "$binary" ] || [ ! -x "$server" ]; then
  mkdir -p "$CACHE"
  work=$(mktemp -d "$CACHE/build.XXXX")
  trap 'rm -rf "$work"' EXIT
  echo "mk/llama-arm-cross.sh: cross-compiling llama.cpp $VERSION with mk/patches for $ARCH_FLAGS (key $key)" >&2
  sdist=${SYSHAX_LLAMA_SDIST:-}
  if [ -z "$sdist" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" >&2
    sdist=$work/llama_cpp_python-$VERSION.tar.gz
  fi
  tar xzf "$sdist" -C "$work"
  src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
  "$here/llama-patches.sh" "$src" "$patches" >&2
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$ARCH_FLAGS" -DGGML_OPENMP=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_EXE_LINKER_FLAGS=-static >&2
  cmake --build "$work/build" --target llama-simple llama-server -j "$(nproc)" >&2
  mkdir -p "$dir"
  cp "$work/build/bin/llama-server" "$server.tmp" && mv "$server.tmp" "$server"
  cp "$work/build/bin/llama-simple" "$binary.tmp" && mv "$binary.tmp" "$binary"
  printf 'llama.cpp %s with mk/patches (%s) for %s\n%s\n' "$VERSION" "$key" "$ARCH_FLAGS" "$series" > "$dir/BUILD-INFO"
  rm -rf "$work"
  trap - EXIT
fi
file "$binary" >&2 || true
# -cpu max: qemu's ARM CPU with every feature it emulates (dot product and FP16 among them)
qemu-aarch64 -cpu max "$binary" -m "$MODEL" -n 24 "$PROMPT" 2>"$dir/last-run.log"
echo
# the first token's likeliest, to hold against the same model's on x86 (llama-server's /completion, n_probs)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
qemu-aarch64 -cpu max "$server" -m "$MODEL" --host 127.0.0.1 --port "$port" -c 512 -np 1 >"$dir/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "mk/llama-arm-cross.sh: llama-server died; see $dir/server.log" >&2; exit 1; }
  sleep 1
done
first_tokens() {  # LABEL PORT: the server's five likeliest first tokens after PROMPT
  python3 - "$2" "$PROMPT" "$1" <<'PY'
import json, sys, urllib.request
body = json.dumps({"prompt": sys.argv[2], "n_predict": 1, "temperature": 0, "n_probs": 5}).encode()
answer = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/completion", body, timeout=600))
print(f"{sys.argv[3]} first token:", ", ".join(f"{p['token']!r} {p['logprob']:.3f}"
                                               for p in answer["completion_probabilities"][0]["top_logprobs"]))
PY
}
first_tokens ARM "$port"
kill $pid 2>/dev/null || true
# SYSHAX_X86_LLAMA_SERVER: the same on this host's own llama-server (../shared/tools/llama-server.sh prints it)
if [ -n "${SYSHAX_X86_LLAMA_SERVER:-}" ]; then
  "$SYSHAX_X86_LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" -c 512 -np 1 >"$dir/x86-server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.5; done
  first_tokens x86 "$port"
  kill $pid 2>/dev/null || true
fi
echo "$dir"
