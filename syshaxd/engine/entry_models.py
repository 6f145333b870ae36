"""The models of [[models]], loaded with the daemon or at their first request and unloaded when idle: what an
embedding model (engine/embedders.py: a worker of this daemon) and a chat model (engine/chat_models.py: a syshaxd of
its own) share, and their one owner, which keeps at most max_loaded_models models loaded, the daemon's own model
(always loaded) counted among them, as Ollama's OLLAMA_MAX_LOADED_MODELS and llama-server's --models-max count every
model.

The daemon's own chat model (the `model` key) is not among them: it stays loaded while the daemon runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.lifecycle import HandleState
from syshaxd.model_entries import ModelEntry

log = logging.getLogger(__name__)

RESTART_DELAYS = (1.0, 5.0, 30.0)  # seconds before a model started with the daemon is started again by itself
QUICK_DEATH = 60.0  # a daemon that served less than this before it died is restarted after the next, longer delay
QUICK_DEATHS = 3  # ... and after this many such deaths in a row, not by itself again (a load by hand or a request)


class ModelsError(ValueError):
    """A [[models]] entry cannot be served; the message names it and what to do."""


class Loaded(Protocol):
    """What runs a loaded entry: a worker (WorkerHandle) or a child daemon (chat_models.ChildDaemon)."""

    name: str
    state: HandleState
    error: str
    ready: asyncio.Event
    remote: bool

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


Room = Callable[["EntryModel", float], Awaitable[None]]  # unloads others until this one fits, by the deadline


class EntryModel:
    """One entry: what runs it (absent while unloaded), and whether it is in use.

    Loaded with the daemon (load = "start") or at its first request; unloaded when idle past its keep_alive, to
    make room under max_loaded_models, or when asked (`syshax models unload`), once the requests using it are
    done. A request for an unloaded model loads it again."""

    kind = ""  # "embedding" or "chat": how logs, errors and /v1/models name it

    def __init__(self, entry: ModelEntry, path: Path) -> None:
        self.entry = entry
        self.path = path
        self.handle: Loaded | None = None
        self.active = 0  # requests using the loaded model now: an unload waits for them
        self.waiting = 0  # requests (or loads asked for) waiting for it to be ready: it is not idle
        self.last_used = time.monotonic()  # its last request's end, or its last load
        self.unloaded = False  # it was loaded and then unloaded (it loads again when asked)
        self.keep_alive_asked: float | None = None  # a request's keep_alive (Ollama's field), until the unload
        self._changing = asyncio.Lock()  # one load or unload at a time
        self.requests = 0
        self.loads = 0
        self.unloads = 0
        self.quick_deaths = 0  # deaths in a row, each within QUICK_DEATH seconds of serving (restart_delay)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def kind_name(self) -> str:
        """What logs and errors call it: "chat model", "embedding model" (a reranker says so: embedders.py)."""
        return f"{self.kind} model"

    @property
    def keep_alive(self) -> float:
        """Seconds idle before it is unloaded (-1: never): its last request's keep_alive, else its entry's."""
        return self.entry.keep_alive if self.keep_alive_asked is None else self.keep_alive_asked

    @property
    def state(self) -> str:
        return str(self.handle.state) if self.handle is not None else "unloaded"

    @property
    def busy(self) -> bool:
        """In use, asked for, or still loading: never unloaded to make room (a failed one is)."""
        return bool(self.active or self.waiting) or self.state not in (HandleState.READY, HandleState.FAILED)

    def served_once(self) -> bool:
        """Whether what runs it now was ready once (a child daemon that died since is started again on demand)."""
        return False

    def _new_handle(self) -> Loaded:
        raise NotImplementedError

    def status(self) -> Any:
        raise NotImplementedError

    def start(self) -> None:
        if self.handle is None:
            self.handle = self._new_handle()
            self.handle.start()
            self.loads += 1
            self.unloaded = False

    def _restartable(self, handle: Loaded) -> bool:
        """Whether a failed `handle` is dropped and started again by the next request (a child daemon that died)."""
        return False

    def needs_restart(self) -> bool:
        """What runs it died after serving and nothing has started it again yet (a deliberate unload or stop is not
        this: it leaves no handle, or a stopped one)."""
        return (self.handle is not None and self.handle.state == HandleState.FAILED
                and self._restartable(self.handle))

    def served_for(self) -> float | None:
        """Seconds what runs it served before it died (None: unknown)."""
        return None

    def restart_delay(self, served_for: float | None) -> float | None:
        """Seconds to wait before starting it again by itself, after it served `served_for` seconds and died:
        RESTART_DELAYS[n] for the n-th death in a row that came within QUICK_DEATH seconds of serving; None once
        QUICK_DEATHS such deaths came in a row (a daemon that dies at each start is not restarted in a loop)."""
        quick = served_for is not None and served_for < QUICK_DEATH
        self.quick_deaths = self.quick_deaths + 1 if quick else 0
        if self.quick_deaths >= QUICK_DEATHS:
            return None
        return RESTART_DELAYS[min(self.quick_deaths, len(RESTART_DELAYS) - 1)]

    async def restart(self, deadline: float, room: Room, stopping: Callable[[], bool]) -> None:
        """Start it again now that what ran it died, under its lock: nothing happens if it no longer needs it (a
        request started it, it was unloaded) or the daemon stops. It does not wait for the new one to be ready: an
        unload meanwhile stops it, and one that never gets ready stays failed (needs_restart() is then False)."""
        async with self._changing:
            if stopping() or not self.needs_restart():
                return
            old, self.handle = self.handle, None  # not loaded while it makes room: no other load unloads it
            assert old is not None
            await asyncio.shield(old.stop())
            await room(self, deadline)
            if stopping():
                return
            log.info("%s %s: loading (started again by itself)", self.kind_name, self.name)
            self.start()

    async def load(self, deadline: float, room: Room, retry: bool = False) -> Loaded:
        """What runs the model, loading it first where it is not (room(self, deadline) unloads others to make room),
        by the deadline (time.monotonic()); EngineUnavailable if it cannot be. `retry`: a model that failed to load
        is loaded again (a load asked for by hand) instead of refused."""
        self.waiting += 1
        try:
            while True:
                try:  # an unload waiting for a request in use holds the lock: wait for it within the deadline
                    await asyncio.wait_for(self._changing.acquire(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise EngineUnavailable(f"{self.kind_name} {self.name} is being unloaded; retry shortly") from None
                try:
                    if self.handle is not None and (self._restartable(self.handle) or (
                            retry and self.handle.state == HandleState.FAILED)):
                        old, self.handle = self.handle, None
                        await asyncio.shield(old.stop())  # to its end, even when the request waiting leaves
                    if self.handle is None:
                        await room(self, deadline)
                        log.info("%s %s: loading (%s)", self.kind_name, self.name,
                                 "on its first request" if not self.loads else "asked for again")
                        self.start()
                    handle = self.handle
                finally:
                    self._changing.release()
                assert handle is not None
                await self._ready(handle, deadline)
                if self.handle is handle:  # not unloaded while it loaded
                    self.last_used = time.monotonic()  # keep_alive counts from here, not from an older use
                    return handle
        finally:
            self.waiting -= 1

    async def _ready(self, handle: Loaded, deadline: float) -> None:
        while handle.state != HandleState.READY and self.handle is handle:
            if handle.state == HandleState.FAILED:
                raise EngineUnavailable(f"{self.kind_name} {self.name} failed to load: {handle.error}", final=True)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(f"{self.kind_name} {self.name} is still {handle.state}; retry shortly")
            try:
                await asyncio.wait_for(handle.ready.wait(), min(left, 0.25))
            except asyncio.TimeoutError:
                pass

    async def unload(self, why: str) -> bool:
        """Stop what runs it once the requests using it are done, giving its memory back; False if not loaded."""
        async with self._changing:
            handle = self.handle
            if handle is None:
                return False
            while self.active:
                await asyncio.sleep(0.05)
            rss = self.rss_mib()
            self.handle = None
            self.unloaded = True
            self.unloads += 1
            self.keep_alive_asked = None  # its next load starts from its entry's again
            await handle.stop()
            log.info("%s %s: unloaded (%s); its %d MiB given back", self.kind_name, self.name, why, rss)
            return True

    def idle_for(self, now: float) -> float | None:
        """Seconds it has been ready and unused; None while unloaded, loading, asked for or in use, or failed (a
        failed one stays, its error shown, until it is loaded by hand or makes room for another)."""
        if self.handle is None or self.busy or self.state == HandleState.FAILED:
            return None
        return now - self.last_used

    def rss_mib(self) -> int:
        """The resident memory of its processes (a child daemon's workers too) in MiB; 0 while unloaded."""
        pid = self.handle.pid if self.handle is not None else None
        if pid is None:
            return 0
        try:
            process = psutil.Process(pid)
            return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) >> 20
        except psutil.Error:
            return 0


