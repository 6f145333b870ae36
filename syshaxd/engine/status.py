"""What the scheduler reports of itself: one typed object that /v1/syshax/status, `syshax status` and /metrics render."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from syshaxd.engine.decider import EngineState
from syshaxd.engine.exactness import ExactStatus
from syshaxd.engine.kv_ledger import KVStatus, Quantiles
from syshaxd.engine.prefix_cache import PrefixStatus
from syshaxd.sdk.types import EngineStats


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    backend: str
    role: str
    pool: str
    state: str  # a HandleState (engine/lifecycle.py): stopped, starting, warming, ready, restarting, failed, ...
    pid: int | None
    error: str
    restarts: int
    hangs: int  # times it was killed for silence
    in_flight: int
    cpus: list[int]
    threads: int
    stats: EngineStats
    kernels: str = ""  # the CPU kernels its engine runs (llama.cpp: repack, plain, ...); "" where not told
    kernels_why: str = ""
    attention: str = ""  # llama.cpp: "tiled" (every query row's, tiled_attention) or "llama.cpp" (its own)
    # its engine proved at warm-up that a decode step gives a token a prompt chunk's bits (a prefill-only worker:
    # that chunks of any size do): resumes and handoffs between such workers give the undisturbed run's tokens
    exact_decode: bool = False
    # ... and the prefix cache keeps what requests generate there (cpu mode, keep_generated_tokens)
    keeps_generated: bool = False
    # a lone decoding sequence takes a padding row beside it (its warm-up did not prove a lone row gets its bits in a
    # batch): 1 to 2 ms a step
    lone_padding: bool = False
    # speculative decoding: the most tokens a decode step guesses (its warm-up proved a guess's rows exact); 0: off
    speculative_tokens: int = 0
    draft_model: str = ""  # the draft model's file name, where its guesses come from one (config draft_model)
    # MiB of whole states after prompts it keeps for prefix reuse, where the prefix cache's blocks do not carry the
    # model's KV (a recurrent state, sliding-window layers, MLA); 0: none
    state_checkpoints_mb: int = 0


@dataclass(frozen=True)
class NodeDecoderStatus:
    """One decode worker of a remote node, as its node last reported it."""

    name: str
    state: str
    in_flight: int
    max_batch_size: int
    threads: int
    cpus: list[int]
    error: str


@dataclass(frozen=True)
class RemoteNodeStatus:
    """A decode node on another host (remote/front.py): its link, its decoders, and the KV moved to it."""

    address: str
    link: str  # connecting, up, down (unreachable), refused (wrong secret, another model or backend)
    error: str  # why it is not up
    since: float  # time.time() of the link's last change
    decoders: list[NodeDecoderStatus]
    in_flight: int
    transfers: int  # KV records written into its ring
    transfer_failures: int  # records that did not get there (its decoder recomputed the prompt)
    bytes_moved: int
    transfer_seconds: Quantiles  # room asked for + the write, per record
    links_lost: int  # times its link went down
    fronts: int = 0  # fronts the node serves now (this one included)
    slots: int = 0  # what this front may run there at once: the node's decoders' slots, or its share of them


@dataclass(frozen=True)
class EmbeddingModelStatus:
    """An embedding model of [[models]]: its file, whether it is loaded, and what it has served."""

    name: str
    file: str
    state: str  # "unloaded" (load = "on_demand", not asked yet), else its worker's HandleState
    load: str  # "start" or "on_demand"
    keep_alive: float  # seconds idle before it is unloaded; -1: never
    pooling: str  # mean, cls, last
    dimensions: int
    n_ctx: int  # tokens one input may hold
    requests: int
    inputs: int
    tokens: int
    refused: int  # requests its engine refused (an input over n_ctx, a token id outside the vocabulary)
    loads: int  # times its worker was started: at start, on demand, after an unload
    unloads: int  # times it was unloaded (idle past keep_alive, to make room, or asked)
    rss_mib: int  # its worker's resident memory; 0 while unloaded
    worker: WorkerStatus | None


@dataclass(frozen=True)
class ChatModelStatus:
    """A chat model of [[models]]: its file, whether its daemon is loaded, and what it has served."""

    name: str
    file: str
    state: str  # "unloaded", else its daemon's HandleState (starting, ready, failed, stopped)
    load: str  # "start" or "on_demand"
    keep_alive: float  # seconds idle before it is unloaded; -1: never
    mode: str
    n_ctx: int
    requests: int  # requests forwarded to its daemon
    failed_requests: int  # of them, those its daemon could not be reached for (it died, or did not load)
    loads: int
    unloads: int
    rss_mib: int  # its daemon's and its workers' resident memory; 0 while unloaded
    pid: int | None  # its daemon's
    url: str  # its daemon's loopback address, once it serves
    error: str  # why it failed, when it did


@dataclass(frozen=True)
class AutoDecision:
    at: float  # time.time()
    gpu: EngineState  # each pool's load as the decider saw it
    cpu: EngineState
    route: str  # gpu, hetero or refuse
    reason: str
    token_limit: int
    by: str = "thresholds"  # what decided: rule:NAME, measured, thresholds


@dataclass(frozen=True)
class AutoStatus:
    """auto mode's decider: its counts and its last inputs and decision."""

    decisions: dict[str, int]
    queued_for_gpu: int
    reconsidered: int
    moved_to_gpu: int
    move_failed: int
    last: AutoDecision | None
    thresholds: dict[str, float]
    decider: str = "thresholds"  # the config's decider: thresholds (0.2.0's) or measured (v2)
    decided_by: dict[str, int] = dataclasses.field(default_factory=dict)  # rule:NAME, measured, thresholds, ...
    rules: list[str] = dataclasses.field(default_factory=list)  # the routing rules, highest priority first
    rules_matched: dict[str, int] = dataclasses.field(default_factory=dict)
    rules_without_room: dict[str, int] = dataclasses.field(default_factory=dict)  # matched, and the decider decided
    estimates: dict = dataclasses.field(default_factory=dict)  # decider v2's: TPOT by side, TTFT by route, in ms


