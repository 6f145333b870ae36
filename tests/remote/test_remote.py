"""Decode across hosts (issue 22), as two hosts on one machine: the front in this network namespace, the decode
node in its own, joined by a veth pair; real daemons, the real Mooncake transfer engine over TCP between them.

Needs root (ip netns); CI runs as root. Each test says what it shows a user: the texts of single-host hetero,
a node killed with -9 or cut off mid-stream costing no request, the node taken back when it returns, a wrong
secret refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon, wait_for
from greedy import CHATS, answer_all, assert_same

NS = f"shxnode{os.getpid() % 100000}"
FRONT_IF, NODE_IF = f"shxf{os.getpid() % 100000}", f"shxn{os.getpid() % 100000}"
FRONT_IP, NODE_IP = "10.211.0.1", "10.211.0.2"
NODE_PORT = 7070
PROMPTS = ["The three primary colours are", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _why_no_netns() -> str:
    if os.geteuid() != 0:
        return "two hosts on one machine need network namespaces, which need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip (make system-deps installs it)"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"needs the Mooncake transfer engine (pip install -e '.[remote]'): {exc}"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_no_netns()), reason=_why_no_netns() or "runs")


@pytest.fixture(scope="module")
def hosts():
    """A network namespace for the node, a veth pair from this namespace (the front's host) into it."""
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    _ip("netns", "add", NS)
    try:
        _ip("link", "add", FRONT_IF, "type", "veth", "peer", "name", NODE_IF)
        _ip("link", "set", NODE_IF, "netns", NS)
        _ip("addr", "add", f"{FRONT_IP}/24", "dev", FRONT_IF)
        _ip("link", "set", FRONT_IF, "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{NODE_IP}/24", "dev", NODE_IF)
        _ip("netns", "exec", NS, "ip", "link", "set", NODE_IF, "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", FRONT_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "node.secret"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


class Node:
    """syshaxd --node in the node's namespace, on CPU 1."""

    def __init__(self, tmp: Path, model: Path, secret: Path, port: int = NODE_PORT, **extra) -> None:
        self.tmp, self.model, self.secret = tmp, model, secret
        self.port, self.extra = port, extra
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / "node.log"

    def start(self) -> "Node":
        config = self.tmp / "node.toml"
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in ({
            "model": str(self.model), "model_name": MODEL_NAME, "model_dir": str(MODEL_DIR),
            "node_listen": f"{NODE_IP}:{self.port}", "node_secret_file": str(self.secret), "cpu_affinity": "1",
            "admin_socket": str(self.tmp / "node.sock")} | self.extra).items()))
        started = self.log().count("syshaxd node ready") if self.log_path.exists() else 0
        env = {k: v for k, v in os.environ.items() if k not in ("CUSTOM_CPU_AFFINITY", "OMP_NUM_THREADS")}
        self.proc = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-m", "syshaxd", "--config",
                                      str(config)], cwd=self.tmp, stdout=open(self.log_path, "a"),
                                     stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: self.log().count("syshaxd node ready") > started or self.proc.poll() is not None, 120,
                 "the node")
        assert self.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        return self.proc.returncode


def front_config(model: Path, secret: Path, **extra) -> dict:
    return {"model": str(model), "model_name": MODEL_NAME, "mode": "hetero", "prefill_cpu_affinity": "0",
            "remote_nodes": [f"{NODE_IP}:{NODE_PORT}"], "node_secret_file": str(secret), "node_link_timeout": 2.0,
            "cpu_affinity": "1"} | extra


def node_of(front) -> dict:
    (node,) = front.status()["nodes"]
    return node


MAX_TOKENS = 48  # greedy texts compared whole, long enough to be cut mid-stream (the long chats' test below: 128)


