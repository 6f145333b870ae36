"""`syshax benchmark` as a user runs it: against llama_cpp.server, a real syshaxd, the instant stub, and started daemons."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from syshaxd.benchmark.calibrate import calibrate_client
from syshaxd.benchmark.client import StreamingClient, run_level
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, WordPromptBuilder, default_tokenizer_path
from syshaxd.benchmark.report import MODE_RATIOS, level_summary
from syshaxd.benchmark.scenarios import parse_concurrency, scenario_named
from syshaxd.benchmark.stats import percentile, summarize
from syshaxd.benchmark.stub import InstantServer
from syshaxd.model import DEFAULT_QUANTIZED_NAME

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def benchmark(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m syshaxd.benchmark ARGS` the way a user would, and return what it did."""
    return subprocess.run(
        [sys.executable, "-m", "syshaxd.benchmark", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )


def benchmark_url(base_url: str, tmp_path: Path, *args: str, plot: bool = False,
                  timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict]:
    """A short benchmark of the OpenAI-compatible server at base_url; returns the run and its JSON document.

    Made to be reused for any server (llama_cpp.server here, syshaxd later): pass the
    server's base URL and any extra options.
    """
    out = tmp_path / f"bench-{time.monotonic_ns()}.json"
    argv = ["--url", base_url, "--json", str(out), *args]
    if plot:
        argv += ["--plot", str(out.with_suffix(".png"))]
    done = benchmark(*argv, timeout=timeout)
    assert done.returncode == 0, f"benchmark failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done, json.loads(out.read_text())


def assert_consistent(document: dict, iterations: int, strict_ttft: bool = False) -> None:
    """The figures of every level add up and are ordered the way statistics must be.

    strict_ttft: TTFT strictly below end-to-end. The instant stub's whole answer can arrive
    in one read, and then the two are the same instant.
    """
    for target in document["targets"]:
        if target["status"] != "ok":
            continue
        for level in target["levels"]:
            assert level["sent"] == iterations
            assert level["completed"] + level["failed"] == level["sent"]
            assert sum(level["errors"].values()) == level["failed"]
            assert len(level["requests"]) == level["sent"], "every request has a record, failed ones too"
            for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                figures = level[key]
                if figures["count"]:
                    assert figures["min"] <= figures["median"] <= figures["p90"] <= figures["p99"] <= figures["max"], key
            forced = level["forced_length"]
            assert forced["exact"] + forced["short"] + forced["long"] == level["completed"]
            for record in level["requests"]:
                if record["error"] is None:
                    assert 0 < record["ttft_s"] <= record["e2e_s"]
                    if strict_ttft:
                        assert record["ttft_s"] < record["e2e_s"]
                    assert record["output_tokens"] >= 1
                    assert len(record["itl_s"]) == max(0, record["chunks"] - 1)


def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def syshax_cli() -> list[str]:
    """The installed `syshax` console script, or the same CLI through python -m."""
    script = Path(sys.executable).with_name("syshax")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "syshaxd.cli"]


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout} s")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def model_path() -> Path:
    path = default_tokenizer_path()
    if not path.is_file():
        pytest.fail(f"the default model {path} is missing: prepare it first (q4_0 SmolLM2-135M-Instruct)")
    return path


