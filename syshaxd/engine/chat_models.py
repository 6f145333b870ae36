"""The chat models of [[models]]: each served by a syshaxd of its own, which this daemon starts on loopback when the
model loads, stops when it unloads, and forwards the model's requests to (api/core/model_proxy.py).

A child daemon is the single-model daemon a user would start by hand for that file, with this daemon's config and
the entry's own keys: its scheduler, prefix cache, KV ring and workers are its own, so its answers are the same
(llama-server's router mode runs a child server per model for the same reason). Stopping it gives back all of its
memory. It listens on 127.0.0.1 with a key of its own, written where only this daemon's user reads it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from syshaxd.config import KEYS, Config, ConfigError, from_mapping, plain, toml_text
from syshaxd.engine.entry_models import EntryModel, ModelsError
from syshaxd.engine.lifecycle import HandleState
from syshaxd.engine.status import ChatModelStatus
from syshaxd.model_entries import ModelEntry
from syshaxd.routing_rules import rule_can_match

log = logging.getLogger(__name__)

READY_LINE = "syshaxd ready on "  # what a daemon prints on stdout once it serves (daemon.Service._load)
NOT_READY = re.compile(r"engines did not become ready \((.*)\); the daemon keeps answering")
LOG_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$")  # the daemon's log format
STOP_GRACE = 10.0  # seconds past its drain_timeout a child may take to stop before it is killed
LINE_LIMIT = 1 << 20  # bytes of one line of the child's output read at once; a longer one is read in pieces
PARENT_VARIABLE = "SYSHAX_PARENT_PID"  # tells a child daemon to stop with this one (daemon.stop_with_parent)


def folder_name(model: str) -> str:
    """A model's name as one safe path component (names may hold "/" or ".."), unique by a hash of the name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model).strip(".") or "model"
    return f"{safe[:48]}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def child_environment(entry: ModelEntry, env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: this daemon's, less the variables that would override the entry's own keys
    (SYSHAX_QUANTIZE is in this daemon's quantize already), and with the pid it stops with."""
    dropped = {"SYSHAX_QUANTIZE"}
    if entry.cpu_affinity:
        dropped.add("CUSTOM_CPU_AFFINITY")
    if entry.threads:
        dropped.add("OMP_NUM_THREADS")
    return {k: v for k, v in env.items() if k not in dropped} | {PARENT_VARIABLE: str(os.getpid())}


def child_config(cfg: Config, entry: ModelEntry, path: Path, folder: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The config of the syshaxd that serves `entry`: this daemon's keys, the entry's own, and what makes it a child
    (loopback, a port of its own, its own admin socket and key, no [[models]], no remote nodes, no web page)."""
    values = {k: plain(k, getattr(cfg, k)) for k in KEYS}
    values.update(
        host="127.0.0.1", port=0, model=str(path), model_name=entry.name, models=[], models_dir="", max_loaded_models=0,
        admin_socket=str(folder / "admin.sock"), api_keys=[], api_key_file=str(folder / "api-key"),
        web_ui=False, remote_nodes=[], local_decoders=True, node_listen="",
        prefix_cache_dir=str(cfg.prefix_cache_dir_path(env) / "models" / folder_name(entry.name)),
        # a rule on another model could never match there (the child refuses such a rule at start)
        routing_rules=[r for r, rule in zip(plain("routing_rules", cfg.routing_rules), cfg.routing_rules)
                       if rule_can_match(rule, entry.name)])
    own = {"n_ctx": entry.n_ctx, "threads": entry.threads, "cpu_affinity": entry.cpu_affinity, "mode": entry.mode,
           "quantize": entry.quantize, "draft_model": entry.draft_model, "cpu_max_batch_size": entry.batch_slots}
    values.update({k: v for k, v in own.items() if v})
    return values


class ChildDaemon:
    """One syshaxd process serving a chat model for this daemon: started, watched until it says it serves, its log
    lines passed on under the model's name, and stopped (drained, then killed past its grace)."""

    remote = False

    def __init__(self, model: str, config: dict[str, Any], env: dict[str, str], drain_timeout: float) -> None:
        self.name = f"chat-{model}"
        self.model = model
        self.config = config
        self.env = env
        self.drain_timeout = drain_timeout
        self.state = HandleState.STOPPED
        self.error = ""
        self.ready = asyncio.Event()
        self.url = ""  # http://127.0.0.1:PORT once it serves
        self.key = secrets.token_hex(24)
        self.was_ready = False
        self.ready_at: float | None = None  # time.monotonic() when it said it serves, and when it exited
        self.exited_at: float | None = None
        self.exited = False
        self.folder: Path | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._reload_when_ready = False  # new keys came while it started
        self._session = None  # an aiohttp.ClientSession to it, made by the first forwarded request

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def start(self) -> None:
        self.state = HandleState.STARTING
        self._task = asyncio.ensure_future(self._run())

    def session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            # no bound on connections: the child's own max_queue_size and max_connections answer a crowd
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    def _write_config(self) -> Path:
        assert self.folder is not None
        config = {k: (v.replace("{folder}", str(self.folder)) if isinstance(v, str) else v)
                  for k, v in self.config.items()}
        path = self.folder / "syshax.toml"
        partial = path.with_suffix(".toml.new")  # a child reading it at that moment gets the old or the new file
        partial.write_text(toml_text(config), encoding="utf-8")
        os.replace(partial, path)
        return path

    async def _run(self) -> None:
        readers: asyncio.Future | None = None
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="syshax-model-", dir=_runtime_dir()))
            key_file = self.folder / "api-key"
            key_file.write_text(self.key + "\n", encoding="utf-8")
            key_file.chmod(0o600)
            path = self._write_config()
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "syshaxd", "--config", str(path), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env, limit=LINE_LIMIT)
            log.info("chat model %s: started its daemon (pid %d)", self.model, self.proc.pid)
            if self._stopping:  # stopped while it was being started
                self._signal(signal.SIGTERM)
            readers = asyncio.gather(self._read_stdout(), self._read_stderr())
            code = await self.proc.wait()
            try:  # what it wrote last; a process it left behind holding the pipes must not hold this up
                await asyncio.wait_for(asyncio.shield(readers), 2.0)
            except asyncio.TimeoutError:
                pass
        except Exception as exc:  # noqa: BLE001 - a child that cannot start must say why, not end the daemon
            log.exception("chat model %s: its daemon could not start", self.model)
            self._signal(signal.SIGKILL)
            self._failed(f"its daemon could not start: {exc}")
            return
        finally:
            if readers is not None:
                readers.cancel()
            self.exited = True
            self.exited_at = time.monotonic()
            self.ready.clear()
        if self.state != HandleState.STOPPED:  # not stopped by us: it died, or never served
            self._failed(self.error or f"its daemon exited with code {code} (see the lines above, under "
                         f"'model {self.model}:')")

    def reconfigure(self, config: dict[str, Any]) -> None:
        """New keys for the running child (a reload of this daemon): its file rewritten, then SIGHUP, which
        applies the live keys as a reload of any daemon does."""
        self.config = config
        if self.folder is not None and self.proc is not None and self.proc.returncode is None:
            self._write_config()
            if self.state == HandleState.READY:
                self._signal(signal.SIGHUP)
            else:  # SIGHUP before the child handles it would end it: it reloads once it says it serves
                self._reload_when_ready = True

    def _failed(self, why: str) -> None:
        if self.state != HandleState.FAILED:
            log.error("chat model %s: %s", self.model, why)
        self.state = HandleState.FAILED
        self.error = why

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in _lines(self.proc.stdout):
            line = raw.decode(errors="replace").rstrip()
            if line.startswith(READY_LINE) and self.state == HandleState.STARTING:
                self.url = line[len(READY_LINE):].strip()
                self.state = HandleState.READY
                self.was_ready = True
                self.ready_at = time.monotonic()
                self.ready.set()
                log.info("chat model %s: ready (its daemon on %s)", self.model, self.url)
                if self._reload_when_ready:
                    self._signal(signal.SIGHUP)
            elif line:
                log.info("model %s: %s", self.model, line)

    async def _read_stderr(self) -> None:
        """The child's log lines, passed on at their own level under the model's name."""
        assert self.proc is not None and self.proc.stderr is not None
        level = logging.INFO
        async for raw in _lines(self.proc.stderr):
            line = raw.decode(errors="replace").rstrip()
            parsed = LOG_LINE.match(line)
            if parsed:
                level, line = getattr(logging, parsed.group(1)), parsed.group(2)
            log.log(level, "model %s: %s", self.model, line)
            failed = NOT_READY.search(line)
            if failed and self.state == HandleState.STARTING:
                self._failed(f"its engines did not become ready: {failed.group(1)}")
                self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def stop(self) -> None:
        """Drain the child (its requests in progress finish, up to its drain_timeout), then stop it. It goes on to
        the end when the caller is cancelled (a request that was unloading it to make room, at shutdown)."""
        await asyncio.shield(self._stop())

    async def _stop(self) -> None:
        if self.state != HandleState.FAILED:
            self.state = HandleState.STOPPED
        self._stopping = True
        self.ready.clear()
        if self._session is not None:
            await self._session.close()
        self._signal(signal.SIGTERM)
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.drain_timeout + STOP_GRACE)
            except asyncio.TimeoutError:
                log.warning("chat model %s: its daemon did not stop within %gs; killed", self.model,
                            self.drain_timeout + STOP_GRACE)
                self._signal(signal.SIGKILL)
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), STOP_GRACE)
                except asyncio.TimeoutError:
                    log.error("chat model %s: its daemon (pid %s) is still there after SIGKILL", self.model,
                              self.proc.pid if self.proc else "?")
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