def complete(front, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    code, body = http_json(f"{front.url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                                           "max_tokens": max_tokens, "temperature": 0})
    assert code == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def single_host_texts(default_model, tmp_path_factory) -> dict[str, str]:
    """What single-host hetero answers (greedy), the texts every remote run must give."""
    d = start_daemon(tmp_path_factory.mktemp("single"), {"model": str(default_model), "model_name": MODEL_NAME,
                                                          "mode": "hetero", "prefill_cpu_affinity": "0"})
    try:
        return {p: complete(d, p) for p in PROMPTS}
    finally:
        assert d.stop() == 0


@pytest.fixture(scope="module")
def node(hosts, default_model, secret, tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"), default_model, secret).start()
    yield n
    if n.proc.poll() is None:
        assert n.stop() == 0, n.log()


def test_remote_decoding_gives_the_texts_of_single_host_hetero(node, default_model, secret, single_host_texts,
                                                               tmp_path):
    front = start_daemon(tmp_path, front_config(default_model, secret, local_decoders=False,
                                                admin_socket=str(tmp_path / "admin.sock")))
    try:
        wait_for(lambda: node_of(front)["link"] == "up", 30, "the node's link")
        for prompt in PROMPTS:
            assert complete(front, prompt) == single_host_texts[prompt], prompt
        status = front.status()
        remote = node_of(front)
        assert status["routes"] == {"hetero": len(PROMPTS)}
        assert remote["transfers"] == len(PROMPTS) and remote["transfer_failures"] == 0
        assert remote["bytes_moved"] > 0 and remote["transfer_seconds"]["count"] == len(PROMPTS)
        assert [d["state"] for d in remote["decoders"]] == ["ready"]
        assert status["kv"]["records_read"] == len(PROMPTS), status["kv"]  # imported on the node, not recomputed
        assert status["kv"]["records_held"] == 0  # the front's copies were freed after each write
        metrics = _text(f"{front.url}/metrics")
        assert f'syshax_node_up{{node="{NODE_IP}:{NODE_PORT}"}} 1.0' in metrics
        assert f'syshax_node_transfers_total{{node="{NODE_IP}:{NODE_PORT}"}} {float(len(PROMPTS))}' in metrics
        shown = subprocess.run([sys.executable, "-m", "syshaxd.cli", "status", "--socket",
                                str(tmp_path / "admin.sock")], capture_output=True, text=True, cwd=tmp_path)
        assert f"node {NODE_IP}:{NODE_PORT}: link up" in shown.stdout, shown
        assert "decode0: ready" in shown.stdout
    finally:
        assert front.stop() == 0, front.log()


def _text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _stream_all(front, prompts: list[str], max_tokens: int, results: dict,
                partial: dict | None = None) -> list[threading.Thread]:
    """Stream each prompt in a thread of its own: results[prompt] is its text (or exception), partial[prompt] what
    arrived so far."""
    import openai

    partial = {} if partial is None else partial
    client = openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0, timeout=120)

    def ask(prompt: str) -> None:
        try:
            text = ""
            for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True):
                text += chunk.choices[0].text
                partial[prompt] = text
            results[prompt] = text
        except Exception as exc:  # the assertion below shows it
            results[prompt] = exc

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
        time.sleep(0.15)  # one at a time, so that the least loaded decoder alternates: local, node, local, node
    return threads


def _requests_outlive_the_node(front, single_host_texts, cut) -> None:
    """Stream every prompt, half of them on the node; `cut` the node off mid-stream; each text must be whole."""
    results: dict = {}
    partial: dict = {}
    threads = _stream_all(front, PROMPTS, MAX_TOKENS, results, partial)
    wait_for(lambda: len([t for t in partial.values() if t]) == len(PROMPTS), 60, "every stream under way")
    on_node = node_of(front)["in_flight"]
    cut()
    for t in threads:
        t.join(120)
    for prompt in PROMPTS:
        assert results[prompt] == single_host_texts[prompt], (prompt, results[prompt], front.log()[-3000:])
    assert on_node >= 1
    rescued = front.status()["rescued"]
    assert rescued["resent"] + rescued["resumed"] >= on_node and rescued["lost"] == 0, rescued


def test_a_node_killed_mid_stream_costs_no_request_and_is_taken_back(node, default_model, secret, single_host_texts,
                                                                    tmp_path):
    front = start_daemon(tmp_path, front_config(default_model, secret))
    try:
        wait_for(lambda: node_of(front)["link"] == "up", 30, "the node's link")
        _requests_outlive_the_node(front, single_host_texts, node.kill)
        remote = node_of(front)
        assert remote["link"] == "down" and remote["links_lost"] == 1, remote
        assert front.status()["ready"]  # the local decoder serves meanwhile
        node.start()
        wait_for(lambda: node_of(front)["link"] == "up" and front.status()["workers"][-1]["state"] == "ready", 30,
                 "the node taken back")
        before = node_of(front)["transfers"]
        results: dict = {}
        for t in _stream_all(front, PROMPTS, MAX_TOKENS, results):
            t.join(120)
        assert [results[p] for p in PROMPTS] == [single_host_texts[p] for p in PROMPTS]
        assert node_of(front)["transfers"] > before  # the node decodes again
    finally:
        if node.proc.poll() is not None:
            node.start()  # for the tests after this one
        assert front.stop() == 0, front.log()


def test_a_link_cut_mid_stream_costs_no_request_and_the_node_returns(node, default_model, secret,
                                                                     single_host_texts, tmp_path):
    front = start_daemon(tmp_path, front_config(default_model, secret))
    try:
        wait_for(lambda: node_of(front)["link"] == "up", 30, "the node's link")
        try:
            _requests_outlive_the_node(front, single_host_texts, lambda: _ip("link", "set", FRONT_IF, "down"))
            remote = node_of(front)
            assert remote["link"] == "down" and "no answer within 2s" in remote["error"], remote
        finally:
            _ip("link", "set", FRONT_IF, "up")
        wait_for(lambda: node_of(front)["link"] == "up", 30, "the node back after the link came up")
        assert complete(front, PROMPTS[0]) == single_host_texts[PROMPTS[0]]
    finally:
        assert front.stop() == 0, front.log()


@pytest.fixture(scope="module")
def cpu_chats(default_model, tmp_path_factory) -> list:
    """cpu mode's answers to six long greedy chats (tests/greedy.py): the README's reference for every route."""
    d = start_daemon(tmp_path_factory.mktemp("cpu"), {"model": str(default_model), "model_name": MODEL_NAME,
                                                       "n_ctx": 1024})
    try:
        return answer_all(d, chats=CHATS[:6])
    finally:
        assert d.stop() == 0


def _when_busy(front, tokens: int = 48) -> None:
    """Wait until the node has generated `tokens` more tokens for this front: every stream is mid-answer."""
    def generated() -> int:
        return next(w for w in front.status()["workers"] if w["name"].startswith("node "))["stats"]["generated_tokens"]

    start = generated()
    wait_for(lambda: generated() >= start + tokens, 120, "the node mid-stream", every=0.05)


def test_a_node_alone_killed_and_cut_off_under_load_keeps_every_text_whole(node, default_model, secret, cpu_chats,
                                                                         tmp_path):
    """Six long greedy chats at once on a front whose only decoder is the node: undisturbed, with the node killed with
    -9 mid-stream (and started again), and with its link down for 5 s twice, every stream gets exactly its 128 tokens
    and cpu mode's text: a resume on the node is exact, and no event of a cancelled attempt reaches its successor."""
    front = start_daemon(tmp_path, front_config(default_model, secret, local_decoders=False, n_ctx=1024))
    chats = CHATS[:6]
    try:
        wait_for(lambda: node_of(front)["link"] == "up", 30, "the node's link")
        assert_same(answer_all(front, chats=chats), cpu_chats, "the node, undisturbed")
        assert front.status()["exact"] == {"hetero_equals_cpu": True, "resume_exact": True, "why": []}

        def kill_and_start_again() -> None:
            _when_busy(front)
            node.kill()
            node.start()

        assert_same(answer_all(front, chats=chats, during=kill_and_start_again), cpu_chats, "the node killed")

        def cut_twice() -> None:
            for _ in range(2):
                wait_for(lambda: node_of(front)["link"] == "up", 60, "the node's link back")
                _when_busy(front, 24)
                _ip("link", "set", FRONT_IF, "down")
                try:
                    time.sleep(5)
                finally:
                    _ip("link", "set", FRONT_IF, "up")

        assert_same(answer_all(front, chats=chats, during=cut_twice), cpu_chats, "the link cut twice")
        remote = node_of(front)
        assert remote["links_lost"] == 3, remote
        rescued = front.status()["rescued"]
        assert rescued["lost"] == 0 and rescued["resumed"] >= 6, rescued
    finally:
        if node.proc.poll() is not None:
            node.start()  # for the tests after this one
        assert front.stop() == 0, front.log()


def test_two_fronts_share_one_node_each_within_its_share_and_one_going_away_leaves_the_other_alone(
        hosts, default_model, secret, cpu_chats, tmp_path):
    """One node (node_front_slots = 3) and two fronts decoding only there. Front A sends six long chats: three run,
    three wait on the node for A's share. Front B's three, sent after, run at once beside them and end first, with
    cpu mode's texts. Then A is killed with -9 mid-stream: the node cancels A's requests alone; B's all end whole."""
    import threading

    shared = Node(tmp_path / "node", default_model, secret, port=NODE_PORT + 1, node_front_slots=3,
                  node_link_timeout=2.0)
    (tmp_path / "node").mkdir()
    shared.start()
    config = front_config(default_model, secret, local_decoders=False, n_ctx=1024,
                          remote_nodes=[f"{NODE_IP}:{NODE_PORT + 1}"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start_daemon(tmp_path / "a", config)
    b = start_daemon(tmp_path / "b", config)
    try:
        for front in (a, b):
            wait_for(lambda front=front: node_of(front)["link"] == "up" and node_of(front)["fronts"] == 2, 30,
                     "both fronts on the node")
        assert node_of(a)["slots"] == node_of(b)["slots"] == 3  # each front's share of the node's 8 slots
        ends: dict = {}

        def timed(front, chats, key):
            got = answer_all(front, chats=chats)
            ends[key] = (time.monotonic(), got)

        runner = threading.Thread(target=timed, args=(a, CHATS[:6], "a"))
        runner.start()
        _when_busy(a, 24)
        timed(b, CHATS[:3], "b")
        runner.join(300)
        assert_same(ends["a"][1], cpu_chats, "front A, three of six waiting for its share")
        assert_same(ends["b"][1], cpu_chats[:3], "front B beside A")
        assert ends["b"][0] < ends["a"][0]  # B's ran within its own share, not behind A's queue

        # A goes away mid-stream: B's requests there are not touched
        doomed = threading.Thread(target=lambda: _swallow(lambda: answer_all(a, chats=CHATS[:3])), daemon=True)
        doomed.start()
        survivors = threading.Thread(target=timed, args=(b, CHATS[3:6], "b2"))
        survivors.start()
        _when_busy(b, 24)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        survivors.join(300)
        assert_same(ends["b2"][1], cpu_chats[3:6], "front B while front A died")
        assert b.status()["rescued"] == {"resent": 0, "resumed": 0, "lost": 0}
        wait_for(lambda: "gone (the front closed the connection)" in shared.log(), 10, "the node noticing A gone")
    finally:
        a.stop()
        assert b.stop() == 0, b.log()
        shared.stop()


def _swallow(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 -- its daemon is killed under it: the error is the point
        pass


def test_a_front_with_the_wrong_secret_is_refused(node, default_model, tmp_path):
    wrong = tmp_path / "wrong.secret"
    wrong.write_text(os.urandom(32).hex())
    refused_before = node.log().count("refused a connection")
    front = start_daemon(tmp_path, front_config(default_model, wrong))
    try:
        remote = wait_for(lambda: node_of(front)["link"] == "refused" and node_of(front), 30, "the refusal")
        assert "refused this front's secret" in remote["error"], remote
        assert remote["transfers"] == 0 and remote["decoders"] == []
        wait_for(lambda: node.log().count("refused a connection") > refused_before, 10, "the node's log line")
        assert "the front's proof does not match this node's secret" in node.log()
        assert complete(front, PROMPTS[0])  # its own decoder serves
        assert front.status()["routes"] == {"hetero": 1}
    finally:
        assert front.stop() == 0, front.log()


def test_a_node_speaks_to_systemd_and_refuses_to_start_unsafely(default_model, secret, tmp_path):
    """The node runs under syshaxd.service as the front does: READY, WATCHDOG, STOPPING; SIGHUP answered, not
    fatal. It will not listen on every interface, nor start without a secret, and says what to set."""
    from conftest import free_port
    from test_systemd import NotifyListener

    base = {"model": str(default_model), "model_name": MODEL_NAME, "cpu_affinity": "1"}
    for extra, said in (({"node_listen": "0.0.0.0:7070", "node_secret_file": str(secret)}, "is every interface"),
                        ({"node_listen": f"127.0.0.1:{free_port()}"}, "node_secret_file is not set")):
        d = start_daemon(tmp_path, base | extra, wait=False, args=["--log-level", "info"])
        assert d.proc.wait(60) == 2, d.log()
        assert said in d.log(), d.log()

    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        d = start_daemon(tmp_path, base | {"node_secret_file": str(secret)}, wait=False,
                         args=["--node", f"127.0.0.1:{free_port()}"],
                         env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "1000000"})
        listener.wait_for("READY=1", 60)
        time.sleep(1.5)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "applies its config at a restart" in d.log(), 10, "the SIGHUP answer")
        assert d.stop() == 0, d.log()
        listener.wait_for("STOPPING=1", 5)
    finally:
        listener.close()
    lines = listener.lines()
    ready = lines.index("READY=1")
    assert lines[ready + 1].startswith("STATUS=decode node on 127.0.0.1:") and "1 of 1 decoders ready" in lines[ready + 1]
    assert len([line for line in lines[ready:] if line == "WATCHDOG=1"]) >= 2, lines


def test_the_node_refuses_a_record_that_is_not_what_the_front_reported(node, secret):
    """A front (this test, speaking the wire protocol) writes bytes into the node's ring with the real transfer
    engine and reports a record that is not there, with a good MAC: the node's decoder refuses it (Imported not ok,
    "checksum") and answers from the prompt instead. (A record whose MAC fails never reaches a decoder:
    tests/remote/test_node_wire.py.)"""
    import asyncio
    import mmap

    from syshaxd.remote import wire
    from syshaxd.remote.transfer import TransferEngine, mapping_address
    from syshaxd.sdk.types import (Delta, GenerateRequest, Handling, Imported, KVHandle, SamplingParams, Submit)

    saved = {k: os.environ.get(k) for k in ("MC_LOG_LEVEL", "MC_TCP_BIND_ADDRESS")}
    engine = TransferEngine(FRONT_IP)  # sets those for this process: put back below, for the daemons started later
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    length = 64 * 1024
    buffer = mmap.mmap(-1, length)
    buffer[:] = os.urandom(length)
    engine.register(mapping_address(buffer), length)
    tokens = (1, 504, 3458, 282, 4649, 314)

    async def as_a_front() -> list:
        reader, writer = await asyncio.open_connection(NODE_IP, NODE_PORT)
        sealed = await wire.prove_as_front(reader, writer, secret.read_bytes().strip())
        hello = await sealed.read(reader)
        await sealed.send(writer, wire.FrontHello("a forging front"))

        async def next_of(kind):
            while not isinstance(message := await asyncio.wait_for(sealed.read(reader), 30), kind):
                pass
            return message

        await sealed.send(writer, wire.ReserveKV("forged", length))
        room = await next_of(wire.KVReserved)
        assert not room.error, room
        await asyncio.to_thread(engine.write, hello.transfer_session, mapping_address(buffer), room.address, length)
        handle = KVHandle(room.offset, length, room.seq, 0x5EC12E7, len(tokens), tokens[-1], time.time())
        request = GenerateRequest("forged", max_tokens=6, sampling=SamplingParams(temperature=0), prompt_tokens=tokens)
        # its MAC is good (this front wrote these bytes, for this request and room): the decoder's own checks refuse it
        mac = wire.record_mac(sealed.record_key, "forged", room.offset, room.seq, buffer[:length])
        await sealed.send(writer, wire.ToNode(Submit(request, Handling(kv=handle)), mac))
        events = []
        while not (events and isinstance(events[-1], Delta) and events[-1].finish_reason):
            events += (await next_of(wire.FromNode)).events
        writer.close()
        return events

    events = asyncio.run(as_a_front())
    (imported,) = [e for e in events if isinstance(e, Imported)]
    assert not imported.ok and imported.reason == "checksum", imported
    assert sum(e.n_tokens for e in events if isinstance(e, Delta)) == 6  # recomputed from the prompt, answered
    assert events[-1].finish_reason == "length"


def test_a_node_that_serves_another_model_is_refused(secret, tmp_path):
    """A node serving another GGUF (the same model quantized otherwise) is refused at its hello, by the model
    fingerprint, and the front says so; no request goes there."""
    from conftest import free_port

    other = MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not other.exists():
        pytest.skip(f"needs {other.name} (the default model's wheel unpacks it)")
    address = f"127.0.0.1:{free_port()}"
    node = start_daemon(tmp_path, {"model": str(other), "model_name": MODEL_NAME, "quantize": "",
                                   "node_secret_file": str(secret), "cpu_affinity": "1"},
                        wait=False, args=["--node", address])
    try:
        wait_for(lambda: "syshaxd node ready" in node.log() or node.proc.poll() is not None, 120, "the node")
        front = start_daemon(tmp_path, front_config(MODEL_DIR / "SmolLM2-135M-Instruct.q4_0.gguf", secret,
                                                    remote_nodes=[address]))
        try:
            remote = wait_for(lambda: (n := node_of(front))["link"] == "refused" and n, 30, "the refusal")
            assert "serves another model" in remote["error"], remote
            assert complete(front, PROMPTS[0])  # the front's own decoder serves
            assert node_of(front)["transfers"] == 0
        finally:
            assert front.stop() == 0, front.log()
    finally:
        node.stop()