class EntryModels:
    """Every entry of [[models]], by name, and the bound on how many are loaded at once."""

    def __init__(self, models: list[EntryModel], max_loaded: int = 0) -> None:
        self.models = {m.name: m for m in models}
        self.stopping = False  # the daemon stops: keep_started starts nothing again (set at the stop signal)
        self._restarts: dict[str, asyncio.Future] = {}  # keep_started's restarts under way, by model name
        self.max_loaded = max_loaded  # 0: no bound; else the daemon's own model and the entries loaded together
        self.room: int | None = max_loaded - 1 if max_loaded else None  # entries loaded at once; None: any

    def __contains__(self, name: str) -> bool:
        return name in self.models

    def __getitem__(self, name: str) -> EntryModel:
        return self.models[name]

    def of_kind(self, kind: str) -> list:
        return [m for m in self.models.values() if m.kind == kind]

    @property
    def handles(self) -> list[Loaded]:
        return [m.handle for m in self.models.values() if m.handle is not None]

    def start(self) -> None:
        """Load the models that load with the daemon (the first of them that fit under max_loaded_models)."""
        for model in [m for m in self.models.values() if m.entry.load == "start"][:self.room]:
            model.start()

    def is_ready(self) -> bool:
        """Every model that loads with the daemon has been ready: a reload later (keep_alive, make room) does not
        take the daemon out of a load balancer, and an on-demand one loads when asked."""
        return all(m.state == HandleState.READY or m.served_once() or m.loads > 1 or m.unloaded
                   or (self.room is not None and m.handle is None) for m in self.models.values()
                   if m.entry.load == "start")

    def loading_line(self) -> str:
        return ", ".join(f"{m.name} {m.state}" for m in self.models.values() if m.entry.load == "start")

    async def load(self, name: str, timeout: float) -> Loaded:
        """Load `name` as asked by hand (syshax models load, POST /models/load): a failed one is tried again."""
        return await self.models[name].load(time.monotonic() + timeout, self.make_room, retry=True)

    def status(self) -> list[dict]:
        """Each entry's status as JSON, with its kind ("embedding" or "chat")."""
        return [{"kind": m.kind} | dataclasses.asdict(m.status()) for m in self.models.values()]

    async def make_room(self, model: EntryModel, deadline: float) -> None:
        """Under max_loaded_models, unload the least recently used idle model until `model` fits; EngineUnavailable
        when every loaded one stays busy until the deadline. (A model makes room only while it is not loaded, and
        unloads only loaded ones, so two loads never wait on each other.)"""
        while self.room is not None:
            loaded = [m for m in self.models.values() if m.handle is not None and m is not model]
            if len(loaded) < self.room:
                return
            # a failed one first (it holds a place and serves nothing), then the least recently used
            idle = sorted((m for m in loaded if not m.busy),
                          key=lambda m: (m.state != HandleState.FAILED, m.last_used))
            if idle:  # to its end, even when the request that makes room leaves (its own task, shielded)
                why = f"to make room for {model.name} (max_loaded_models = {self.max_loaded}, the daemon's own model " \
                      "counted)"
                await asyncio.shield(idle[0].unload(why))
                continue
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"{model.kind_name} {model.name} cannot load: the {self.room} models of "
                                        "[[models]] loaded beside the daemon's own (max_loaded_models = "
                                        f"{self.max_loaded}) all stay busy; retry shortly")
            await asyncio.sleep(0.1)

    async def unload_idle(self, every: float = 0.5) -> None:
        """Run while the daemon serves: unload each model idle past its keep_alive (-1: never; 0: once its requests
        are done)."""
        while True:
            now = time.monotonic()
            for model in self.models.values():
                keep, idle = model.keep_alive, model.idle_for(now)
                if keep < 0 or idle is None or idle < keep:
                    continue
                try:
                    await model.unload(f"idle for {idle:.0f}s, keep_alive {keep:g}s")
                except Exception:  # one model's failed stop must not end keep_alive for every model
                    log.exception("%s %s: the unload after keep_alive failed", model.kind_name, model.name)
            await asyncio.sleep(every)

    async def keep_started(self, timeout: float, every: float = 0.5) -> None:
        """Run while the daemon serves: a model loaded with the daemon (load = "start") whose daemon died after
        serving is started again by itself, as the daemon's own workers are, not only at its next request; within
        `timeout` (worker_start_timeout) it makes room. An embedding model's worker is restarted by its supervisor."""
        judged: dict[str, Loaded] = {}  # each model's last dead handle already judged (each death once)
        while not self.stopping:
            for model in self.models.values():
                handle = model.handle
                if (model.entry.load != "start" or handle is None or not model.needs_restart()
                        or judged.get(model.name) is handle or model.name in self._restarts):
                    continue
                judged[model.name] = handle
                served = model.served_for()
                delay = model.restart_delay(served)
                if delay is None:
                    log.error("%s %s: what served it died %d times in a row within %gs of serving; not "
                              "started again by itself: see its lines above, mend the cause, then `syshax models "
                              "load %s` (or its next request loads it)", model.kind_name, model.name, QUICK_DEATHS,
                              QUICK_DEATH, model.name)
                    continue
                log.warning("%s %s: what served it died%s; starting it again in %gs (load = \"start\")",
                            model.kind_name, model.name, f" after serving {served:.0f}s" if served is not None else "",
                            delay)
                task = asyncio.ensure_future(self._restart(model, delay, timeout))
                self._restarts[model.name] = task
                task.add_done_callback(functools.partial(self._restarted, model.name))
            await asyncio.sleep(every)

    def _restarted(self, name: str, _: asyncio.Future) -> None:
        self._restarts.pop(name, None)

    async def _restart(self, model: EntryModel, delay: float, timeout: float) -> None:
        await asyncio.sleep(delay)
        try:
            await model.restart(time.monotonic() + timeout, self.make_room, lambda: self.stopping)
        except EngineUnavailable as exc:
            log.error("%s %s: not started again now: %s; its next request loads it, or `syshax models load "
                      "%s`", model.kind_name, model.name, exc, model.name)

    async def stop(self) -> None:
        self.stopping = True  # keep_started starts nothing again from here on
        restarts = list(self._restarts.values())
        for task in restarts:  # a restart under way ends first: its child, if it started one, is a handle below
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        await asyncio.gather(*(h.stop() for h in self.handles))

    def reconfigure(self, cfg: Any) -> None:
        """The daemon's config changed (SIGHUP, syshax config set): each chat model takes the new keys."""
        for model in self.of_kind("chat"):
            try:
                model.reconfigure(cfg)
            except OSError as exc:  # its folder gone: it takes the keys at its next load
                log.error("chat model %s: its running daemon cannot take the new keys now (%s); it takes them "
                          "when it is next loaded", model.name, exc)
