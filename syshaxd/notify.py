"""Tell systemd how the daemon is doing (sd_notify: READY, STATUS, WATCHDOG, STOPPING), without libsystemd.

The protocol is one AF_UNIX datagram of newline-separated ``KEY=VALUE`` lines
sent to the socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace). When the variable is unset (not started by systemd, or
``Type=`` is not ``notify``) every call is a no-op, so the daemon can call these
unconditionally.

With ``NotifyAccess=main`` systemd only listens to the daemon's own PID, so the
daemon should build its notifier with ``unset_environment=True``: the engine
workers it spawns then do not inherit ``NOTIFY_SOCKET`` / ``WATCHDOG_*`` and
cannot be mistaken for (or try to act as) the service's main process.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

# Variables systemd hands the main process for this protocol.
_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# A blocked PID 1 must not stall the event loop for long; a lost message is
# recoverable (the next STATUS/WATCHDOG follows), a frozen daemon is not.
_SEND_TIMEOUT_S = 1.0


class Notifier:
    """A handle on the service manager's notification socket; every method is a no-op when there is none."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        self.address = address or None
        self._sockaddr = _sockaddr(self.address) if self.address else None
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> "Notifier":
        """Build a notifier from ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` / ``WATCHDOG_PID`` in ``environ``.

        ``environ`` defaults to ``os.environ`` (read now, not at import time).
        With ``unset_environment=True`` those variables are removed from it, as
        ``sd_notify(unset_environment=1, ...)`` does, so child processes started
        afterwards do not inherit them.
        """
        if environ is None:
            environ = os.environ
        address = environ.get("NOTIFY_SOCKET") or None
        usec = _parse_positive_int(environ.get("WATCHDOG_USEC"), "WATCHDOG_USEC")
        pid = _parse_positive_int(environ.get("WATCHDOG_PID"), "WATCHDOG_PID")
        if unset_environment:
            if not isinstance(environ, MutableMapping):
                raise TypeError("unset_environment=True needs a mutable environ mapping")
            for key in _ENV_KEYS:
                environ.pop(key, None)
        if address and not (address.startswith("/") or address.startswith("@")):
            # systemd >= 254 can also hand out vsock: addresses (VMs); we do not speak those.
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an @abstract name; not notifying", address)
            address = None
        return cls(address, watchdog_usec=usec, watchdog_pid=pid)

    @property
    def enabled(self) -> bool:
        """Whether there is a service manager to talk to."""
        return self._sockaddr is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines (e.g. ``send("READY=1", "STATUS=serving")``).

        Returns True when the datagram was sent, False when notifications are
        off or the send failed (logged, never raised: a notification must not
        take the daemon down).
        """
        if self._sockaddr is None or not lines:
            return False
        for line in lines:
            if "=" not in line or "\n" in line:
                raise ValueError(f"sd_notify line must be one KEY=VALUE line, got {line!r}")
        payload = "\n".join(lines).encode("utf-8")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(_SEND_TIMEOUT_S)
                self._sock = sock
            self._sock.sendto(payload, self._sockaddr)
        except OSError as exc:
            log.warning("sd_notify to %s failed (%s): %r", self.address, exc, payload)
            self.close()
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Report start-up finished (``READY=1``), optionally with a status line."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.send(*lines)

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows (``STATUS=...``)."""
        return self.send(_status_line(text))

    def reloading(self) -> bool:
        """Report a configuration reload started (``RELOADING=1``); send ``ready()`` when it is done."""
        # MONOTONIC_USEC lets systemd >= 253 (Type=notify-reload) match this
        # reload to its request; older managers ignore the extra field.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self, status: str | None = None) -> bool:
        """Report shutdown started (``STOPPING=1``), optionally with a status line."""
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.send(*lines)

    def watchdog(self) -> bool:
        """Ping the service watchdog (``WATCHDOG=1``)."""
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout fires (``EXTEND_TIMEOUT_USEC``), e.g. during a long model load."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or None when no watchdog is armed for this process."""
        if not self._watchdog_usec:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        """Close the socket (a later send reopens it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        return f"Notifier(address={self.address!r}, watchdog_interval={self.watchdog_interval()!r})"


def _sockaddr(address: str) -> str | bytes:
    if address.startswith("@"):
        # Abstract namespace: a leading NUL byte, no trailing NUL, no filesystem entry.
        return b"\0" + address[1:].encode("utf-8")
    return address


def _status_line(text: str) -> str:
    # STATUS is one line; a newline would start a new (bogus) KEY=VALUE field.
    return "STATUS=" + " ".join(str(text).split())


def _parse_positive_int(value: str | None, name: str) -> int | None:
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value)
    except ValueError:
        log.warning("%s=%r is not an integer; ignoring it", name, value)
        return None
    if number <= 0:
        log.warning("%s=%r is not positive; ignoring it", name, value)
        return None
    return number
