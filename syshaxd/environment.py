"""The one table of environment variables syshax reads or documents, and the daemon's warning about test hooks.

docs/reference/environment.md is written from VARIABLES (python -m syshaxd.docs_reference), and
tests/e2e/test_docs_reference.py fails when README.md or a page names a SYSHAX_ variable this table lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["user", "systemd", "build", "internal", "test hook"]

# The reference's groups, in its order, with the line under each heading.
KINDS: dict[Kind, str] = {
    "user": "Set these in the daemon's environment (a shell, or /etc/sysconfig/syshax for the systemd unit).",
    "systemd": "systemd sets these for the service; a daemon started by hand does without them.",
    "build": "Read by the build scripts under mk/ (`make install`), not by the daemon.",
    "internal": "syshax sets these itself for the engines it starts; do not set them.",
    "test hook": "For the test suite only: each changes how the engines behave, so that a test can reach a path a "
                 "sound machine never takes.",
}


@dataclass(frozen=True)
class Variable:
    name: str
    kind: Kind
    doc: str  # one or two sentences for the reference
    read_in: str  # where it is read (a path in this repository), for whoever changes it
    effect: str = ""  # a test hook: what it does, in the daemon's warning


VARIABLES: tuple[Variable, ...] = (
    Variable("SYSHAX_CONFIG", "user", "The config file syshaxd and syshax read when no --config is given; without it "
             "./etc/syshax.toml, then /etc/syshax/syshax.toml are tried.", "syshaxd/config.py"),
    Variable("SYSHAX_QUANTIZE", "user", 'Overrides the quantize key: "q4_0", "q8_0", or "" to load every GGUF as it '
             "is.", "syshaxd/daemon.py"),
    Variable("SYSHAX_ADMIN_SOCKET", "user", "The admin socket `syshax status`, `config get/set`, `drain`, `resume`, "
             "`mode` and `version` talk to, where no --socket is given.", "syshaxd/api/admin/unix_socket.py"),
    Variable("CUSTOM_CPU_AFFINITY", "user", 'The CPU workers\' CPUs as cpulists, one worker per set, separated by ";" '
             '(e.g. "0-3;4-7"); overrides the cpu_affinity key.', "syshaxd/engine/numa.py"),
    Variable("OMP_NUM_THREADS", "user", "Threads per CPU worker where the threads key is 0; without it, one per CPU "
             "in the worker's set.", "syshaxd/sdk/placement.py"),
    Variable("XDG_CACHE_HOME", "user", "Where the prefix cache's disk tier goes when neither prefix_cache_dir nor "
             "CACHE_DIRECTORY is set: $XDG_CACHE_HOME/syshax/prefix (default ~/.cache).", "syshaxd/config.py"),
    Variable("XDG_RUNTIME_DIR", "user", "Where the admin socket goes when neither admin_socket nor "
             "RUNTIME_DIRECTORY is set: $XDG_RUNTIME_DIR/syshax/admin.sock.", "syshaxd/api/admin/unix_socket.py"),
    Variable("CUDA_VISIBLE_DEVICES", "user", "The GPUs the daemon's GPU engine sees; with the gpu_devices key, "
             "syshax sets it for each engine of the pool instead.", "syshaxd/sdk/worker.py"),
    Variable("VLLM_LOGGING_LEVEL", "user", "vLLM's own log level; where it is unset, syshax sets DEBUG when log_level "
             "is debug, else WARNING.", "plugins/vllm/syshax_vllm/engine.py"),
    Variable("MC_MIN_RPC_PORT", "user", "Mooncake's transfer engine (decode nodes): the lowest of the TCP ports it "
             "listens on, picked at random in 15000-17000 by default; with MC_MAX_RPC_PORT it narrows the range to "
             "open in a firewall.", "Mooncake (the remote extra)"),
    Variable("MC_MAX_RPC_PORT", "user", "Mooncake's transfer engine (decode nodes): the highest of the TCP ports it "
             "listens on.", "Mooncake (the remote extra)"),
    Variable("MC_LOG_LEVEL", "user", "Mooncake's own log level; where it is unset, syshax sets ERROR (it says much "
             "at start).", "syshaxd/remote/transfer.py"),
    Variable("CACHE_DIRECTORY", "systemd", "systemd's CacheDirectory= (/var/cache/syshax): the prefix cache's disk "
             "tier goes to its prefix/ folder when prefix_cache_dir is empty.", "syshaxd/config.py"),
    Variable("RUNTIME_DIRECTORY", "systemd", "systemd's RuntimeDirectory= (/run/syshax): the admin socket is "
             "admin.sock there when admin_socket is empty.", "syshaxd/api/admin/unix_socket.py"),
    Variable("CREDENTIALS_DIRECTORY", "systemd", "systemd's LoadCredential= folder; write api_key_file (or "
             'node_secret_file) as "$CREDENTIALS_DIRECTORY/api-keys" to read a credential from it.',
             "syshaxd/api/core/auth.py"),
    Variable("NOTIFY_SOCKET", "systemd", "Type=notify: the daemon reports its start-up, readiness, reloads and "
             "shutdown there (and unsets it, so its workers do not).", "syshaxd/notify.py"),
    Variable("WATCHDOG_USEC", "systemd", "WatchdogSec=: the daemon pings the watchdog every half of it while its "
             "loop runs and every loaded worker still reports.", "syshaxd/notify.py"),
    Variable("WATCHDOG_PID", "systemd", "The process the watchdog is meant for; the daemon pings only when it is "
             "its own.", "syshaxd/notify.py"),
    Variable("SYSHAX_WHEEL_CACHE", "build", "Where mk/llama-wheel.sh keeps the llama-cpp-python wheels it builds, "
             "one per CPU's features and compiler (default ~/.cache/syshax/wheels).", "mk/llama-wheel.sh"),
    Variable("CC", "build", "The C compiler mk/llama-wheel.sh builds llama.cpp with (default cc); its version is "
             "part of the wheel's cache key.", "mk/llama-wheel.sh"),
    Variable("SYSHAX_LLAMA_SDIST", "build", "A llama-cpp-python sdist that mk/llama-source.sh unpacks llama.cpp's "
             "HF-to-GGUF converter from, and mk/llama-arm-cross.sh and mk/llama-arm-wheel.sh build from, instead of "
             "downloading it (offline builds).", "mk/llama-source.sh"),
    Variable("SYSHAX_LLAMA_SRC_CACHE", "build", "Where mk/llama-source.sh unpacks the converter (default "
             "~/.cache/syshax).", "mk/llama-source.sh"),
    Variable("SYSHAX_LLAMA_WHEEL", "build", "A llama-cpp-python wheel built elsewhere that mk/llama-wheel.sh "
             "installs instead of compiling one (make test-arm hands its arm64 root the wheel "
             "mk/llama-arm-wheel.sh cross-compiled).", "mk/llama-wheel.sh"),
    Variable("SYSHAX_ARM_ARCH", "build", "The ARM target mk/llama-arm-cross.sh and mk/llama-arm-wheel.sh "
             "cross-compile llama.cpp for (default armv8.2-a+dotprod+fp16, a Kunpeng 920).", "mk/llama-arm-cross.sh"),
    Variable("SYSHAX_X86_LLAMA_SERVER", "build", "A llama-server of this host that mk/llama-arm-cross.sh also asks "
             "for the first token's likeliest, beside the ARM build's.", "mk/llama-arm-cross.sh"),
    Variable("SYSHAX_ARM_CACHE", "build", "Where mk/llama-arm-cross.sh, mk/llama-arm-wheel.sh and make test-arm "
             "keep their ARM builds, the arm64 root and its logs (default ~/.cache/syshax/arm).",
             "mk/llama-arm-cross.sh"),
    Variable("DEBIAN_SUITE", "build", "The Debian release make test-arm makes its arm64 root of (default bookworm, "
             "whose Python is 3.11).", "mk/test-arm.sh"),
    Variable("ARM_TESTS", "build", "The tests make test-arm runs in its arm64 root, one pytest node id a line "
             "(default: the warm-up proofs, hetero against cpu, a prefix-cache hit against a miss, speculation's "
             "texts).", "mk/test-arm.sh"),
    Variable("SYSHAX_TEST_SLOWDOWN", "build", "How many times longer the tests' waits are, a whole number (default "
             "1): make test-arm sets 20 for the tests it runs under qemu.", "tests/conftest.py"),
    Variable("SYSHAX_PARENT_PID", "internal", "Set by syshaxd for the daemon of a chat model of [[models]] it "
             "starts: that daemon stops (drains, then exits) when its parent does, even after kill -9.",
             "syshaxd/daemon.py"),
    Variable("SYSHAX_FA_TILED", "internal", "Set by the llama.cpp engine from the tiled_attention key for syshax's "
             "patched llama.cpp (mk/patches/): 1 makes every query row take the tiled attention path. Use "
             "tiled_attention instead; a value set by hand is overwritten.",
             "mk/patches/0005-ggml-cpu-flash-attention-SYSHAX_FA_TILED-1-tiles-every-query-row.patch"),
    Variable("GGML_CPU_TILED_MM", "internal", "Set to 0 by the llama.cpp engine so that each weight type runs one "
             "kernel whatever the batch size (a token's bits do not depend on its neighbours).",
             "plugins/llamacpp/syshax_llamacpp/contexts.py"),
    Variable("VLLM_ENABLE_V1_MULTIPROCESSING", "internal", "Set to 0 by the vLLM engine: vLLM's engine core runs in "
             "syshax's worker process, which shares its KV connector's outbox.", "plugins/vllm/syshax_vllm/engine.py"),
    Variable("MC_TCP_BIND_ADDRESS", "internal", "Set by a decode node to its node_listen host for Mooncake's transfer "
             "engine (which still listens on every interface: open its ports to the front only).",
             "syshaxd/remote/transfer.py"),
    Variable("SYSHAX_FAULT", "test hook", 'Makes engine workers fail on purpose: "warmup" or "decode" kill a worker '
             'with SIGSEGV there (":repacked": only while it runs repacked kernels); "chunking", "generated", "lone" '
             'or "guesses" fail that warm-up proof; "state" fails the warm-up as an unknown KV layout '
             "(syshaxd/sdk/faults.py).", "syshaxd/engine/plan.py",
             effect="injects faults (workers that crash or fail their warm-up proofs)"),
    Variable("SYSHAX_GUESS", "test hook", '"always": every decode step checks every speculative guess it has, '
             "whether or not it pays, so the tests prove a guess changes no text on any machine.",
             "syshaxd/engine/plan.py", effect="forces guesses (every speculative guess checked, paying or not)"),
    Variable("SYSHAX_SLOW", "test hook", '"WORKER=SECONDS[,WORKER=SECONDS...]" (e.g. "gpu0=0.05"): the named workers '
             "sleep that long after each engine step, a slower engine whose speed a test controls.",
             "syshaxd/engine/plan.py", effect="injects slowness (workers that sleep after each engine step)"),
)

BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}
TEST_HOOKS: tuple[str, ...] = tuple(v.name for v in VARIABLES if v.kind == "test hook")


def hook_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning per test hook `env` sets (an empty value sets nothing), for the daemon's log at start."""
    return [f"{v.name}={env[v.name]!r}: a test hook that {v.effect} (syshaxd/sdk/faults.py); production must not "
            f"set it: unset {v.name} in the daemon's environment"
            for v in VARIABLES if v.kind == "test hook" and env.get(v.name)]
