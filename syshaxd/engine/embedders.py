"""The embedding models of [[models]]: each checked at start, its worker started with the daemon or at its first
request, and its requests sent to that worker, which takes their inputs in turn (syshax_llamacpp/embedding.py).

The one owner of the embedding workers: the scheduler never sees them (they generate nothing), the status, /health
and /v1/models read them here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from syshaxd.engine.lifecycle import HandleState
from syshaxd.engine.numa import plan_prefill_worker, read_host_topology
from syshaxd.engine.status import EmbeddingModelStatus
from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle
from syshaxd.model_entries import ModelEntry
from syshaxd.sdk.gguf.header import GGUFError, read_gguf_header
from syshaxd.sdk.placement import PlacementError, parse_cpulist
from syshaxd.sdk.types import Embedded, EmbedRequest, EngineSpec, Pool, Rejected, Role, WorkerLost

log = logging.getLogger(__name__)

DEFAULT_N_CTX = 2048  # tokens an input may hold where the entry does not say (at most the model's own)
HandleFactory = Callable[[str, EngineSpec], WorkerHandle]  # a worker's handle from its name and spec
CLIENT_CHECK = 0.5  # seconds between looks at whether a waiting request's client is still there
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


class EmbeddersError(ValueError):
    """A [[models]] entry cannot be served; the message names it and what to do."""


@dataclass(frozen=True)
class EmbeddingFile:
    """What the daemon reads of an entry's GGUF before any worker loads it."""

    arch: str
    n_embd: int
    n_ctx_train: int
    pooling: str  # mean, cls, last


def read_embedding_file(path: Path, where: str) -> EmbeddingFile:
    """The entry's file, or EmbeddersError saying why it is no embedding model this daemon serves."""
    if not path.is_file():
        raise EmbeddersError(f"{where}: {path} does not exist; set path to a GGUF file of an embedding model")
    try:
        meta, _ = read_gguf_header(path)
    except (GGUFError, OSError) as exc:
        raise EmbeddersError(f"{where}: {path} is not a GGUF file llama.cpp reads ({exc})") from None
    arch = str(meta.get("general.architecture", ""))
    pooling = int(meta.get(f"{arch}.pooling_type", 0) or 0)
    if pooling == 0:
        raise EmbeddersError(f"{where}: {path.name} is a chat model ({arch}, no pooling type), not an embedding "
                             "model. One daemon serves one chat model (the model key) beside embedding models; "
                             "serve this one with a second syshaxd")
    if pooling not in (1, 2, 3):
        raise EmbeddersError(f"{where}: {path.name} pools its tokens as {POOLING_NAMES.get(pooling, pooling)} (a "
                             "reranker's), not into a vector; only mean, CLS and last-token embedding models serve")
    return EmbeddingFile(arch, int(meta.get(f"{arch}.embedding_length", 0)),
                         int(meta.get(f"{arch}.context_length", 0)), POOLING_NAMES[pooling])