async def _lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The reader's lines; one longer than its limit comes in pieces rather than ending the reading."""
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # the end: what is left without a newline
            line = exc.partial
        except asyncio.LimitOverrunError as exc:  # over the limit: this much of it now, the rest next time
            line = await reader.readexactly(exc.consumed)
        if not line:
            return
        yield line


def _runtime_dir() -> str | None:
    """Where a child's config, key and admin socket go: systemd's RuntimeDirectory, else the user's, else /tmp."""
    for candidate in ((os.environ.get("RUNTIME_DIRECTORY") or "").split(":")[0], os.environ.get("XDG_RUNTIME_DIR")):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


class ChatModel(EntryModel):
    """A chat entry: its file, the child daemon serving it (absent while unloaded), and what it has served."""

    kind = "chat"

    def __init__(self, entry: ModelEntry, path: Path, cfg: Config, env: Mapping[str, str]) -> None:
        super().__init__(entry, path)
        self.env = dict(env)
        self.config = child_config(cfg, entry, path, Path("{folder}"), env)
        self.drain_timeout = cfg.drain_timeout
        self.failed_requests = 0

    def reconfigure(self, cfg: Config) -> None:
        """This daemon's keys changed (SIGHUP, syshax config set): its next load, and its running daemon now
        (live keys only, as any daemon's reload), take them."""
        mode = self.config["mode"]  # its mode stays as it started (syshax mode changes this daemon's own)
        self.config = child_config(cfg, self.entry, self.path, Path("{folder}"), self.env) | {"mode": mode}
        self.drain_timeout = cfg.drain_timeout
        if isinstance(self.handle, ChildDaemon):
            self.handle.reconfigure(self.config)

    @property
    def mode(self) -> str:
        return str(self.config["mode"])

    def _new_handle(self) -> ChildDaemon:
        return ChildDaemon(self.name, self.config, child_environment(self.entry, self.env), self.drain_timeout)

    def served_once(self) -> bool:
        return isinstance(self.handle, ChildDaemon) and self.handle.was_ready

    def served_for(self) -> float | None:
        handle = self.handle
        if isinstance(handle, ChildDaemon) and handle.ready_at is not None and handle.exited_at is not None:
            return handle.exited_at - handle.ready_at
        return None

    def _restartable(self, handle) -> bool:
        """A child that served and then died starts again at the next request (one loaded with the daemon also by
        itself: EntryModels.keep_started); one that never served stays failed until a load is asked for (syshax
        models load, POST /models/load), so requests are not each made to wait for a load that fails the same way."""
        return isinstance(handle, ChildDaemon) and handle.exited and handle.was_ready

    def status(self) -> ChatModelStatus:
        handle = self.handle
        return ChatModelStatus(
            name=self.name, file=self.path.name, state=self.state, load=self.entry.load,
            keep_alive=self.keep_alive, mode=self.mode, n_ctx=int(self.config["n_ctx"]),
            requests=self.requests, failed_requests=self.failed_requests, loads=self.loads, unloads=self.unloads,
            rss_mib=self.rss_mib(), pid=handle.pid if handle is not None else None,
            url=handle.url if isinstance(handle, ChildDaemon) else "",
            error=handle.error if handle is not None else "")


def plan_chat(cfg: Config, entry: ModelEntry, where: str, path: Path, env: Mapping[str, str]) -> ChatModel:
    """A chat entry: its child daemon's config, checked now as the child would check it (ModelsError names what is
    wrong), so a bad entry stops this daemon's start and not a request later."""
    model = ChatModel(entry, path, cfg, env)
    config = model.config
    try:
        from_mapping({k: v for k, v in config.items() if k not in ("api_key_file", "admin_socket")})
        tomllib.loads(toml_text(config))  # as the child will read it
    except ConfigError as exc:
        raise ModelsError(f"{where}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ModelsError(f"{where}: its daemon's config cannot be written as TOML ({exc}); see the keys' values")
    log.info("chat model %s: %s (mode %s, n_ctx %d, load %s), served by a syshaxd of its own", entry.name, path.name,
             config["mode"], config["n_ctx"], entry.load)
    return model
