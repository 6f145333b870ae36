"""The admin socket's client, as the CLI uses it (blocking, no event loop), and the errors both sides share."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

MAX_LINE = 1 << 20  # the longest line either side reads


class AdminError(Exception):
    """A command the daemon refused; code is machine-readable, message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AdminUnreachable(OSError):
    """No daemon answers on the socket; the message names the path and what to check."""


class AdminClient:
    """One connection to a daemon's admin socket; call() sends a command and returns its result."""

    def __init__(self, path: str | os.PathLike, timeout: float = 30.0) -> None:
        self.path = Path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.path))
        except FileNotFoundError:
            sock.close()
            raise AdminUnreachable(f"no admin socket at {self.path}: is syshaxd running? (systemctl status "
                                   "syshaxd), or pass --socket PATH") from None
        except PermissionError:
            sock.close()
            raise AdminUnreachable(f"permission denied on {self.path}: the admin socket is for root and the "
                                   "syshax group; run as root or add your user to the group") from None
        except ConnectionRefusedError:
            sock.close()
            raise AdminUnreachable(f"nothing listens on {self.path} (a stale socket: syshaxd is not running)") from None
        except OSError as exc:
            sock.close()
            raise AdminUnreachable(f"cannot connect to {self.path}: {exc.strerror or exc}") from None
        self._sock = sock
        self._file = sock.makefile("rb")

    def set_timeout(self, seconds: float | None) -> None:
        """How long call() waits for an answer (None: as long as it takes, as `syshax cache warm` does)."""
        self._sock.settimeout(seconds)

    def call(self, cmd: str, **args) -> object:
        try:
            self._sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a refused peer: the daemon wrote why and closed; read that below
        try:
            line = self._file.readline(MAX_LINE)
        except socket.timeout:
            raise AdminUnreachable(f"syshaxd did not answer {cmd!r} on {self.path} in time") from None
        except OSError as exc:  # the daemon closed a refused peer's connection
            raise AdminUnreachable(f"the connection to {self.path} failed: {exc.strerror or exc}") from None
        if not line:
            raise AdminUnreachable(f"syshaxd closed the connection on {self.path} without answering")
        reply = json.loads(line)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise AdminError(err.get("code", "error"), err.get("message", "the daemon refused the command"))
        return reply.get("result")

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
