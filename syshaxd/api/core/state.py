"""The daemon's live state, shared by the HTTP routes, the admin socket and the signal handlers.

One object holds what can change while syshaxd runs: whether it takes new
requests (draining), how many HTTP generations are in progress, and the live
configuration. The scheduler's ``config`` is the one current Config: this
object reads it from there and replaces it there (``Config.replace``), so the
routes, the scheduler and the admin socket never disagree about a value.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from syshaxd.config import KEYS, LIVE_KEYS, MODES, Config, ConfigError, coerce, flat_keys_warning, plain, shown
from syshaxd.routing_rules import RuleError, check_served

log = logging.getLogger(__name__)

class Draining(RuntimeError):
    """The daemon takes no new requests (shutting down, or `syshax drain`); the client should go elsewhere."""


class ModeUnavailable(ValueError):
    """The running daemon cannot serve the requested mode; the message says why and what to do."""


class NeedsRestart(ValueError):
    """A key that only takes effect when syshaxd starts."""


@dataclass
class ConfigChange:
    """What a reload or a `config set` did: keys applied now, and keys that wait for a restart."""

    applied: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    restart: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if not self.applied and not self.restart:
            return "no keys changed"
        parts = []
        if self.applied:
            parts.append("applied " + ", ".join(_changed(k, o, n) for k, (o, n) in self.applied.items()))
        if self.restart:
            parts.append("need a restart to apply: " + ", ".join(_changed(k, o, n) for k, (o, n) in self.restart.items()))
        return "; ".join(parts + self.notes)


def _changed(key: str, old: Any, new: Any) -> str:
    """One key's change for a log line: its values, or for a list of named tables (routing_rules, [[models]]) how
    many there are and which were added, changed or removed, by name (the whole tables would fill the line)."""
    if key not in ("routing_rules", "models"):
        return f"{key} {shown(key, old)} -> {shown(key, new)}"
    before = {str(t.get("name", i)): t for i, t in enumerate(plain(key, old))}
    after = {str(t.get("name", i)): t for i, t in enumerate(plain(key, new))}
    what = [f"{verb} {', '.join(repr(n) for n in names)}" for verb, names in (
        ("added", [n for n in after if n not in before]),
        ("changed", [n for n in after if n in before and after[n] != before[n]]),
        ("removed", [n for n in before if n not in after])) if names]
    return f"{key} {len(before)} -> {len(after)}" + (f" ({'; '.join(what)})" if what else "")


class ServiceState:
    def __init__(self, scheduler, reload: Callable[[], Config] | None = None) -> None:
        self.scheduler = scheduler
        self._reload = reload  # re-reads the config file with the command line's overrides
        self.draining = False
        self.drain_reason = ""
        self.active = 0  # HTTP generation requests taken and not finished
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def config(self) -> Config:
        return self.scheduler.config

    # --- requests in progress, and the drain ----------------------------------------------

    @contextmanager
    def one_request(self):
        """Count one request in progress for the block (a drain waits for it); raises Draining when no new
        requests are taken."""
        if self.draining:
            raise Draining(self.drain_reason or "draining")
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def drain(self, reason: str) -> None:
        if not self.draining:
            log.info("draining (%s): new requests get 503; %d in progress may finish", reason, self.active)
        self.draining = True
        self.drain_reason = reason

    def resume(self) -> None:
        if self.draining:
            log.info("resumed: taking new requests again")
        self.draining = False
        self.drain_reason = ""

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in progress; False if some still run after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return self.active == 0

    # --- live configuration ---------------------------------------------------------------

    def value(self, key: str) -> Any:
        if key not in KEYS:
            coerce(key, "")  # raises the unknown-key error, which lists the known keys
        return getattr(self.config, key)

    def check(self, key: str, value: Any) -> tuple[Any, Config]:
        """The value as the key's type, and the config it would make; raises ConfigError if invalid."""
        if isinstance(value, str):
            value = coerce(key, value)
        elif key not in KEYS:
            coerce(key, "")
        candidate = self.config.replace(**{key: value})
        return getattr(candidate, key), candidate

    def set(self, key: str, value: Any) -> ConfigChange:
        """Apply one key on the running daemon; raises ConfigError, NeedsRestart or ModeUnavailable."""
        value, candidate = self.check(key, value)
        if key == "mode":
            return self.set_mode(value)
        if key not in LIVE_KEYS:
            raise NeedsRestart(
                f"{key} cannot change while syshaxd runs (keys that can: {', '.join(sorted(LIVE_KEYS))}, mode); "
                "save it to the config file (syshax config set KEY VALUE --save) and restart syshaxd")
        return self._apply(candidate, [key])

    def reload(self) -> ConfigChange:
        """Re-read the config file (SIGHUP); apply the live keys. Raises ConfigError and changes nothing if bad."""
        if self._reload is None:
            raise ConfigError("this daemon has no config file to reload")
        new = self._reload()
        change = self._apply(new, [k for k in KEYS if k != "mode"])
        if flat_keys_warning(new):  # the file may have gained top-level keys since the start said so
            log.warning("SIGHUP: %s", flat_keys_warning(new))
        if new.mode != self.config.mode:
            try:
                change.applied.update(self.set_mode(new.mode).applied)
            except ModeUnavailable as exc:
                change.restart["mode"] = (self.config.mode, new.mode)
                change.notes.append(f"mode: {exc}")
        return change

    def _apply(self, new: Config, keys) -> ConfigChange:
        old = self.config
        change = ConfigChange()
        for key in keys:
            before, after = getattr(old, key), getattr(new, key)
            if before != after:
                (change.applied if key in LIVE_KEYS else change.restart)[key] = (before, after)
        if "routing_rules" in change.applied:
            try:  # a rule on a model this daemon does not serve could never match
                check_served(new.routing_rules, self.scheduler.model_name,
                             tuple(m.name for m in self.scheduler.entries.of_kind("chat")))
            except RuleError as exc:
                raise ConfigError(str(exc)) from None
        if change.applied:
            self.scheduler.config = old.replace(**{k: n for k, (_, n) in change.applied.items()})
            self.scheduler.entries.reconfigure(self.scheduler.config)  # the chat models' daemons take them too
        if "log_level" in change.applied:
            level = change.applied["log_level"][1]
            logging.getLogger().setLevel(level.upper())
            for worker in self.scheduler.workers:  # engine workers take it when they next (re)start
                worker.set_log_level(level)
        return change

    # --- mode -----------------------------------------------------------------------------

    def servable_modes(self) -> dict[str, str]:
        """Each mode, and why this running daemon cannot serve it ("" when it can)."""
        return self.scheduler.servable_modes()

    def set_mode(self, mode: str) -> ConfigChange:
        """Switch where new requests run; raises ModeUnavailable with the reason when this daemon cannot."""
        if mode not in MODES:
            raise ConfigError(f"mode: must be one of {', '.join(MODES)}; got {mode!r}")
        old = self.config.mode
        change = ConfigChange()
        if mode == old:
            return change
        try:
            self.scheduler.set_mode(mode)  # the scheduler knows what it can route
        except ValueError as exc:
            raise ModeUnavailable(str(exc)) from None
        log.info("mode %s -> %s", old, mode)
        change.applied["mode"] = (old, mode)
        return change
