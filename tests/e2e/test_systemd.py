"""syshaxd under a service manager: sd_notify on a socket of the test's own, SIGTERM drains, SIGHUP reloads."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path


from conftest import MODEL_NAME, http_json, start_daemon


class NotifyListener:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET; keeps every message in arrival order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode().split("\n")))

    def lines(self) -> list[str]:
        return [line for _, lines in list(self.messages) for line in lines]

    def wait_for(self, line: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in self.lines():
                return
            time.sleep(0.05)
        raise AssertionError(f"{line} never arrived; got {self.lines()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_notify_sends_status_then_ready_watchdog_and_stopping(default_model, tmp_path, monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)  # unset: the watchdog is for whoever reads it
    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        d = start_daemon(tmp_path, {"model": str(default_model), "admin_socket": str(tmp_path / "admin.sock")},
                         env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "1000000"})
        try:
            listener.wait_for("READY=1", 30)
            # pings every half WATCHDOG_USEC: a few must follow READY within ~2 s
            time.sleep(2.0)
            # NotifyAccess=main: the engine workers must not inherit the socket's address
            worker_pid = d.status()["workers"][0]["pid"]
            worker_env = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
            assert not any(v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=")) for v in worker_env)
        finally:
            code = d.stop()
        assert code == 0, d.log()
        listener.wait_for("STOPPING=1", 5)
    finally:
        listener.close()

    lines = listener.lines()
    ready = lines.index("READY=1")
    statuses = [i for i, line in enumerate(lines) if line.startswith("STATUS=")]
    assert statuses and statuses[0] < ready, lines
    assert any(lines[i].startswith("STATUS=loading ") and "cpu0" in lines[i] for i in statuses if i < ready), lines
    assert lines[ready + 1].startswith("STATUS=serving ") and MODEL_NAME in lines[ready + 1]
    pings = [i for i, line in enumerate(lines) if line == "WATCHDOG=1"]
    stopping = lines.index("STOPPING=1")
    assert [i for i in pings if ready < i < stopping], f"no WATCHDOG=1 between READY and STOPPING: {lines}"
    assert len([i for i in pings if i > ready]) >= 2, lines
    assert ready < stopping
    assert lines[stopping + 1].startswith("STATUS=draining"), lines


def _stream(port: int, max_tokens: int, out: dict) -> None:
    """One streaming completion; out gets its SSE data lines, and a flag once the first token arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL_NAME, "prompt": "Tell me a story:", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    out["data"] = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            out["data"].append(line[6:])
            out["started"].set()
    conn.close()


def test_sigterm_lets_accepted_streams_finish_and_refuses_new_ones(default_model, tmp_path):
    # a drain long enough for a loaded CI machine: the streams must end by themselves, not by the timeout
    d = start_daemon(tmp_path, {"model": str(default_model), "admin_socket": str(tmp_path / "admin.sock"),
                                "drain_timeout": 300.0})
    max_tokens = 40
    results = [{"started": threading.Event()} for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(d.port, max_tokens, r), daemon=True) for r in results]
    try:
        for t in threads:
            t.start()
        for r in results:
            assert r["started"].wait(60), "a stream produced no first chunk"
        d.proc.send_signal(signal.SIGTERM)
        # the daemon is draining now: a new request is refused in OpenAI's shape, with a Retry-After
        deadline = time.monotonic() + 5
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            refused = (resp.status, json.loads(resp.read()), resp.getheader("Retry-After"))
            conn.close()
            if refused[0] == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.02)  # the signal may not have been handled yet
        status, body, retry_after = refused
        assert status == 503, body
        assert body["error"]["code"] == "draining" and body["error"]["type"] == "server_error"
        assert "draining" in body["error"]["message"] and retry_after and int(retry_after) > 0
        assert http_json(f"{d.url}/health")[0] == 503
        for t in threads:
            t.join(60)
        code = d.proc.wait(60)
    finally:
        d.stop()
    assert code == 0, d.log()
    for r in results:
        assert r["status"] == 200
        assert r["data"][-1] == "[DONE]", r["data"][-3:]
        chunks = [json.loads(x) for x in r["data"][:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # 4, or 5 when the probe above got in before the signal was handled
    log = d.log()
    assert re.search(r"draining: waiting up to 300s for [45] requests", log), log
    assert "drained: no request in progress" in log


def test_sighup_applies_live_keys_and_names_those_that_need_a_restart(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "admin_socket": str(tmp_path / "admin.sock"),
                                "max_queue_size": 64})
    config = d.log_path.with_suffix(".toml")  # start_daemon writes the config beside the log
    try:
        before = d.status()
        assert before["max_queue_size"] == 64
        text = config.read_text().replace("max_queue_size = 64", "max_queue_size = 3")
        config.write_text(text + "[engines]\nn_ctx = 2048\n")  # a table the file had not
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while d.status()["max_queue_size"] != 3:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
        after = d.status()
        assert after["capacity"] == before["capacity"] - 61
        log = d.log()
        assert "applied max_queue_size 64 -> 3" in log and "need a restart to apply: n_ctx 4096 -> 2048" in log

        # a broken file changes nothing, and the daemon goes on serving
        config.write_text(text.replace("max_queue_size = 3", "max_queue_size = -1"))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP: not reloading" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
        assert "max_queue_size: must be at least 0, got -1" in d.log()
        assert d.status()["max_queue_size"] == 3
        status, body = http_json(f"{d.base_url}/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        assert status == 200, body

        # drain_timeout is live too: with 1 s, a long stream is cut off and the daemon still exits 0
        config.write_text(text.replace("max_queue_size = 3", "max_queue_size = 3\ndrain_timeout = 1.0"))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "drain_timeout 30.0 -> 1.0" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
        long = {"started": threading.Event()}
        reader = threading.Thread(target=_stream, args=(d.port, 3000, long), daemon=True)
        reader.start()
        assert long["started"].wait(60)
        d.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = d.proc.wait(30)
        assert time.monotonic() - t0 < 15, "the drain did not stop at drain_timeout"
        reader.join(10)
    finally:
        d.stop()
    assert code == 0, d.log()
    assert long["data"][-1] != "[DONE]"
    assert "drain ended with 1 requests still running; they are cut off" in d.log()