@dataclass(frozen=True)
class SchedulerStatus:
    mode: str
    modes: dict[str, str]  # each mode: "available", or why this daemon cannot serve it
    ready: bool
    in_flight: int
    queued: int
    capacity: int
    max_queue_size: int
    routes: dict[str, int]
    refused: dict[str, int]
    # requests whose worker died: sent again before their first token, resumed after, or lost (ended with the error)
    rescued: dict[str, int]
    auto: AutoStatus | None
    kv: KVStatus | None
    prefix_cache: PrefixStatus | None
    workers: list[WorkerStatus]
    nodes: list[RemoteNodeStatus] = dataclasses.field(default_factory=list)  # decode nodes on other hosts
    exact: ExactStatus | None = None  # which greedy promises hold here (engine/exactness.py)
    # each pool's engines: those serving (ready) and those out of it now, with why (restarting, failed, a node down)
    pools: dict[str, dict[str, list[str]]] = dataclasses.field(default_factory=dict)
    # a pool of engines with their own prefix caches: requests placed where their prefix was, or by load
    prefix_routing: dict = dataclasses.field(default_factory=dict)
    # the GGUF served: its file type and whether the engines load it as it is or quantized (sdk/gguf/quantize.py)
    model_file: dict = dataclasses.field(default_factory=dict)
    # the embedding models of [[models]] (engine/embedders.py)
    embedding_models: list[EmbeddingModelStatus] = dataclasses.field(default_factory=list)
    # the chat models of [[models]], each served by a daemon of its own (engine/chat_models.py)
    chat_models: list[ChatModelStatus] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "SchedulerStatus":
        """The status from its JSON form (the admin socket's answer); KeyError names a key that is missing."""
        return built(cls, data)


def built(kind, value):
    """`value` (JSON) as `kind`: dataclasses field by field, optional ones None, the rest as they are."""
    if value is None:
        return None
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        return built(kinds[0], value) if len(kinds) == 1 else value
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: built(hints[f.name], value[f.name]) for f in dataclasses.fields(kind)})
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return [built(item, v) for v in value]
    return value