class EmbeddingModel:
    """One entry: its file, its worker (absent while unloaded), and what it has served.

    Loaded with the daemon (load = "start") or at its first request; unloaded when idle past its keep_alive, to
    make room under max_loaded_models, or when asked (`syshax models unload`), once the requests using it are
    done. A request for an unloaded model loads it again."""

    def __init__(self, entry: ModelEntry, path: Path, file: EmbeddingFile, spec: EngineSpec) -> None:
        self.entry = entry
        self.path = path
        self.file = file
        self.spec = spec
        self.make_handle: HandleFactory | None = None  # the daemon's (Embedders.bind), before any load
        self.handle: WorkerHandle | None = None
        self.active = 0  # requests using the loaded worker now: an unload waits for them
        self.waiting = 0  # requests (or loads asked for) waiting for the worker to be ready: it is not idle
        self.last_used = time.monotonic()  # its last request's end, or its last load
        self.unloaded = False  # it was loaded and then unloaded (it loads again when asked)
        self._changing = asyncio.Lock()  # one load or unload at a time
        self.requests = 0
        self.inputs = 0
        self.tokens = 0
        self.refused = 0
        self.loads = 0
        self.unloads = 0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def state(self) -> str:
        return str(self.handle.state) if self.handle is not None else "unloaded"

    @property
    def busy(self) -> bool:
        """In use, asked for, or still loading: never unloaded to make room."""
        return bool(self.active or self.waiting) or self.state != HandleState.READY

    def start(self) -> None:
        if self.handle is None:
            if self.make_handle is None:
                raise RuntimeError(f"embedding model {self.name}: no worker factory (Embedders.bind)")
            self.handle = self.make_handle(f"embed-{self.name}", self.spec)
            self.handle.start()
            self.loads += 1
            self.unloaded = False

    async def load(self, deadline: float, room: Callable[[EmbeddingModel, float], Awaitable[None]]) -> WorkerHandle:
        """The loaded worker, loading it first where it is not (room(self, deadline) unloads others to make room),
        by the deadline (time.monotonic()); EngineUnavailable if it cannot be."""
        self.waiting += 1
        try:
            while True:
                async with self._changing:
                    if self.handle is None:
                        await room(self, deadline)
                        log.info("embedding model %s: loading (%s)", self.name,
                                 "on its first request" if not self.loads else "asked for again after its unload")
                        self.start()
                    handle = self.handle
                assert handle is not None
                await self._ready(handle, deadline)
                if self.handle is handle:  # not unloaded while it loaded
                    self.last_used = time.monotonic()  # keep_alive counts from here, not from an older use
                    return handle
        finally:
            self.waiting -= 1

    async def _ready(self, handle: WorkerHandle, deadline: float) -> None:
        while handle.state != HandleState.READY and self.handle is handle:
            if handle.state == HandleState.FAILED:
                raise EngineUnavailable(f"embedding model {self.name} failed to load: {handle.error}", final=True)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(f"embedding model {self.name} is still {handle.state}; retry shortly")
            try:
                await asyncio.wait_for(handle.ready.wait(), min(left, 0.25))
            except asyncio.TimeoutError:
                pass

    async def unload(self, why: str) -> bool:
        """Stop the worker once the requests using it are done, giving its memory back; False if not loaded."""
        async with self._changing:
            handle = self.handle
            if handle is None:
                return False
            while self.active:
                await asyncio.sleep(0.05)
            rss = _rss_mib(handle.pid)
            self.handle = None
            self.unloaded = True
            self.unloads += 1
            await handle.stop()
            log.info("embedding model %s: unloaded (%s); its worker's %d MiB given back", self.name, why, rss)
            return True

    def idle_for(self, now: float) -> float | None:
        """Seconds it has been ready and unused; None while unloaded, loading, asked for or in use."""
        if self.handle is None or self.busy:
            return None
        return now - self.last_used

    async def embed(self, request: EmbedRequest, timeout: float,
                    room: Callable[[EmbeddingModel, float], Awaitable[None]],
                    client_gone: Callable[[], bool] = lambda: False) -> Embedded | Rejected | None:
        """The request's vectors, or the engine's refusal (an input over the limit, a token id out of range), within
        timeout (request_timeout, the load included); None when the client left first (its inputs are dropped)."""
        deadline = time.monotonic() + timeout
        handle = await self.load(deadline, room)
        self.active += 1  # no await since load() returned: an unload waits for this request
        try:
            stream = handle.embed(request)
            event = await self._answer(stream, deadline, client_gone)
        finally:
            self.active -= 1
            self.last_used = time.monotonic()
        if event is None:
            return None
        if isinstance(event, WorkerLost):
            raise EngineUnavailable(f"embedding model {self.name}'s worker {event.why}; retry the request")
        self.requests += 1
        if isinstance(event, Embedded):
            self.inputs += len(event.vectors)
            self.tokens += event.n_tokens
        else:
            self.refused += 1
        return event

    async def _answer(self, stream, deadline: float, client_gone: Callable[[], bool]):
        """The stream's one event, looking every CLIENT_CHECK seconds whether the client is still there."""
        waiting = asyncio.ensure_future(stream.next_event())
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    stream.cancel()
                    raise EngineUnavailable(f"embedding model {self.name} gave no vectors within request_timeout")
                done, _ = await asyncio.wait({waiting}, timeout=min(left, CLIENT_CHECK))
                if done:
                    return waiting.result()
                if client_gone():
                    log.info("%s: client left; its inputs are dropped", stream.request_id)
                    stream.cancel()
                    return None
        except asyncio.CancelledError:
            stream.cancel()
            raise
        finally:
            waiting.cancel()

    def status(self) -> EmbeddingModelStatus:
        handle = self.handle
        return EmbeddingModelStatus(
            name=self.name, file=self.path.name, state=self.state, load=self.entry.load,
            keep_alive=self.entry.keep_alive, pooling=self.file.pooling, dimensions=self.file.n_embd,
            n_ctx=self.spec.n_ctx, requests=self.requests, inputs=self.inputs, tokens=self.tokens,
            refused=self.refused, loads=self.loads, unloads=self.unloads,
            rss_mib=_rss_mib(handle.pid) if handle is not None else 0,
            worker=handle.status() if handle is not None else None)


