"""The embedding models of [[models]]: each checked at start, its worker started with the daemon or at its first
request (engine/entry_models.py loads and unloads it), and its requests sent to that worker, which takes their inputs
in turn (syshax_llamacpp/embedding.py). The scheduler never sees them (they generate nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.entry_models import EntryModel, EntryModels, ModelsError, Room
from syshaxd.engine.numa import plan_prefill_worker
from syshaxd.engine.status import EmbeddingModelStatus
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.model_entries import CHAT_ONLY_KEYS, ModelEntry
from syshaxd.sdk.placement import PlacementError, parse_cpulist
from syshaxd.sdk.types import Embedded, EmbedRequest, EngineSpec, Pool, Rejected, Role, WorkerLost

log = logging.getLogger(__name__)

DEFAULT_N_CTX = 2048  # tokens an input may hold where the entry does not say (at most the model's own)
HandleFactory = Callable[[str, EngineSpec], WorkerHandle]  # a worker's handle from its name and spec
CLIENT_CHECK = 0.5  # seconds between looks at whether a waiting request's client is still there
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


@dataclass(frozen=True)
class EmbeddingFile:
    """What the daemon reads of an entry's GGUF before any worker loads it."""

    arch: str
    n_embd: int
    n_ctx_train: int
    pooling: str  # mean, cls, last; rank: a reranker

    @property
    def reranker(self) -> bool:
        """A model that scores a query and a document together (POST /v1/rerank), not one that makes vectors."""
        return self.pooling == "rank"


def file_pooling(meta: dict, tensors: list, path: Path, where: str) -> int:
    """A GGUF's pooling as this daemon serves it (`meta`, `tensors`: read_gguf_header's): the header's pooling type;
    4 (rank) for a cross-encoder, a classifier of one output with no pooling type (bge-reranker, jina-reranker, as
    llama.cpp's converter writes them: with that one label, or before mid-2025 with the classifier's tensor and no
    label), which llama-server's --reranking serves with rank pooling; 0 for none (a model that generates text).
    ModelsError for a classifier of several outputs, which is neither."""
    arch = str(meta.get("general.architecture", ""))
    pooling = int(meta.get(f"{arch}.pooling_type", 0) or 0)
    if pooling:
        return pooling
    labels = meta.get(f"{arch}.classifier.output_labels") or []
    if len(labels) > 1:
        raise ModelsError(f"{where}: {path.name} is a classifier of {len(labels)} outputs ({', '.join(labels)}), "
                          "not a reranker (one output) or an embedding model (a pooling type); it is not served")
    return 4 if labels or any(t[0] == "cls.output.weight" for t in tensors) else 0


def embedding_file(meta: dict, tensors: list, path: Path, where: str) -> EmbeddingFile:
    """The embedding model or reranker in a GGUF's header (read_gguf_header's `meta` and `tensors`), or ModelsError
    saying why it is none this daemon serves."""
    arch = str(meta.get("general.architecture", ""))
    pooling = file_pooling(meta, tensors, path, where)
    if pooling not in POOLING_NAMES:
        raise ModelsError(f"{where}: {path.name} has pooling type {pooling}, which this llama.cpp does not know; "
                          "mean, CLS and last-token embedding models and rerankers (rank) serve")
    return EmbeddingFile(arch, int(meta.get(f"{arch}.embedding_length", 0)),
                         int(meta.get(f"{arch}.context_length", 0)), POOLING_NAMES[pooling])


