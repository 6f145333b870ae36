"""Tests for syshaxd.notify: sd_notify datagrams land on a real AF_UNIX socket the test binds."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from syshaxd.notify import Notifier

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def path_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


@pytest.fixture
def abstract_socket():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"syshax-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    yield sock, "@" + name
    sock.close()


def recv_lines(sock) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_watchdog_stopping_reach_a_path_socket(path_socket):
    sock, path = path_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled

    assert notifier.status("loading model 1/2: smollm2-135m q4_0")
    assert recv_lines(sock) == ["STATUS=loading model 1/2: smollm2-135m q4_0"]

    assert notifier.ready(status="serving on 127.0.0.1:8000")
    assert recv_lines(sock) == ["READY=1", "STATUS=serving on 127.0.0.1:8000"]

    assert notifier.watchdog()
    assert recv_lines(sock) == ["WATCHDOG=1"]

    assert notifier.extend_timeout(90)
    assert recv_lines(sock) == ["EXTEND_TIMEOUT_USEC=90000000"]

    assert notifier.reloading()
    lines = recv_lines(sock)
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")

    assert notifier.stopping()
    assert recv_lines(sock) == ["STOPPING=1"]
    notifier.close()


def test_abstract_socket_name(abstract_socket):
    sock, name = abstract_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert notifier.send("READY=1")
    assert sock.recv(4096) == b"READY=1"


def test_status_text_stays_one_line(path_socket):
    sock, path = path_socket
    Notifier(path).status("engine failed:\nTraceback ...\n  boom")
    assert recv_lines(sock) == ["STATUS=engine failed: Traceback ... boom"]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        Notifier(path).send("READY=1\nSTATUS=x")


def test_no_socket_is_a_silent_no_op():
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("anything") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.watchdog_interval() is None


def test_relative_socket_path_is_refused(caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "relative.sock"})
    assert not notifier.enabled
    assert "relative.sock" in caplog.text


def test_dead_socket_logs_and_returns_false(tmp_path, caplog):
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert notifier.ready() is False
    assert "sd_notify" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec():
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(env).watchdog_interval() == 15.0
    # No WATCHDOG_PID: the watchdog is for whoever reads it.
    assert Notifier.from_env({"WATCHDOG_USEC": "2000000"}).watchdog_interval() == 1.0
    # Armed for another process (e.g. we are a child that inherited the env).
    other = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(other).watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "soon"}).watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "0"}).watchdog_interval() is None


def test_unset_environment_keeps_children_out(path_socket):
    _, path = path_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    notifier = Notifier.from_env(env, unset_environment=True)
    assert notifier.enabled and notifier.watchdog_interval() == 15.0
    assert env == {"PATH": "/bin"}


def test_a_separate_process_notifies_with_its_own_pid(path_socket):
    # What systemd checks under NotifyAccess=main: the sender's credentials.
    sock, path = path_socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    code = "from syshaxd.notify import Notifier; import sys; sys.exit(0 if Notifier.from_env().ready() else 1)"
    env = {**os.environ, "NOTIFY_SOCKET": path, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    msg, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    assert child.wait(timeout=30) == 0
    assert msg == b"READY=1"
    creds = [data for level, kind, data in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
    pid, _uid, _gid = struct.unpack("3i", creds[0])
    assert pid == child.pid