def _rss_mib(pid: int | None) -> int:
    """A worker's resident memory in MiB (0 when it has no process)."""
    if pid is None:
        return 0
    try:
        return psutil.Process(pid).memory_info().rss >> 20
    except psutil.Error:
        return 0


class Embedders:
    """Every embedding model of the config, by name, and the bound on how many are loaded at once."""

    def __init__(self, models: list[EmbeddingModel], max_loaded: int = 0) -> None:
        self.models = {m.name: m for m in models}
        self.max_loaded = max_loaded  # 0: no bound

    def __contains__(self, name: str) -> bool:
        return name in self.models

    def __getitem__(self, name: str) -> EmbeddingModel:
        return self.models[name]

    def bind(self, factory: HandleFactory) -> None:
        """How the daemon makes a model's worker handle (its log level, restart delay, heartbeat, failure report)."""
        for model in self.models.values():
            model.make_handle = factory

    @property
    def handles(self) -> list[WorkerHandle]:
        return [m.handle for m in self.models.values() if m.handle is not None]

    def start(self) -> None:
        """Load the models that load with the daemon (the first max_loaded_models of them, where that is set)."""
        for model in [m for m in self.models.values() if m.entry.load == "start"][:self.max_loaded or None]:
            model.start()

    def is_ready(self) -> bool:
        """Every model that loads with the daemon has been ready: a reload later (keep_alive, make room) does not
        take the daemon out of a load balancer, and an on-demand one loads when asked."""
        return all(m.state == HandleState.READY or m.loads > 1 or m.unloaded or (self.max_loaded and m.handle is None)
                   for m in self.models.values() if m.entry.load == "start")

    def loading_line(self) -> str:
        return ", ".join(f"{m.name} {m.state}" for m in self.models.values() if m.entry.load == "start")

    async def embed(self, name: str, request: EmbedRequest, timeout: float,
                    client_gone: Callable[[], bool] = lambda: False) -> Embedded | Rejected | None:
        return await self.models[name].embed(request, timeout, self.make_room, client_gone)

    async def load(self, name: str, timeout: float) -> WorkerHandle:
        return await self.models[name].load(time.monotonic() + timeout, self.make_room)

    async def make_room(self, model: EmbeddingModel, deadline: float) -> None:
        """Under max_loaded_models, unload the least recently used idle model until `model` fits; EngineUnavailable
        when every loaded one stays busy until the deadline. (A model makes room only while it is not loaded, and
        unloads only loaded ones, so two loads never wait on each other.)"""
        while self.max_loaded:
            loaded = [m for m in self.models.values() if m.handle is not None and m is not model]
            if len(loaded) < self.max_loaded:
                return
            idle = sorted((m for m in loaded if not m.busy), key=lambda m: m.last_used)
            if idle:
                await idle[0].unload(f"to make room for {model.name} (max_loaded_models = {self.max_loaded})")
                continue
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"embedding model {model.name} cannot load: the {self.max_loaded} models "
                                        "loaded (max_loaded_models) all stay busy; retry shortly")
            await asyncio.sleep(0.1)

    async def unload_idle(self, every: float = 0.5) -> None:
        """Run while the daemon serves: unload each model idle past its keep_alive (-1: never; 0: once its requests
        are done)."""
        while True:
            now = time.monotonic()
            for model in self.models.values():
                keep, idle = model.entry.keep_alive, model.idle_for(now)
                if keep < 0 or idle is None or idle < keep:
                    continue
                try:
                    await model.unload(f"idle for {idle:.0f}s, keep_alive {keep:g}s")
                except Exception:  # one model's failed stop must not end keep_alive for every model
                    log.exception("embedding model %s: the unload after keep_alive failed", model.name)
            await asyncio.sleep(every)

    async def stop(self) -> None:
        await asyncio.gather(*(h.stop() for h in self.handles))

    def status(self) -> list[EmbeddingModelStatus]:
        return [m.status() for m in self.models.values()]