class EmbeddingModel(EntryModel):
    """An embedding entry: its file, its worker (absent while unloaded), and what it has served."""

    kind = "embedding"

    def __init__(self, entry: ModelEntry, path: Path, file: EmbeddingFile, spec: EngineSpec) -> None:
        super().__init__(entry, path)
        self.file = file
        self.spec = spec
        self.make_handle: HandleFactory | None = None  # the daemon's (bind_workers), before any load
        self.inputs = 0
        self.tokens = 0
        self.refused = 0

    @property
    def kind_name(self) -> str:
        return "reranker" if self.file.reranker else "embedding model"

    def _new_handle(self) -> WorkerHandle:
        if self.make_handle is None:
            raise RuntimeError(f"embedding model {self.name}: no worker factory (bind_workers)")
        return self.make_handle(f"embed-{self.name}", self.spec)

    async def embed(self, request: EmbedRequest, timeout: float, room: Room,
                    client_gone: Callable[[], bool] = lambda: False) -> Embedded | Rejected | None:
        """The request's vectors, or the engine's refusal (an input over the limit, a token id out of range), within
        timeout (request_timeout, the load included); None when the client left first (its inputs are dropped)."""
        deadline = time.monotonic() + timeout
        handle = await self.load(deadline, room)
        assert isinstance(handle, WorkerHandle)
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
            raise EngineUnavailable(f"{self.kind_name} {self.name}'s worker {event.why}; retry the request")
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
                    raise EngineUnavailable(f"{self.kind_name} {self.name} gave no answer within request_timeout")
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
            keep_alive=self.keep_alive, pooling=self.file.pooling, dimensions=self.file.n_embd,
            n_ctx=self.spec.n_ctx, requests=self.requests, inputs=self.inputs, tokens=self.tokens,
            refused=self.refused, loads=self.loads, unloads=self.unloads,
            rss_mib=self.rss_mib(), worker=handle.status() if isinstance(handle, WorkerHandle) else None)


def bind_workers(models: EntryModels, factory: HandleFactory) -> None:
    """How the daemon makes an embedding model's worker handle (log level, restart delay, heartbeat, failures)."""
    for model in models.of_kind("embedding"):
        model.make_handle = factory


async def embed(models: EntryModels, name: str, request: EmbedRequest, timeout: float,
                client_gone: Callable[[], bool] = lambda: False) -> Embedded | Rejected | None:
    """The vectors of `request` from the embedding model `name`, loading it first where it is not."""
    model = models[name]
    assert isinstance(model, EmbeddingModel)
    return await model.embed(request, timeout, models.make_room, client_gone)


def plan_embedding(entry: ModelEntry, where: str, path: Path, meta: dict, tensors: list, backend: str,
                   repack: str, topology) -> EmbeddingModel:
    """An embedding entry (`meta`, `tensors`: its GGUF's header) placed to run on `backend` (the config's cpu_engine);
    ModelsError names what cannot serve."""
    from syshaxd.sdk.plugins import BackendNotFound, find_backend, make_plugin_manager

    try:
        roles = find_backend(make_plugin_manager(), backend).roles
    except BackendNotFound as exc:
        raise ModelsError(f"{where}: {exc}") from None
    if Role.EMBED not in roles:
        raise ModelsError(f"{where}: the cpu_engine backend {backend!r} serves no embedding models (its roles: "
                          f"{', '.join(sorted(roles))}); use cpu_engine = \"llamacpp\"")
    chat_keys = [k for k in CHAT_ONLY_KEYS if getattr(entry, k) != getattr(ModelEntry("", ""), k)]
    if chat_keys:
        raise ModelsError(f"{where}: {', '.join(chat_keys)} set on an embedding model; an embedding model is "
                          "loaded as its file is, one input a pass (those keys are for chat models)")
    file = embedding_file(meta, tensors, path, where)
    try:
        cpus = parse_cpulist(entry.cpu_affinity, what=f"{where}.cpu_affinity") if entry.cpu_affinity \
            else topology.cpus
        placement = plan_prefill_worker(topology, cpus, threads=entry.threads or None)
    except PlacementError as exc:
        raise ModelsError(f"{where}: {exc}") from None
    # one pass holds a whole input of n_ctx tokens (syshax_llamacpp/embedding.py), its KV and its activations: a
    # long-context model gets DEFAULT_N_CTX unless its entry asks for more
    n_ctx = entry.n_ctx or min(file.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX)
    if file.n_ctx_train:
        n_ctx = min(n_ctx, file.n_ctx_train)
    spec = EngineSpec(backend=backend, role=Role.EMBED, pool=Pool.EMBED, model_path=str(path),
                      model_name=entry.name, n_ctx=n_ctx, max_batch_size=1, threads=placement.threads,
                      placement=replace(placement, role="embed"), repack=repack, pooling=file.pooling)
    log.info("%s %s: %s (%s, %d dimensions, %s pooling, %d tokens an input, %d threads, load %s)",
             "reranker" if file.reranker else "embedding model", entry.name, path.name, file.arch, file.n_embd,
             file.pooling, n_ctx, placement.threads, entry.load)
    return EmbeddingModel(entry, path, file, spec)
