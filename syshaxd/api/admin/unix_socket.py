"""The admin socket: newline-delimited JSON commands on a Unix socket, for root, the daemon's user and its group.

Protocol (version 1). A client connects and writes one JSON object per line;
the daemon answers each with one JSON object on one line, in order, and keeps
the connection open for more:

    -> {"cmd": "status"}
    <- {"ok": true, "result": {...}}
    -> {"cmd": "config.set", "key": "max_queue_size", "value": "0"}
    <- {"ok": false, "error": {"code": "invalid_value", "message": "..."}}

Commands: ``version``, ``status``, ``plugins``, ``config.get`` (``key``
optional), ``config.set`` (``key``, ``value`` as the user typed it or as a JSON
value, ``dry_run``), ``drain`` (``wait``: seconds to wait for in-flight
requests), ``resume``, ``mode`` (``mode``), ``help``. The daemon never writes
its config file (under systemd it cannot: /etc is read-only to it); ``syshax
config set --save`` writes it from the client side, after the daemon accepted
the value.

Who may connect is checked per connection with SO_PEERCRED (and SO_PEERGROUPS
for the peer's supplementary groups): root, the daemon's own uid, and members
of ``admin_group``. Anyone else gets one error line and the connection closed.
The socket file is mode 0660, group ``admin_group`` when that group exists.

Where the socket is (``default_path``): ``admin_socket`` when set; else
``$RUNTIME_DIRECTORY/admin.sock`` (systemd's ``RuntimeDirectory=syshax``, so
/run/syshax/admin.sock); else ``$XDG_RUNTIME_DIR/syshax/admin.sock``; else, for
root, /run/syshax/admin.sock; else ``admin.sock`` in ``model_dir``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import json
import logging
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from syshaxd import __version__
from syshaxd.api.admin.client import MAX_LINE, AdminError
from syshaxd.api.core.state import ModeUnavailable, NeedsRestart, ServiceState
from syshaxd.config import KEYS, LIVE_KEYS, MODES, SECRET_KEYS, Config, ConfigError, plain, shown

log = logging.getLogger(__name__)

PROTOCOL = 1
SYSTEM_SOCKET = Path("/run/syshax/admin.sock")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python does not name it
COMMANDS = ("version", "status", "plugins", "config.get", "config.set", "drain", "resume", "mode", "cache.stats",
            "cache.clear", "cache.warm", "models.list", "models.load", "models.unload", "help")


# --- where the socket is -------------------------------------------------------------------


def default_path(cfg: Config, env: Mapping[str, str]) -> Path:
    """The socket the daemon listens on for this config and environment (see the module's doc)."""
    if cfg.admin_socket:
        return Path(os.path.abspath(os.path.expanduser(cfg.admin_socket)))
    runtime = (env.get("RUNTIME_DIRECTORY") or "").split(":")[0]
    if runtime:
        return Path(runtime) / "admin.sock"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "syshax" / "admin.sock"
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    return Path(os.path.abspath(cfg.model_dir_path())) / "admin.sock"


def client_candidates(cfg: Config | None, env: Mapping[str, str]) -> list[Path]:
    """Where a client looks, in order, when not told: what the daemon would pick, then the system socket."""
    out = []
    if env.get("SYSHAX_ADMIN_SOCKET"):
        return [Path(env["SYSHAX_ADMIN_SOCKET"])]
    if cfg is not None and cfg.admin_socket:
        return [default_path(cfg, env)]
    out.append(SYSTEM_SOCKET)
    if env.get("XDG_RUNTIME_DIR"):
        out.append(Path(env["XDG_RUNTIME_DIR"]) / "syshax" / "admin.sock")
    if cfg is not None:
        out.append(Path(os.path.abspath(cfg.model_dir_path())) / "admin.sock")
    return list(dict.fromkeys(out))


# --- who may connect -----------------------------------------------------------------------


def _group_id(name: str) -> int | None:
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _peer(sock) -> tuple[int, int, int, list[int]]:
    """pid, uid, gid and supplementary groups of the process at the other end."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 256)
        groups = list(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:  # old kernel: fall back to the group database
        try:
            groups = os.getgrouplist(_user_name(uid), gid)
        except (KeyError, OSError):
            groups = []
    return pid, uid, gid, groups


def peer_refusal(uid: int, gid: int, groups: list[int], group_name: str) -> str:
    """Why this peer may not use the socket ("" when it may)."""
    if uid == 0 or uid == os.geteuid():
        return ""
    admin_gid = _group_id(group_name)
    if admin_gid is not None and (gid == admin_gid or admin_gid in groups):
        return ""
    allowed = f"root, {_user_name(os.geteuid())} (the daemon's user)"
    if admin_gid is not None:
        allowed += f" and members of group {group_name!r}"
        fix = f"; add the user to it (usermod -aG {group_name} {_user_name(uid)}) or run the command as root"
    else:
        fix = "; run the command as root" + (f" (group {group_name!r} does not exist here)" if group_name else "")
    return f"uid {uid} ({_user_name(uid)}) may not use the syshaxd admin socket: only {allowed} may{fix}"


# --- the server ----------------------------------------------------------------------------


class AdminServer:
    """Listens on the admin socket and answers commands against the daemon's ServiceState."""

    def __init__(self, path: Path, state: ServiceState, *, model_name: str = "", listen_url: str = "",
                 started: float | None = None) -> None:
        self.path = Path(path)
        self.state = state
        self.model_name = model_name
        self.listen_url = listen_url
        self.started = started or time.time()
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None
        self._conns: set[asyncio.Task] = set()

    @property
    def config(self) -> Config:
        return self.state.config

    async def start(self) -> str:
        """Start listening; returns "" or why not (logged by the caller; the daemon serves without it)."""
        path = self.path
        gid = _group_id(self.config.admin_group)
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(mode=0o750, parents=True)
                if gid is not None:  # so that the group can reach the socket inside
                    os.chown(path.parent, -1, gid)
        except OSError as exc:
            return f"cannot create {path.parent}: {exc.strerror}; set admin_socket to a writable place"
        if path.exists() or path.is_symlink():
            mode = path.lstat().st_mode
            if not stat.S_ISSOCK(mode):
                return f"{path} exists and is not a socket; remove it or set admin_socket to another path"
            if await _answers(path):
                return (f"{path} is in use by another running syshaxd; this one runs without an admin socket "
                        "(give each daemon its own admin_socket)")
            path.unlink(missing_ok=True)  # a stale socket from a daemon that is gone
        try:
            self._server = await asyncio.start_unix_server(self._serve, str(path), limit=MAX_LINE)
        except OSError as exc:
            return f"cannot listen on {path}: {exc.strerror}; set admin_socket to another path"
        st = path.stat()
        self._inode = (st.st_dev, st.st_ino)
        os.chmod(path, 0o660)  # the unit's UMask=0077 made it 0600; the admin group needs rw to connect
        owner = "root" if os.geteuid() == 0 else f"root and {_user_name(os.geteuid())}"
        if gid is None:
            if self.config.admin_group:
                log.info("group %r does not exist; the admin socket is for %s only", self.config.admin_group, owner)
        elif st.st_gid != gid:  # under the unit it already is (Group=syshax), and ~@privileged refuses chown
            try:
                os.chown(path, -1, gid)
            except OSError as exc:
                log.warning("cannot give %s to group %s (%s); it is for %s only", path, self.config.admin_group,
                            exc.strerror, owner)
        log.info("admin socket on %s (try: syshax status --socket %s)", path, path)
        return ""

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        try:
            st = self.path.stat()
            if (st.st_dev, st.st_ino) == self._inode:  # only ours: a successor may have taken the path
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # each connection is served in its own task
        self._conns.add(task)
        try:
            await self._session(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("admin connection failed")
        finally:
            self._conns.discard(task)
            writer.close()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid, gid, groups = _peer(writer.get_extra_info("socket"))
        refusal = peer_refusal(uid, gid, groups, self.config.admin_group)
        if refusal:
            log.warning("admin socket: refused pid %d: %s", pid, refusal)
            await _send(writer, _error("permission_denied", refusal))
            return
        while True:
            try:
                line = await reader.readline()
            except (asyncio.LimitOverrunError, ValueError):
                await _send(writer, _error("bad_request", f"a request line is longer than {MAX_LINE} bytes"))
                return
            if not line:
                return
            if not line.strip():
                continue
            await _send(writer, await self.answer(line, uid))

    async def answer(self, line: bytes, uid: int = 0) -> dict:
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error("bad_request", f"not a JSON object: {exc}; send one JSON object per line, "
                                         'e.g. {"cmd": "status"}')
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return _error("bad_request", 'each line must be a JSON object with a "cmd" string, e.g. {"cmd": "status"}')
        cmd = request["cmd"]
        handler = getattr(self, "cmd_" + cmd.replace(".", "_"), None)
        if cmd not in COMMANDS or handler is None:
            return _error("unknown_command", f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}")
        try:
            result = await handler(request)
        except AdminError as exc:
            return _error(exc.code, exc.message)
        except ConfigError as exc:
            code = "unknown_key" if str(exc).startswith("unknown key") else "invalid_value"
            return _error(code, str(exc))
        except NeedsRestart as exc:
            return _error("needs_restart", str(exc))
        except ModeUnavailable as exc:
            return _error("mode_unavailable", str(exc))
        except Exception as exc:
            log.exception("admin command %s failed", cmd)
            return _error("internal_error", f"{cmd} failed: {type(exc).__name__}: {exc}; see the daemon's log")
        if cmd not in ("version", "status", "plugins", "config.get", "cache.stats", "models.list", "help") \
                and not request.get("dry_run"):
            log.info("admin (uid %d): %s -> %s", uid, json.dumps(_masked(request)), json.dumps(_masked(result))[:300])
        return {"ok": True, "result": result}

    # --- commands -----------------------------------------------------------------------------

    async def cmd_help(self, request: dict) -> dict:
        return {"commands": list(COMMANDS), "protocol": PROTOCOL}

    async def cmd_version(self, request: dict) -> dict:
        return {"version": __version__, "protocol": PROTOCOL, "pid": os.getpid(), "started": self.started,
                "uptime_s": round(time.time() - self.started, 3), "mode": self.config.mode}

    async def cmd_status(self, request: dict) -> dict:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "model": self.model_name,
            "listen": self.listen_url,
            "config_source": os.path.abspath(self.config.source) if self.config.source else "",
            "draining": self.state.draining,
            "drain_reason": self.state.drain_reason,
            "http_active": self.state.active,
        } | self.state.scheduler.status().to_json()

    async def cmd_plugins(self, request: dict) -> list:
        from syshaxd.sdk.plugins import list_plugins

        return await asyncio.get_running_loop().run_in_executor(None, list_plugins)

    async def cmd_config_get(self, request: dict) -> dict:
        source = os.path.abspath(self.config.source) if self.config.source else ""
        key = request.get("key")
        if key is None:
            return {"values": {k: _secret(k, getattr(self.config, k)) for k in KEYS},
                    "live_keys": sorted(LIVE_KEYS | {"mode"}), "source": source}
        return {"key": key, "value": _secret(str(key), self.state.value(str(key))),
                "live": key in LIVE_KEYS or key == "mode", "source": source}

    async def cmd_config_set(self, request: dict) -> dict:
        key, value = request.get("key"), request.get("value")
        if not isinstance(key, str) or "value" not in request:
            raise AdminError("bad_request", 'config.set needs "key" and "value"')
        source = os.path.abspath(self.config.source) if self.config.source else ""
        old = _secret(key, self.state.value(key))  # the new value is the caller's own; the old one may not be
        value, _ = self.state.check(key, value)
        live = key in LIVE_KEYS or key == "mode"
        if request.get("dry_run"):
            reason = self.state.servable_modes().get(value, "") if key == "mode" else ""
            return {"key": key, "value": _secret(key, value), "old": old, "live": live and not reason, "source": source,
                    "applied": False, "why_not_live": reason}
        change = self.state.set(key, value)
        return {"key": key, "value": _secret(key, value), "old": old, "live": True, "source": source,
                "applied": bool(change.applied)}

    async def cmd_drain(self, request: dict) -> dict:
        self.state.drain("drained by an operator (syshax drain)")
        wait = request.get("wait") or 0
        if not isinstance(wait, (int, float)) or wait < 0:
            raise AdminError("invalid_value", f"drain: wait must be a number of seconds >= 0, got {wait!r}")
        drained = await self.state.wait_idle(float(wait)) if wait else self.state.active == 0
        return {"draining": True, "in_flight": self.state.active, "drained": drained}

    async def cmd_resume(self, request: dict) -> dict:
        was = self.state.draining
        self.state.resume()
        return {"draining": False, "was_draining": was}

    def _prefix_cache(self):
        ledger = self.state.scheduler.ledger
        if ledger.prefix is None:
            raise AdminError("no_prefix_cache", "this daemon keeps no prefix cache: it needs cpu or hetero mode with "
                             "llama.cpp engines and prefix_cache_mb above 0")
        return ledger.prefix

    async def cmd_cache_stats(self, request: dict) -> dict:
        return dataclasses.asdict(self._prefix_cache().status())

    async def cmd_cache_clear(self, request: dict) -> dict:
        prefix = self._prefix_cache()
        blocks = prefix.clear()
        files = await asyncio.get_running_loop().run_in_executor(None, prefix.disk.clear) if prefix.disk else 0
        return {"blocks": blocks, "files": files}

    async def cmd_cache_warm(self, request: dict) -> dict:
        from syshaxd.engine.prefix_warm import WarmError, warm
        from syshaxd.engine.scheduler import Overloaded, RouteUnavailable
        from syshaxd.engine.engine_handle import EngineUnavailable

        self._prefix_cache()
        try:
            return await warm(self.state.scheduler, request.get("entry"), self.config.request_timeout)
        except WarmError as exc:
            raise AdminError("invalid_value", f"cache.warm: {exc}") from None
        except (Overloaded, EngineUnavailable, RouteUnavailable) as exc:
            raise AdminError("unavailable", f"cache.warm: {exc}") from None

    def _entry_model(self, request: dict) -> str:
        entries = self.state.scheduler.entries
        name = request.get("name")
        if not isinstance(name, str) or name not in entries:
            names = ", ".join(entries.models) or "none (the config has no [[models]] entry)"
            raise AdminError("invalid_value", f"{request['cmd']}: {name!r} is no model of [[models]]; they are: "
                             f"{names} (the chat model always stays loaded)")
        return name

    async def cmd_models_list(self, request: dict) -> list:
        return self.state.scheduler.entries.status()

    async def cmd_models_load(self, request: dict) -> dict:
        from syshaxd.engine.engine_handle import EngineUnavailable

        name = self._entry_model(request)
        entries = self.state.scheduler.entries
        try:
            await entries.load(name, self.config.worker_start_timeout)
        except EngineUnavailable as exc:
            raise AdminError("unavailable", f"models.load: {exc}") from None
        return {"kind": entries[name].kind} | dataclasses.asdict(entries[name].status())

    async def cmd_models_unload(self, request: dict) -> dict:
        name = self._entry_model(request)
        entries = self.state.scheduler.entries
        unloaded = await entries[name].unload("asked by syshax models unload")
        return {"name": name, "unloaded": unloaded, "state": entries[name].state}

    async def cmd_mode(self, request: dict) -> dict:
        mode = request.get("mode")
        if mode not in MODES:
            raise AdminError("invalid_value", f"mode: must be one of {', '.join(MODES)}; got {mode!r}")
        old = self.config.mode
        change = self.state.set_mode(mode)
        return {"mode": self.config.mode, "previous": old, "changed": bool(change.applied)}


def _secret(key: str, value):
    """A key's value as the admin socket shows it: secrets (API keys) masked, routing rules as their tables."""
    return shown(key, value) if key in SECRET_KEYS else plain(key, value)


def _masked(obj: dict) -> dict:
    """A command or its result as the log shows it, with the value of a secret key masked."""
    if isinstance(obj, dict) and obj.get("key") in SECRET_KEYS:
        return {k: (shown(obj["key"], v) if k in ("value", "old") else v) for k, v in obj.items()}
    return obj


def _error(code: str, message: str) -> dict:
    return {"ok": False, "error": {"code": code, "message": message}}


async def _send(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(json.dumps(obj, default=str).encode() + b"\n")
    await writer.drain()


async def _answers(path: Path) -> bool:
    """Whether a live process accepts connections on the socket (then it is not stale)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