@pytest.fixture(scope="module")
def llama_cpp_server(model_path: Path, tmp_path_factory):
    """A real llama_cpp.server on a free port, serving the default model."""
    pytest.importorskip("llama_cpp")
    try:
        import llama_cpp.server.app  # noqa: F401  (its [server] extra: uvicorn, fastapi, sse-starlette, ...)
    except ImportError as exc:
        pytest.fail(f"llama_cpp.server cannot start ({exc}); install uvicorn fastapi sse-starlette"
                    " starlette-context pydantic-settings")
    port = free_port()
    log = tmp_path_factory.mktemp("llama_cpp_server") / "server.log"
    with open(log, "wb") as log_file:
        # --interrupt_requests False: by default it cuts a running stream short when another request arrives.
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", "2048", "--interrupt_requests", "False"],
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60)
        yield f"http://127.0.0.1:{port}", server.pid
    except TimeoutError:
        pytest.fail(f"llama_cpp.server did not start:\n{log.read_text(errors='replace')[-2000:]}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("length", [1, 7, 128, 512, 2048])
def test_prompt_is_exactly_the_asked_length_in_model_tokens(model_path: Path, length: int):
    tokenizer = GGUFTokenizer(model_path)
    builder = PromptBuilder(tokenizer)
    prompts = [builder.build(length, seed) for seed in range(5)]
    for prompt in prompts:
        assert len(tokenizer.encode(prompt.text)) == length
        assert prompt.n_tokens == length
    if length > 1:
        assert len({p.text for p in prompts}) == len(prompts), "each request gets its own prompt"
        assert len({tokenizer.encode(p.text)[0] for p in prompts}) > 1, "prompts do not share a first token"
    assert builder.build(length, 3).text == prompts[3].text, "the same seed gives the same prompt"


def test_prompt_length_holds_where_words_merge_at_the_seams(model_path: Path):
    # Pieces that glue together when joined ("." + "..." is one token, "ab"+"cd" may be one):
    # the builder must cut and extend until the count is right.
    tokenizer = GGUFTokenizer(model_path)
    builder = PromptBuilder(tokenizer)
    builder._words = [".", "...", "!!", " 123", "4", "ab", "cd", "\n", " ", "  ", " a"]
    for length in (1, 2, 7, 33, 128):
        for seed in range(8):
            assert len(tokenizer.encode(builder.build(length, seed).text)) == length


# ---------------------------------------------------------------- against a real server


def test_short_benchmark_against_llama_cpp_server(llama_cpp_server, tmp_path: Path):
    url, pid = llama_cpp_server
    done, doc = benchmark_url(
        url, tmp_path, "--scenario", "custom", "--input-len", "16", "--output-len", "8",
        "--iterations", "4", "--concurrency", "1,2", "--warmup", "1", "--server-pid", str(pid), plot=True,
    )
    assert doc["schema"] == "syshax-benchmark/1"
    assert doc["settings"]["input_len"] == 16 and doc["settings"]["output_len"] == 8
    (target,) = doc["targets"]
    assert target["status"] == "ok" and target["model"]
    assert [level["concurrency"] for level in target["levels"]] == [1, 2]
    assert_consistent(doc, iterations=4, strict_ttft=True)
    for level in target["levels"]:
        assert level["completed"] == 4, level["errors"]
        assert level["output_throughput_tok_s"] > 0 and level["request_throughput_req_s"] > 0
        # llama_cpp.server sends no usage in its stream: tokens are counted from chunks
        assert level["forced_length"]["counted_from"] == {"chunks": 4}
        resources = level["resources"]
        assert resources["server_pid"] == pid and resources["daemon_rss_mib"]["max"] > 10
        assert len(resources["cpu_percent_per_core_mean"]) == os.cpu_count()
    machine = doc["machine"]
    assert machine["cpu_cores_logical"] >= 1 and machine["python"] and machine["os"]
    # the table a user reads
    assert "out tok/s" in done.stdout and "TTFT p99 ms" in done.stdout and machine["cpu_model"] in done.stdout
    assert_valid_png(next(tmp_path.glob("*.png")))


def test_short_benchmark_against_a_real_syshaxd(daemon, tmp_path: Path):
    # syshaxd honours ignore_eos and sends usage in its stream: every answer has exactly the length asked for.
    input_len, output_len, iterations = 16, 12, 4
    done, doc = benchmark_url(
        daemon.url, tmp_path, "--scenario", "custom", "--input-len", str(input_len), "--output-len", str(output_len),
        "--iterations", str(iterations), "--concurrency", "1,4", "--warmup", "1",
        "--server-pid", str(daemon.proc.pid), plot=True, timeout=60,
    )
    (target,) = doc["targets"]
    assert target["status"] == "ok" and target["model"] == "SmolLM2-135M-Instruct"
    assert target["warmup"]["completed"] == 1 and not target["warmup"]["errors"]
    assert [level["concurrency"] for level in target["levels"]] == [1, 4]
    assert_consistent(doc, iterations=iterations, strict_ttft=True)
    for level in target["levels"]:
        assert level["completed"] == iterations and level["failed"] == 0, level["error_examples"]
        assert level["output_tokens"] == iterations * output_len
        assert level["input_tokens"] == iterations * input_len
        forced = level["forced_length"]
        assert forced["exact"] == iterations and forced["stopped_early"] == 0
        assert forced["counted_from"] == {"usage": iterations}
        assert forced["finish_reasons"] == {"length": iterations}
        # the server's own count: the prompt's tokens, and BOS if the model adds one
        assert input_len <= level["server_prompt_tokens"]["min"] <= level["server_prompt_tokens"]["max"] <= input_len + 1
        for record in level["requests"]:
            assert record["output_tokens"] == output_len and record["output_tokens_source"] == "usage"
            assert record["done_marker"] is True
            assert record["tpot_s"] > 0
        assert level["ttft_s"]["median"] < level["e2e_s"]["median"]
        assert level["output_throughput_tok_s"] > 0
        resources = level["resources"]
        assert resources["server_pid"] == daemon.proc.pid
        assert resources["workers"] >= 1 and resources["workers_rss_mib"]["max"] > 10, "the engine worker is seen"
    assert doc["ratios"] == []
    assert "out tok/s" in done.stdout and "did not honour" not in done.stdout
    assert_valid_png(next(tmp_path.glob("*.png")))


# ---------------------------------------------------------------- honesty: client overhead, errors, short answers


def test_client_calibration_against_the_instant_stub_reports_its_ceiling():
    calibration = asyncio.run(calibrate_client(concurrency=4, output_len=64, requests=8))
    # figures, not a speed bar (a loaded machine reads less): each positive, and all from the one run, in which
    # the stub streamed one token per chunk
    assert calibration["max_output_tok_s"] > 0 and calibration["per_request_ms"] > 0
    tokens_per_chunk = calibration["max_output_tok_s"] * calibration["per_chunk_us"] / 1e6
    assert abs(tokens_per_chunk - 1.0) < 1e-6, calibration
    assert calibration["chunks_per_s"] == pytest.approx(calibration["max_output_tok_s"])


def test_self_test_benchmarks_the_stub_and_states_the_client_ceiling(tmp_path: Path):
    out = tmp_path / "self.json"
    done = benchmark("--self-test", "--scenario", "custom", "--input-len", "8", "--output-len", "32",
                     "--iterations", "8", "--concurrency", "1,4", "--json", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["client_calibration"]["max_output_tok_s"] > 0
    assert "client ceiling" in done.stdout
    assert_consistent(doc, iterations=8)
    for level in doc["targets"][0]["levels"]:
        assert level["completed"] == 8
        assert level["forced_length"]["exact"] == 8 and level["forced_length"]["counted_from"] == {"usage": 8}


def test_failed_requests_are_counted_by_kind_not_dropped(model_path: Path, tmp_path: Path):
    with InstantServer(error_every=3) as stub:
        _, doc = benchmark_url(stub.url, tmp_path, "--scenario", "custom", "--input-len", "8", "--output-len", "4",
                               "--iterations", "9", "--concurrency", "1", "--warmup", "0")
    (level,) = doc["targets"][0]["levels"]
    assert level["sent"] == 9 and level["failed"] == 3 and level["errors"] == {"http_500": 3}
    assert "planned failure" in level["error_examples"]["http_500"]
    assert_consistent(doc, iterations=9)


def test_a_stream_slower_than_the_clients_bound_is_recorded_as_a_timeout():
    """The client bounds a whole request with one timer (not one per read): a stream that runs past timeout_s
    ends as a "timeout" record, one within it completes."""
    from syshaxd.benchmark.prompts import Prompt

    async def send(url: str, timeout_s: float, tokens: int):
        client = StreamingClient(url, "m", tokens, timeout_s=timeout_s)
        async with aiohttp.ClientSession() as session:
            return await client.send(session, 0, Prompt("hello", 1, 0), time.perf_counter())

    with InstantServer(token_delay_s=0.05) as stub:
        slow = asyncio.run(send(stub.url, 0.5, 40))  # 2 s of tokens
        quick = asyncio.run(send(stub.url, 30.0, 4))
    assert slow.error == "timeout" and "0.5 s" in slow.error_detail and 0.5 <= slow.e2e_s < 1.5
    assert quick.error is None and quick.output_tokens == 4


def test_a_server_that_ignores_the_forced_length_is_reported(model_path: Path, tmp_path: Path):
    with InstantServer(max_output=5) as stub:
        done, doc = benchmark_url(stub.url, tmp_path, "--scenario", "custom", "--input-len", "8",
                                  "--output-len", "12", "--iterations", "4", "--concurrency", "2", "--warmup", "0")
    (level,) = doc["targets"][0]["levels"]
    assert level["forced_length"]["stopped_early"] == 4 and level["forced_length"]["min"] == 5
    assert level["output_tokens"] == 20
    assert "did not honour the forced output length" in done.stdout


class OneAnswerPerConnectionServer:
    """A raw HTTP/1.1 server that answers one streamed completion per connection and then, as llama-server does,
    drops the connection without a `Connection: close`: the next request sent on it is met by a close (how="close",
    the client reads EOF) or a reset (how="reset", RST). keep_alive=True serves every request instead.

    It records every request body, and answers each with max_tokens words "w0 w1 ...", usage in the last chunk.
    """

    def __init__(self, how: str = "close", keep_alive: bool = False):
        self.how = how
        self.keep_alive = keep_alive
        self.bodies: list[dict] = []
        self.connections = 0
        self.dropped = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> "OneAnswerPerConnectionServer":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_request(conn: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
        while b"\r\n\r\n" not in pending:
            data = conn.recv(65536)
            if not data:
                return None, b""
            pending += data
        head, _, rest = pending.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            data = conn.recv(65536)
            if not data:
                return None, b""
            rest += data
        return rest[:length], rest[length:]

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            pending, answered = b"", 0
            while True:
                body, pending = self._read_request(conn, pending)
                if body is None:
                    return
                if answered and not self.keep_alive:
                    self.dropped += 1
                    if self.how == "reset":  # SO_LINGER 0: close() sends RST
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                request = json.loads(body)
                self.bodies.append(request)
                conn.sendall(self._answer(request))
                answered += 1

    @staticmethod
    def _answer(request: dict) -> bytes:
        chat = "messages" in request
        n = int(request["max_tokens"])
        events = []
        for i in range(n):
            choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            choice.update({"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"})
            events.append({"choices": [choice]})
        events.append({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
        payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_server_that_closes_keep_alive_connections_loses_no_request(model_path: Path, tmp_path: Path, how: str):
    # llama-server closes the connection after each streamed answer without saying so: a client that reuses it
    # meets a closed socket before any answer. That is the client's stale connection, not a server failure.
    with OneAnswerPerConnectionServer(how) as server:
        done, doc = benchmark_url(server.url, tmp_path, "--model-name", "m", "--scenario", "custom",
                                  "--input-len", "8", "--output-len", "4", "--iterations", "16",
                                  "--concurrency", "1", "--warmup", "0")
    (level,) = doc["targets"][0]["levels"]
    assert level["completed"] == 16 and level["failed"] == 0, level["error_examples"]
    assert server.dropped > 0, "the client did reuse connections the server had dropped"
    assert level["retries"] == server.dropped > 0, "each of them was sent again, once, and counted as a retry"
    assert len(server.bodies) == 16 and level["forced_length"]["exact"] == 16
    assert all(r["retries"] in (0, 1) for r in level["requests"])
    assert "retried" in done.stdout and "sent again on a new one" in done.stdout
    assert "failed" not in done.stdout
    assert_consistent(doc, iterations=16)


def test_chat_scenario_resends_the_whole_history_with_the_servers_answers(model_path: Path, tmp_path: Path):
    system_len, turns, user_len, output_len = 24, 3, 6, 5
    with OneAnswerPerConnectionServer(keep_alive=True) as server:
        done, doc = benchmark_url(server.url, tmp_path, "--model-name", "m", "--scenario", "chat",
                                  "--system-len", str(system_len), "--turns", str(turns), "--input-len", str(user_len),
                                  "--output-len", str(output_len), "--concurrency", "2", "--warmup", "0")
    assert doc["settings"]["endpoint"] == "chat"
    assert doc["settings"]["chat"] == {"system_len": system_len, "turns": turns, "user_len": user_len}
    (level,) = doc["targets"][0]["levels"]
    assert level["sent"] == 2 * turns and level["completed"] == 2 * turns, level["error_examples"]
    # what the server saw: one shared system prompt, and each turn the history so far with its own answers in it
    assert len(server.bodies) == 2 * turns
    systems = {b["messages"][0]["content"] for b in server.bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in server.bodies)
    answer = "".join(f" w{i}" for i in range(output_len))
    for body in server.bodies:
        roles = [m["role"] for m in body["messages"]]
        turn = len(roles) // 2
        assert roles == ["system"] + ["user", "assistant"] * (turn - 1) + ["user"]
        assert all(m["content"] == answer for m in body["messages"] if m["role"] == "assistant")
    by_turn = {}
    for record in level["requests"]:
        by_turn.setdefault(record["turn"], set()).add(record["input_tokens"])
    assert sorted(by_turn) == list(range(1, turns + 1))
    assert by_turn[1] == {system_len + user_len}
    assert by_turn[turns] == {system_len + turns * user_len + (turns - 1) * output_len}
    assert [row["turn"] for row in level["turns"]] == list(range(1, turns + 1))
    assert all(row["completed"] == 2 and row["ttft_s"]["count"] == 2 for row in level["turns"])
    assert "TTFT p50 ms per turn" in done.stdout and f"turn {turns}" in done.stdout
    assert_consistent(doc, iterations=2 * turns)


def test_chat_scenario_against_a_real_syshaxd(daemon, tmp_path: Path):
    _, doc = benchmark_url(daemon.url, tmp_path, "--scenario", "chat", "--system-len", "32", "--turns", "2",
                           "--input-len", "8", "--output-len", "4", "--concurrency", "2", "--warmup", "0", timeout=60)
    (level,) = doc["targets"][0]["levels"]
    assert level["completed"] == 4 and level["retries"] == 0, level["error_examples"]
    first, second = level["turns"]
    # the server's own count grows by the user message, the answer and the chat template's tokens around them
    assert second["server_prompt_tokens"]["min"] > first["server_prompt_tokens"]["max"] + 8 + 4
    assert level["forced_length"]["exact"] == 4


def test_run_level_takes_one_output_length_per_prompt(model_path: Path):
    # The staggered-finish load: answers of different lengths, so batch slots free in scattered order.
    lengths = [3, 7, 5, 4]
    prompts = [WordPromptBuilder().build(4, i) for i in range(4)]

    async def go():
        async with aiohttp.ClientSession() as session:
            client = StreamingClient(stub.url, "instant-stub", 16)
            return await run_level(client, session, prompts, 2, output_len=lengths)

    with InstantServer() as stub:
        run = asyncio.run(go())
    assert [r.output_tokens for r in run.records] == lengths
    assert [r.max_tokens for r in run.records] == lengths
    summary = level_summary(run, None, None)
    assert summary["forced_length"]["exact"] == 4 and summary["forced_length"]["expected"] is None


def test_run_level_staggers_the_first_arrivals():
    # bench_real_shape's c=8 load: the first `concurrency` requests arrive arrival_gap_s apart (the rest as a slot
    # frees; with the instant stub the first slot would take them all before the second starts)
    prompts = [WordPromptBuilder().build(4, i) for i in range(3)]

    async def go():
        async with aiohttp.ClientSession() as session:
            client = StreamingClient(stub.url, "instant-stub", 2)
            return await run_level(client, session, prompts, 3, arrival_gap_s=0.2)

    with InstantServer() as stub:
        run = asyncio.run(go())
    assert all(r.ok for r in run.records)
    starts = sorted(r.start_s for r in run.records)
    assert starts[1] - starts[0] >= 0.19 and starts[2] - starts[1] >= 0.19, starts
    with pytest.raises(ValueError, match="arrival_gap_s"):
        asyncio.run(run_level(None, None, prompts, 3, arrival_gap_s=-1))


# ---------------------------------------------------------------- started daemons


STAND_IN_DAEMON = textwrap.dedent("""
    # Stands in for syshaxd in the launcher test: same command line, same /health, SIGTERM to stop.
    import signal, sys
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # before any thread: sigwait takes it below
    sys.path.insert(0, {repo!r})
    from syshaxd.benchmark.stub import InstantServer
    args = sys.argv[1:]
    mode, port = args[args.index("--mode") + 1], int(args[args.index("--port") + 1])
    if mode == "gpu":
        sys.exit("syshaxd: mode gpu: no GPU engine on this host (no CUDA device, no prefill plugin)")
    server = InstantServer(port=port).start()
    signal.sigwait([signal.SIGTERM])
    server.stop()
""")


def test_modes_are_started_one_daemon_each_and_unrunnable_ones_skipped(model_path: Path, tmp_path: Path):
    script = tmp_path / "daemon.py"
    script.write_text(STAND_IN_DAEMON.format(repo=str(REPO)))
    out = tmp_path / "modes.json"
    done = benchmark(
        "--daemon-cmd", f"{sys.executable} {script}", "--mode", "all",
        "--scenario", "custom", "--input-len", "8", "--output-len", "4", "--iterations", "3",
        "--concurrency", "1,2", "--warmup", "0", "--startup-timeout", "30", "--log-dir", str(tmp_path),
        "--json", str(out),
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    status = {t["label"]: t["status"] for t in doc["targets"]}
    assert status == {"cpu": "ok", "gpu": "skipped", "hetero": "ok", "auto": "ok"}
    gpu = next(t for t in doc["targets"] if t["label"] == "gpu")
    assert "no GPU engine on this host" in gpu["reason"] and gpu["daemon"]["returncode"] == 1
    for target in doc["targets"]:
        if target["status"] == "ok":
            assert target["daemon"]["returncode"] == 0, "stopped cleanly with SIGTERM"
            assert "--mode" in target["daemon"]["argv"] and target["mode"] in target["daemon"]["argv"]
    assert {(r["numerator"], r["denominator"]) for r in doc["ratios"]} == {("hetero", "cpu"), ("auto", "cpu")}
    assert "hetero/cpu" in done.stdout and "gpu: skipped" in done.stdout
    assert_consistent(doc, iterations=3)


def test_a_list_of_modes_runs_those_in_that_order_and_a_wrong_one_is_named(model_path: Path, tmp_path: Path):
    script = tmp_path / "daemon.py"
    script.write_text(STAND_IN_DAEMON.format(repo=str(REPO)))
    out = tmp_path / "list.json"
    done = benchmark("--daemon-cmd", f"{sys.executable} {script}", "--mode", "auto,cpu", "--scenario", "custom",
                     "--input-len", "8", "--output-len", "4", "--iterations", "2", "--concurrency", "1",
                     "--warmup", "0", "--startup-timeout", "30", "--log-dir", str(tmp_path), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert [t["label"] for t in json.loads(out.read_text())["targets"]] == ["auto", "cpu"]
    wrong = benchmark("--mode", "cpu,warp", "--iterations", "1")
    assert wrong.returncode == 2 and "'cpu,warp': modes are cpu, gpu, hetero, auto" in wrong.stderr


def test_nothing_runnable_exits_non_zero_with_the_reason(model_path: Path, tmp_path: Path):
    done = benchmark("--daemon-cmd", f"{sys.executable} -c \"import sys; sys.exit('no engine for this mode')\"",
                     "--mode", "cpu", "--scenario", "custom", "--input-len", "4", "--output-len", "4",
                     "--iterations", "1", "--warmup", "0")
    assert done.returncode == 1
    assert "cpu: skipped: no engine for this mode" in done.stdout


def test_syshax_benchmark_starts_its_own_daemon_for_every_mode(default_model: Path, tmp_path: Path):
    # The wired-in CLI, as a user types it: one real syshaxd per mode. Every mode runs on this host (the
    # "GPU" engine is prefill_engine's llama.cpp on CPUs); a mode a host cannot serve is reported as
    # skipped in syshaxd's own words (test_modes_are_started_one_daemon_each_and_unrunnable_ones_skipped).
    config = tmp_path / "syshax.toml"
    config.write_text(f"model_dir = {json.dumps(str(default_model.parent))}\nlog_level = \"info\"\n")
    out = tmp_path / "modes.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SYSHAX_CONFIG", "CUSTOM_CPU_AFFINITY", "OMP_NUM_THREADS")}
    done = subprocess.run(
        [*syshax_cli(), "benchmark", "--mode", "all", "--model", str(default_model), "--config", str(config),
         "--scenario", "custom", "--input-len", "8", "--output-len", "6", "--iterations", "2", "--concurrency", "2",
         "--warmup", "0", "--startup-timeout", "60", "--log-dir", str(tmp_path), "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=150, env=env,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    doc = json.loads(out.read_text())
    targets = {t["label"]: t for t in doc["targets"]}
    assert list(targets) == ["cpu", "gpu", "hetero", "auto"]
    assert targets["cpu"]["status"] == "ok", targets["cpu"]["reason"]
    for mode, target in targets.items():
        assert target["status"] == "ok", f"{mode}: {target['reason']}"
        assert target["daemon"]["returncode"] == 0, f"{mode}: not stopped cleanly by SIGTERM"
        assert target["daemon"]["argv"][-2:] == ["--model", str(default_model)]
        (level,) = target["levels"]
        assert level["completed"] == 2 and level["forced_length"]["exact"] == 2, level["error_examples"]
    assert {(r["numerator"], r["denominator"]) for r in doc["ratios"]} == set(MODE_RATIOS)
    assert_consistent(doc, iterations=2, strict_ttft=True)


def test_syshax_benchmark_help_lists_its_options():
    done = subprocess.run([*syshax_cli(), "benchmark", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for option in ("--scenario", "--concurrency", "--iterations", "--url", "--mode", "--json", "--plot", "--self-test",
                   "--system-len", "--turns"):
        assert option in done.stdout


def test_default_tokenizer_is_the_prepared_default_model(default_model: Path):
    path = default_tokenizer_path()
    assert path.name == DEFAULT_QUANTIZED_NAME and path.parent.name == "models"
    assert path.resolve() == default_model.resolve()


# ---------------------------------------------------------------- arguments and statistics


def test_scenarios_and_concurrency_lists():
    assert scenario_named("short").input_len == 128 and scenario_named("short").concurrency == (1, 2, 4, 8, 16)
    assert scenario_named("medium").output_len == 1024 and scenario_named("long").concurrency == (1, 2, 4)
    assert scenario_named("custom", 10, 20).input_len == 10
    with pytest.raises(ValueError, match="--input-len and --output-len"):
        scenario_named("custom", 10)
    assert parse_concurrency("8,1, 4,4") == (1, 4, 8)
    with pytest.raises(ValueError, match="--concurrency"):
        parse_concurrency("0")
    done = benchmark("--scenario", "custom", "--input-len", "4")
    assert done.returncode == 2 and "--output-len" in done.stderr
    done = benchmark("--scenario", "chat", "--endpoint", "completions")
    assert done.returncode == 2 and "needs --endpoint chat" in done.stderr
    done = benchmark("--scenario", "chat", "--turns", "0")
    assert done.returncode == 2 and "--turns: 0 is not allowed" in done.stderr


def test_percentiles_match_numpy_and_are_ordered():
    numpy = pytest.importorskip("numpy")
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2, 5.0]
    data = sorted(values)
    for q in (0, 50, 90, 99, 100):
        assert percentile(data, q) == pytest.approx(float(numpy.percentile(values, q)))
    figures = summarize(values)
    assert figures["min"] <= figures["median"] <= figures["p90"] <= figures["p99"] <= figures["max"]
    assert summarize([])["mean"] is None and summarize([])["count"] == 0
