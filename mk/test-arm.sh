#!/usr/bin/env bash
# make test-arm: syshax on aarch64, under emulation. A Debian arm64 root (debootstrap, cached) runs under qemu-user;
# syshax is copied into it as a user's clone and installed with the Makefile (`make install`, `make model`); then
#
#   1. `make run`'s daemon starts and answers the README's first curl;
#   2. `syshax status` says which exact promises its warm-up proved on this CPU;
#   3. tests of the suite run in the root: the warm-up proofs and the status, a hetero request through the ring and
#      hetero against cpu mode, a prefix-cache hit against a miss, speculation's texts (ARM_TESTS overrides the
#      list). Where the status does not make a promise on ARM, its test says so (xfail or skip, with the status's
#      reason) instead of failing.
#
#   mk/test-arm.sh [HOST_PYTHON]        (root only: debootstrap, chroot and mounts need it)
#
# llama-cpp-python is cross-compiled on this host (mk/llama-arm-wheel.sh, for a Kunpeng 920) and handed to the
# install through SYSHAX_LLAMA_WHEEL: compiled under qemu it takes over an hour. Everything else the install does
# runs in the root as on an ARM server, from the package index. qemu runs the root's programs about 20 times
# slower than the hardware would, so the tests get SYSHAX_TEST_SLOWDOWN (default 20) times their waits.
#
# Needs Debian's debootstrap, qemu-user-static and binfmt-support (qemu-aarch64 registered in binfmt_misc) and
# what mk/llama-arm-wheel.sh needs (crossbuild-essential-arm64, cmake). Cache: ${SYSHAX_ARM_CACHE:-~/.cache/syshax/arm}
# (the root, about 900 MB, and the wheel); the root keeps pip's cache and the prepared model between runs, and gets a
# fresh copy of the repository and a fresh .venv each run. Prints each step's time; the log of a step that fails is
# printed.
set -euo pipefail
HOST_PYTHON=${1:-python3}
CACHE=${SYSHAX_ARM_CACHE:-$HOME/.cache/syshax/arm}
SUITE=${DEBIAN_SUITE:-bookworm}  # Python 3.11, as openEuler 24.03's python3.11
SLOWDOWN=${SYSHAX_TEST_SLOWDOWN:-20}  # a whole number: it multiplies this script's waits too
TESTS=${ARM_TESTS:-"tests/plugins/test_kernels.py::test_a_worker_proves_its_kernels_and_the_status_says_which
tests/engine/test_hetero.py::test_a_hetero_request_goes_through_the_ring_and_the_status_says_if_it_is_exact
tests/engine/test_hetero.py::test_hetero_returns_exactly_the_tokens_cpu_mode_returns
tests/engine/test_prefix_cache.py::test_a_hit_returns_the_tokens_a_miss_returns
tests/plugins/test_speculation.py::test_the_warm_up_proves_the_guessed_rows
tests/plugins/test_speculation.py::test_greedy_chats_keep_their_text"}
repo=$(cd "$(dirname "$0")/.." && pwd)
root=$CACHE/debian-$SUITE-arm64
packages=python3,python3-venv,python3-dev,python3-pip,build-essential,make,cmake,git,curl,ca-certificates,procps

fail() { echo "make test-arm: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (debootstrap, chroot and its mounts); run it as root or in a container"
command -v debootstrap >/dev/null || fail "debootstrap is missing; apt-get install debootstrap"
[ -x /usr/bin/qemu-aarch64-static ] \
  || fail "qemu-aarch64-static is missing; apt-get install qemu-user-static binfmt-support"
grep -qs enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || fail "qemu-aarch64 is not registered in binfmt_misc;" \
  "apt-get install binfmt-support, then update-binfmts --enable qemu-aarch64"

[[ "$SLOWDOWN" =~ ^[1-9][0-9]*$ ]] || fail "SYSHAX_TEST_SLOWDOWN=$SLOWDOWN: give a whole number of times (20 by default)"

started=$(date +%s)
step() {  # NAME: print the time since the last step
  local now; now=$(date +%s)
  printf 'make test-arm: %-58s %5ss\n' "$1" "$((now - ${last:-$started}))"
  last=$now
}

# --- the root (cached) --------------------------------------------------------------------------------------------
# the processes running in the root: the root shares this host's process table, so a pattern alone would match the
# host's own syshaxd and tests too
root_pids() {  # [PATTERN]: the pids of processes whose root is the root (and whose command line matches PATTERN)
  local real p; real=$(realpath "$root")
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$real" ] || continue
    if [ -z "${1:-}" ] || tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qE -- "$1"; then echo "${p#/proc/}"; fi
  done
}
stop_in_root() {  # PATTERN SECONDS: SIGTERM to the root's processes that match, SIGKILL to those left after SECONDS
  local pids left i p
  pids=$(root_pids "$1")
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null || true
  for ((i = 0; i < $2; i++)); do
    left=""
    for p in $pids; do if [ -d "/proc/$p" ]; then left="$left $p"; fi; done
    [ -n "$left" ] || return 0
    sleep 1
  done
  kill -KILL $left 2>/dev/null || true
}
# mounts an earlier run left (killed before its cleanup): never remove or rebuild a root with the host's /dev in it
for leftover in /dev/shm /dev /sys /proc; do
  if mountpoint -q "$root$leftover" 2>/dev/null; then umount -l "$root$leftover"; fi
done
if [ "$(cat "$root/.syshax-root" 2>/dev/null)" != "$SUITE $packages" ]; then
  rm -rf "$root" "$root.part"
  mkdir -p "$CACHE"
  echo "make test-arm: making a Debian $SUITE arm64 root in $root (debootstrap, about 5 minutes)" >&2
  debootstrap --arch=arm64 --variant=minbase --include="$packages" "$SUITE" "$root.part" \
    >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; fail "debootstrap failed; its log: $CACHE/debootstrap.log"; }
  echo "$SUITE $packages" > "$root.part/.syshax-root"
  mv "$root.part" "$root"
fi
step "the arm64 root ($(chroot "$root" uname -m), $(chroot "$root" python3 --version))"

wheel=$("$repo/mk/llama-arm-wheel.sh" "$HOST_PYTHON")
step "llama-cpp-python cross-compiled ($(basename "$wheel"))"

# --- mounts, undone on exit ---------------------------------------------------------------------------------------
mounted=()
cleanup() {
  stop_in_root "" 30  # whatever still runs in the root, ours alone
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
mount_in() {  # TYPE SOURCE TARGET
  mkdir -p "$root$3"
  if [ "$1" = bind ]; then mount --bind "$2" "$root$3"; else mount -t "$1" "$2" "$root$3"; fi
  mounted+=("$root$3")
  mount --make-private "$root$3"  # nothing mounted under it reaches the host's own tree
}
mount_in proc proc /proc
mount_in bind /sys /sys
mount_in bind /dev /dev
mount_in tmpfs tmpfs /dev/shm  # the KV ring and the prefix cache: the root's own, not the host's
cp /etc/resolv.conf "$root/etc/resolv.conf"
# this host's trust and index settings, so that the root reaches the package index as the host does (a proxy's own
# CA, a mirror): its CA bundle and pip.conf, and the variables that point pip at them
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
carried=()
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CERT PIP_DEFAULT_TIMEOUT SSL_CERT_FILE REQUESTS_CA_BUNDLE \
            HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
  if [ -n "${!name:-}" ]; then carried+=("$name=${!name}"); fi
done

# --- syshax, as a user's clone --------------------------------------------------------------------------------------
home=/root/syshax
rm -rf "$root$home"
mkdir -p "$root$home" "$root/root/wheels" "$root/root/models"
# what a clone holds (tracked files, and new ones not yet committed), not this checkout's builds
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
  | tar --null --no-recursion -T - -cf -) | tar -xf - -C "$root$home"
cp "$wheel" "$root/root/wheels/"
in_root() {  # COMMAND...: run in the copy, in the root, as root (the root's own PATH and HOME)
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 "${carried[@]}" SYSHAX_LLAMA_WHEEL="/root/wheels/$(basename "$wheel")" \
    SYSHAX_TEST_SLOWDOWN="$SLOWDOWN" \
    /bin/bash -c "cd $home && $*"
}
logs=$CACHE/test-arm-logs
rm -rf "$logs"; mkdir -p "$logs"
run_logged() {  # NAME COMMAND: run in the root, its output in $logs/NAME.log, printed if it fails
  if ! in_root "$2" >"$logs/$1.log" 2>&1; then
    tail -60 "$logs/$1.log" >&2
    fail "$1 failed (the log: $logs/$1.log)"
  fi
}

run_logged install "make install"
step "make install (the core, the llama.cpp backend)"
# the prepared model is kept in the root between runs (MODEL_DIR), as a user's models/ would be
run_logged model "make model MODEL_DIR=/root/models && ln -s /root/models models"
step "make model (the default model, fetched and quantized)"

# --- make run's daemon, the first curl, the status -----------------------------------------------------------------
port=18080
in_root "make run MODEL_DIR=/root/models PORT=$port" >"$logs/run.log" 2>&1 &
run_pid=$!
deadline=$(( $(date +%s) + 60 * SLOWDOWN ))
until grep -q "syshaxd ready" "$logs/run.log"; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    tail -40 "$logs/run.log" >&2; fail "make run: no 'syshaxd ready' in $((60 * SLOWDOWN))s"
  fi
  kill -0 "$run_pid" 2>/dev/null || { tail -40 "$logs/run.log" >&2; fail "make run ended before syshaxd was ready"; }
  sleep 2
done
step "make run: syshaxd ready"
# the README's first curl, word for word but for the port
answer=$(in_root "curl -sS --max-time $((30 * SLOWDOWN)) http://127.0.0.1:$port/v1/completions \
  -H 'Content-Type: application/json' \
  -d '{\"model\": \"SmolLM2-135M-Instruct\", \"prompt\": \"The capital of France is\", \"max_tokens\": 32}'")
echo "$answer" > "$logs/first-curl.json"
text=$("$HOST_PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["choices"][0]["text"])' "$answer") \
  || fail "the first curl's answer is not a completion: $answer"
[ -n "$text" ] || fail "the first curl's answer has no text: $answer"
step "the README's first curl"
echo "    text: $(tr '\n' ' ' <<<"$text")"
if ! in_root ".venv/bin/syshax status" > "$logs/status.txt" 2>&1; then
  cat "$logs/status.txt" >&2; fail "syshax status failed"
fi
in_root "curl -sS http://127.0.0.1:$port/v1/syshax/status" > "$logs/status.json"
step "syshax status"
# what the warm-up proved on this CPU, and the promises that follow (each one that does not hold says why)
grep -E "kernels:|^greedy:|^  " "$logs/status.txt" | sed 's/^ */    /' || true
stop_in_root "syshaxd --host" $((3 * SLOWDOWN))  # it drains and stops; make run then ends
wait "$run_pid" || true
step "make run's daemon stopped"

# --- the tests ----------------------------------------------------------------------------------------------------
run_logged test-tools ".venv/bin/pip install -q 'pytest>=8' 'openai>=1.40'"
step "pytest and the openai client"
# shellcheck disable=SC2086
if in_root ".venv/bin/python -m pytest -q -rsx -p no:cacheprovider $(tr '\n' ' ' <<<"$TESTS")" 2>&1 \
    | tee "$logs/tests.log"; then
  step "the tests ($(grep -cE '::' <<<"$TESTS") of them)"
else
  fail "the tests failed (the log: $logs/tests.log)"
fi
printf 'make test-arm: passed in %ss; logs in %s\n' "$(( $(date +%s) - started ))" "$logs"