def plan_embedders(entries: tuple[ModelEntry, ...], chat_model: str, backend: str, repack: str,
                   max_loaded: int = 0) -> Embedders:
    """The embedding models of `entries`, each read and placed, to run on `backend` (the config's cpu_engine);
    EmbeddersError names an entry that cannot serve. The daemon binds how their workers' handles are made."""
    models: list[EmbeddingModel] = []
    if not entries:
        return Embedders(models, max_loaded)
    from syshaxd.sdk.plugins import BackendNotFound, find_backend, make_plugin_manager

    try:
        roles = find_backend(make_plugin_manager(), backend).roles
    except BackendNotFound as exc:
        raise EmbeddersError(f"models: {exc}") from None
    if Role.EMBED not in roles:
        raise EmbeddersError(f"models: the cpu_engine backend {backend!r} serves no embedding models (its roles: "
                             f"{', '.join(sorted(roles))}); use cpu_engine = \"llamacpp\"")
    topology = read_host_topology()
    for i, entry in enumerate(entries):
        where = f"models[{i}] ({entry.name})"
        if entry.name == chat_model:
            raise EmbeddersError(f"{where}: the chat model is served as {chat_model!r}; give the embedding model "
                                 "another name")
        path = Path(entry.path).expanduser()
        file = read_embedding_file(path, where)
        try:
            cpus = parse_cpulist(entry.cpu_affinity, what=f"{where}.cpu_affinity") if entry.cpu_affinity \
                else topology.cpus
            placement = plan_prefill_worker(topology, cpus, threads=entry.threads or None)
        except PlacementError as exc:
            raise EmbeddersError(f"{where}: {exc}") from None
        # one pass holds a whole input of n_ctx tokens (syshax_llamacpp/embedding.py), its KV and its activations: a
        # long-context model gets DEFAULT_N_CTX unless its entry asks for more
        n_ctx = entry.n_ctx or min(file.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX)
        if file.n_ctx_train:
            n_ctx = min(n_ctx, file.n_ctx_train)
        spec = EngineSpec(backend=backend, role=Role.EMBED, pool=Pool.EMBED, model_path=str(path),
                          model_name=entry.name, n_ctx=n_ctx, max_batch_size=1, threads=placement.threads,
                          placement=replace(placement, role="embed"), repack=repack)
        models.append(EmbeddingModel(entry, path, file, spec))
        log.info("embedding model %s: %s (%s, %d dimensions, %s pooling, %d tokens an input, %d threads, load %s)",
                 entry.name, path.name, file.arch, file.n_embd, file.pooling, n_ctx, placement.threads, entry.load)
    return Embedders(models, max_loaded)
