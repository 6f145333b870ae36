"""Starts one syshaxd per mode for the benchmark, waits until it is healthy, and stops it with SIGTERM.

A mode the host cannot run makes syshaxd exit non-zero with a message on stderr;
that message becomes the reason the mode is reported as skipped.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

__all__ = ["DaemonStartFailed", "RunningDaemon", "daemon_command", "free_port", "start_daemon", "stop_daemon",
           "wait_healthy"]

_REASON_LINES = 12
# each daemon's prefix cache disk tier (unless its config names prefix_cache_dir): a folder of its own, removed when
# it stops, so that no run finds the blocks of an earlier one
_DISK_TIERS: dict[int, str] = {}


class DaemonStartFailed(Exception):
    """syshaxd exited or never became healthy; str() is the reason to report."""

    def __init__(self, reason: str, log_path: str | None = None, returncode: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.log_path = log_path
        self.returncode = returncode


@dataclass
class RunningDaemon:
    mode: str
    url: str
    process: subprocess.Popen
    argv: list[str]
    log_path: str
    startup_s: float

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    """Block until GET url/health answers 200 (a peer server the bench started itself); TimeoutError after timeout."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass  # not listening yet, or 503 while it loads
        time.sleep(0.25)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:g} s")


def daemon_command(override: str | None = None) -> list[str]:
    """The argv that starts syshaxd: the override as given, the `syshaxd` script, or `python -m syshaxd`."""
    if override:
        return shlex.split(override)
    beside_python = Path(sys.executable).with_name("syshaxd")
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return [str(beside_python)]
    found = shutil.which("syshaxd")
    if found:
        return [found]
    return [sys.executable, "-m", "syshaxd"]


def _log_tail(path: str, lines: int = _REASON_LINES) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


async def start_daemon(
    mode: str,
    *,
    command: list[str],
    host: str = "127.0.0.1",
    config: str | None = None,
    model: str | None = None,
    startup_timeout_s: float = 300.0,
    log_dir: str | None = None,
) -> RunningDaemon:
    """Start `command --host H --port P --mode MODE [--config] [--model]` and wait for GET /health 200.

    Raises DaemonStartFailed with the daemon's own words when it exits first, or when
    it is not healthy within startup_timeout_s (it is stopped then).
    """
    port = free_port(host)
    argv = [*command, "--host", host, "--port", str(port), "--mode", mode]
    if config:
        argv += ["--config", config]
    if model:
        argv += ["--model", model]
    log_dir = log_dir or tempfile.gettempdir()
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"syshax-bench-{mode}-{port}.log")
    started = time.perf_counter()
    disk_tier = tempfile.mkdtemp(prefix="syshax-bench-cache-")
    with open(log_path, "wb") as log:
        try:
            # stdout and stderr to a file, not a pipe: a chatty daemon must never block on a full pipe.
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=os.environ | {"CACHE_DIRECTORY": disk_tier},
            )
        except OSError as exc:
            shutil.rmtree(disk_tier, ignore_errors=True)
            raise DaemonStartFailed(f"could not run {shlex.join(argv)}: {exc}", log_path) from exc
    _DISK_TIERS[process.pid] = disk_tier
    url = f"http://{host}:{port}"
    deadline = started + startup_timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            code = process.poll()
            if code is not None:
                reason = _log_tail(log_path) or f"syshaxd exited with status {code} and said nothing"
                await stop_daemon(process)  # gone already: only its disk tier's folder is left to remove
                raise DaemonStartFailed(reason, log_path, code)
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return RunningDaemon(mode, url, process, argv, log_path, time.perf_counter() - started)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass  # not listening yet
            if time.perf_counter() > deadline:
                await stop_daemon(process)
                said = _log_tail(log_path)
                raise DaemonStartFailed(
                    f"not healthy within {startup_timeout_s:.0f} s (GET /health never answered 200)"
                    + (f"; last output:\n{said}" if said else "; it printed nothing"),
                    log_path,
                )
            await asyncio.sleep(0.25)


async def stop_daemon(process: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGTERM, wait up to grace_s for a clean exit, then SIGKILL the whole process group."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.perf_counter() + grace_s
        while process.poll() is None and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the group is it and its workers
            except (ProcessLookupError, PermissionError):
                process.kill()
            process.wait()
    disk_tier = _DISK_TIERS.pop(process.pid, "")
    if disk_tier:
        shutil.rmtree(disk_tier, ignore_errors=True)
    return process.returncode
