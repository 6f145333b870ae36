"""The small, picklable messages between the daemon and its engine workers, and the Engine protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from syshaxd.sdk.kv.ring import RingFull
from syshaxd.sdk.placement import Placement


# Five enums say "where" or "what", each of a different thing, and are kept apart: config.Mode is a daemon's (or a
# request's) policy, auto included; Route is where one request ran (a Mode without auto; the decider's answer is a
# Route, or None for "nowhere yet"); Pool is a group of the scheduler's workers; Role is what an engine does with a
# request; backend.Device is the hardware a backend runs on.


class Role(StrEnum):
    """What an engine does with a request (a backend declares the roles it takes)."""

    GENERATE = "generate"  # prefill and decode
    PREFILL = "prefill"  # the prompt alone, its KV handed on through the ring
    DECODE = "decode"  # continues from KV computed elsewhere
    EMBED = "embed"  # an embedding model: a pooled vector per input (Embed), no generation


class Pool(StrEnum):
    """Which of the scheduler's pools a worker serves."""

    CPU = "cpu"  # CPU workers: cpu mode's engines, and the decoders of hetero and auto
    GPU = "gpu"  # the GPU engine of gpu and auto modes
    PREFILL = "prefill"  # hetero mode's prefill worker
    EMBED = "embed"  # an embedding model's worker ([[models]]): /v1/embeddings alone, never the scheduler's


class Route(StrEnum):
    """Where one request ran: a CPU worker alone, the GPU engine alone, or prefill there and decode on a CPU."""

    CPU = "cpu"
    GPU = "gpu"
    HETERO = "hetero"


class Fallback(StrEnum):
    """Why a decoder recomputed a prompt instead of importing its KV record (counted per reason)."""

    RING_FULL = "ring_full"  # the producer found no ring space before handoff_timeout
    EXPORT_FAILED = "export_failed"  # the producer could not write the record
    PREFILL_DIED = "prefill_died"  # the prefill worker died before handing the record on
    PREFILL_FAILED = "prefill_failed"  # it answered something other than a record
    PREFILL_UNAVAILABLE = "prefill_unavailable"  # it was restarting: the request went to a decoder alone
    DECODER_DIED = "decoder_died"  # the decoder that took the record died before its first token
    CHECKSUM = "checksum"  # the record's bytes do not match its checksum
    FINGERPRINT = "fingerprint"  # the record is of another model
    STALE = "stale"  # the ring was reset or the offset reused since the record was reported
    TOKEN_MISMATCH = "token_mismatch"  # the record holds other tokens than the request's prompt
    STATE_FORMAT = "state_format"  # the engine could not take the record's KV into its cache
    NO_RING = "no_ring"  # the decoder has no ring to read from
    TRANSFER_FAILED = "transfer_failed"  # the record did not reach a decode node on another host (remote/)
    CANCELLED = "cancelled"  # not a fallback: the request was cancelled before its record was read

    @classmethod
    def of_export(cls, exc: Exception) -> "Fallback":
        """Why a producer's record was not written, from the ring's error."""
        return cls.RING_FULL if isinstance(exc, RingFull) else cls.EXPORT_FAILED


REPACK_SETTINGS = ("auto", "on", "off")  # the llama.cpp engine's weight repacking (EngineSpec.repack)


@dataclass(frozen=True)
class Proofs:
    """What an engine's warm-up proved of its build on this CPU. The supervisor hands them to the worker's restarts
    (EngineSpec.proven): neither the CPU nor the build changes between them, so a restart's warm-up runs what
    serving runs (its kernels must not crash) but not these comparisons again."""

    # a decode step gives a token the very bits a prompt chunk of any size gives it (every query row's attention
    # tiled): a resume's recompute, a handoff and a prefix hit then give the undisturbed run's tokens
    exact_decode: bool = False
    exact_resume: int = 0  # prompt chunks of this many tokens or more give the same bits wherever they start; 0: not
    pad_lone: bool = True  # a lone decoding sequence needs a padding row to sum its attention as in a batch


@dataclass(frozen=True)
class GpuSettings:
    """The GPU engine's knobs (vLLM), from the config keys of the same names."""

    gpu_memory_utilization: float = 0.8  # of device memory (vLLM's CPU build: sized from n_ctx instead)
    max_num_seqs: int = 16  # sequences the engine runs at once
    tensor_parallel_size: int = 1
    preemption_mode: str = "recompute"
    devices: str = ""  # CUDA_VISIBLE_DEVICES for this engine (config gpu_devices); "": as the daemon has it


@dataclass(frozen=True)
class EngineSpec:
    """Everything a worker needs to build its engine; crosses the process boundary once."""

    backend: str
    role: Role  # generate (prefill and decode), prefill or decode
    model_path: str
    model_name: str
    pool: Pool = Pool.CPU
    n_ctx: int = 4096
    max_batch_size: int = 8
    threads: int = 1
    prefill_chunk_size: int = 256
    placement: Placement | None = None  # applied in the worker before the model loads
    ring: str = ""  # the KV ring's instance name (hetero mode); empty: no ring
    handoff_timeout: float = 2.0  # seconds a prefill may wait for ring space before it falls back
    quantize: str = ""
    cache_dir: str = ""
    gpu: GpuSettings = GpuSettings()  # read by the GPU engines (vLLM) only
    prefix_store: str = ""  # the prefix cache's block store instance (kv/block_store.py); empty: no cache
    # MiB of whole-state checkpoints the worker keeps in its own memory, for a model whose KV the prefix cache's
    # blocks do not carry (a recurrent state, sliding-window layers, MLA: the llama.cpp engine's checkpoints.py); 0: none
    state_checkpoints_mb: int = 0
    # every query row's attention in tiles, a decode step's as a prompt chunk's (config tiled_attention; the llama.cpp
    # engine: SYSHAX_FA_TILED): then every route gives a token the same bits, and the prefix cache can keep generated
    # tokens' KV
    tiled_attention: bool = False
    keep_generated: bool = False  # the daemon's prefix cache keeps what requests generate here (cpu mode)
    proven: Proofs | None = None  # what this worker's earlier warm-up proved (kept by the supervisor); None: prove
    repack: str = "auto"  # the llama.cpp engine's weight repacking: auto, on or off (its kernels.py)
    # an embedding worker's pooling as the daemon read it in the GGUF's header (engine/embedders.file_pooling):
    # "rank" for a reranker, a cross-encoder with no pooling type in its file included; "": the file's own
    pooling: str = ""
    # Fault injection for tests (SYSHAX_FAULT in the daemon's environment; sdk/faults.py): the worker
    # kills itself with SIGSEGV at that point, as a CPU's bad kernels would. Empty in service.
    fault: str = ""
    step_delay: float = 0.0  # seconds the worker sleeps after each engine step (SYSHAX_SLOW, tests only)
    # speculative decoding (config speculative_tokens): the most tokens of a sequence's own context a decode step
    # guesses and checks beside its next one (the llama.cpp engine's drafting.py); 0: off
    speculative_tokens: int = 0
    # a GGUF of a smaller model of the same vocabulary whose greedy tokens are a lone sequence's guesses (config
    # draft_model; draft_model.py); "": prompt lookup's
    draft_model: str = ""
    guess_always: bool = False  # every guess checked, paying or not (SYSHAX_GUESS=always, tests only)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token, its log-probability, and the most likely tokens there (most likely first).

    Log-probabilities are of the model's raw distribution (log-softmax of the logits, before
    temperature, penalties and truncation), as vLLM reports them by default.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), descending


@dataclass(frozen=True)
class KVHandle:
    """Where a prefill left its KV record in the ring; only this crosses the control channel."""

    offset: int
    length: int
    seq: int  # the ring's record number, so a reused offset is never mistaken for this record
    checksum: int
    n_tokens: int
    first_token: int
    written_at: float  # time.time() when the record was committed
    # the prefill engine's logprobs, when the request asked for them: the decoder sends them with the first token
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class PrefixPlan:
    """What the daemon's prefix cache holds of a prompt, and where the engine may keep more of it.

    The prompt is cut into blocks of `block_tokens`, which divide the prefill chunk (`chunk_tokens`).
    `hits` are the slots of blocks 0..len(hits)-1, each with the checksum its record was sealed with;
    `stores` pairs a block index with a slot the engine may write that block's record into once the
    prompt has run. The engine decides how many hits it can resume after and which stores it can
    write with the bits a miss would give (plugins/llamacpp/syshax_llamacpp/prefix.py).
    """

    block_tokens: int
    chunk_tokens: int
    # (slot, checksum) of blocks 0, 1, ...; checksum 0: being written for another request when planned
    hits: tuple[tuple[int, int], ...] = ()
    stores: tuple[tuple[int, int], ...] = ()  # (block index, slot)
    # The whole prompt, cached: its last chunk's KV (from the last multiple of chunk_tokens before its last
    # token) and its last token's logits (slot, checksum), when the plan's hits reach that chunk -- a prompt
    # seen before runs nothing at all; or a slot to keep this prompt so in (-1: none)
    final: tuple[int, int] | None = None
    final_store: int = -1
    # Slots for blocks of the tokens the request generates, held for it until it ends: the engine writes the
    # blocks its KV then holds after the prompt's whole blocks (block len(prompt) // block_tokens on), in order,
    # when the bits decoding gave them are those a prompt chunk gives (a chat's next turn resumes after them)
    keeps: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to generate, as the client asked for it. Exactly one of prompt, prompt_tokens, messages is set
    (the daemon sends engines prompt_tokens). How an engine is to run it this time is a Handling, beside it."""

    request_id: str
    max_tokens: int | None  # None: up to the context's room (the daemon always sets it: engine/prompts.py)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_prompt: bool = True  # False: the request neither reads nor fills the prefix cache
    # logprobs: each generated token's logprob and this many top alternatives (None: none computed);
    # prompt_logprobs: the same for every prompt token (echo), which needs every prompt position's logits
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # GBNF text (root rule "root") that the output must match: response_format and the peers' forms
    # (api/core/constraints.py) and forced tool calls, converted in the daemon; empty: unconstrained
    grammar: str = ""
    grammar_field: str = "response_format"  # the request field the grammar came from: refusals name it
    # chat: the tools the template renders into the prompt ({"type": "function", "function": {...}})
    tools: tuple[dict, ...] = ()
    # chat: the template's variables from the request (chat_template_kwargs: enable_thinking, ...); None: none
    chat_template_kwargs: dict | None = None
    # the client named no max_tokens and the daemon gave its default: an engine whose context is smaller than the
    # daemon's (a decode node's) takes it within its own room, as it would a missing one, instead of refusing it
    max_tokens_default: bool = False


@dataclass(frozen=True)
class Handling:
    """How one engine is to run a request this time: the daemon's routing state, which no client sets. A request's
    journey (engine/journey.py) sends it a new Handling at each engine it visits."""

    # hetero: the prompt's KV, computed elsewhere; or why there is none (the decoder recomputes)
    kv: KVHandle | None = None
    kv_missing: Fallback | str = ""
    # a generate engine with a ring runs only the prompt, writes its KV into the ring and answers
    # Prefilled, as a prefill worker does (auto mode offloading this request's decode to the CPU)
    handoff: bool = False
    # tokens this request already generated on another engine: the prompt is followed by them and generation
    # continues after them (auto mode moving a CPU decode back to the GPU; a resume after a worker died)
    resume_tokens: tuple[int, ...] = ()
    # the prompt's blocks in the prefix cache (the daemon plans it from prompt_tokens); None: no cache
    prefix: PrefixPlan | None = None


# --- worker -> daemon events -------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The engine tokenized the prompt and queued the sequence."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV comes from the prefix cache (usage.prompt_tokens_details)


@dataclass(frozen=True)
class Cached:
    """The engine is done with a request's prefix plan: the blocks it wrote (slot, checksum), and the hit
    blocks it found unusable. The daemon's prefix cache takes it; the request's stream never sees it."""

    request_id: str
    stored: tuple[tuple[int, int], ...] = ()
    refused: tuple[int, ...] = ()  # hit slots whose record did not check out
    hit_tokens: int = 0  # prompt tokens whose KV the engine took from the cache
    # None: the report on the prompt. At the request's end, before its last Delta: the blocks of generated tokens
    # written into the plan's `keeps` slots, (slot, key, checksum), the key chained over the prompt and what
    # was generated (sdk/kv/block_keys.py)
    generated: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker finished a prompt: its KV is in the ring (or, with handle None, is not)."""

    request_id: str
    handle: KVHandle | None
    reason: Fallback | str = ""  # why there is no handle: RING_FULL, EXPORT_FAILED


@dataclass(frozen=True)
class Imported:
    """A decode worker took up a sequence that came with a KV handle: imported, or recomputing."""

    request_id: str
    ok: bool
    reason: Fallback | str = ""  # why the record was not used: a Fallback (CANCELLED: never read)
    seconds: float = 0.0  # read, verify and import time
    nbytes: int = 0


class Refusal(StrEnum):
    """Why a request was not taken; the API gives each its HTTP status (engines speak no HTTP)."""

    INVALID = "invalid"  # it cannot run as sent: the client's to change (400)
    UNAVAILABLE = "unavailable"  # no engine can take it now (503)
    FAILED = "failed"  # the engine could not, through no fault of the request (500)


@dataclass(frozen=True)
class Rejected:
    """The request was not taken: why (kind), in words, and the code and request field the error body names."""

    request_id: str
    kind: Refusal
    message: str
    code: str | None = None
    param: str | None = None


@dataclass(frozen=True)
class Delta:
    """New output for one sequence: text (may be empty while a stop string is pending)."""

    request_id: str
    text: str
    n_tokens: int
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    tokens: tuple[int, ...] = ()  # the token ids behind it (so a decode can continue on another engine)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token that went into the text (request.logprobs)
    # the prompt's, on the first Delta (request.prompt_logprobs): None for the first token, which has no context
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class WorkerLost:
    """The daemon's own event, never an engine's: the worker running the request died (or was killed as hung)
    before finishing it. The request's journey goes on elsewhere or ends saying why (engine/journey.py)."""

    request_id: str
    why: str  # what happened to the worker, in words: "died", "stopped responding (...) and was replaced"
    failed: bool = False  # the worker was given up on (a crash loop with nothing safer): it will not be back
    error: str = ""  # why it was given up on
    stopping: bool = False  # the daemon stopped it (shutdown): there is nowhere to go on


@dataclass(frozen=True)
class WorkerWarming:
    """The engine is built and now proves its kernels (a warm-up that runs what serving runs).

    safer_kernels: the spec changes (EngineSpec field -> value) that give safer kernels, and what they turn
    off in words; the supervisor restarts with them if the worker dies before it is ready, or dies on
    every request. Empty when nothing is safer. (A KV "fallback" is something else: a decoder that
    recomputes a prompt whose record it did not get.)
    """

    info: dict
    safer_kernels: dict = field(default_factory=dict)
    safer_kernels_lose: str = ""


@dataclass(frozen=True)
class WorkerReady:
    info: dict
    proofs: Proofs | None = None  # what the warm-up proved, for the worker's restarts (EngineSpec.proven)


@dataclass(frozen=True)
class EngineStats:
    """An engine's load and counters, reported every STATS_INTERVAL; what the decider, status and /metrics read."""

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # accepted sequences waiting for a batch slot (or preempted, in vLLM)
    free_slots: int = 0
    max_batch_size: int = 0
    n_ctx: int = 0  # tokens one sequence may hold
    kv_usage: float = 0.0  # 0..1 of the engine's KV cache
    tokens_per_second: float = 0.0  # generated, over the last few seconds
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    finished: int = 0
    decode_errors: int = 0
    stream_moves: int = 0  # sequences moved between KV streams to keep the decode batch one ubatch
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of being evaluated
    padded_steps: int = 0  # decode steps in which a lone sequence had a padding row beside it (llama.cpp)
    guessed_tokens: int = 0  # speculative decoding: tokens guessed and checked in a decode step (llama.cpp)
    kept_guesses: int = 0  # ... of them, those the sampler chose too: each one a token without a step of its own
    drafted_tokens: int = 0  # ... of the guessed, those a draft model guessed (config draft_model)
    kept_drafts: int = 0  # ... and of those, the kept


@dataclass(frozen=True)
class WorkerStats:
    stats: EngineStats


@dataclass(frozen=True)
class WorkerFailed:
    """The engine could not be built (or, during="warm-up", failed its warm-up); the supervisor reports this
    instead of restarting forever, after trying the engine's safer kernels for a failed warm-up whose cause may be
    the kernels'."""

    message: str
    during: str = "build"
    # False: the engine raised ModelNotServable, a cause of the model's that other kernels would meet again
    kernels_suspect: bool = True


class ModelNotServable(RuntimeError):
    """An engine cannot serve this model as it is (a KV or state layout it does not carry, a state its codec cannot
    parse): the model's cause, not the CPU kernels'. Raised while the engine is built or warms up, the worker is
    reported failed with the message at once, not restarted with safer kernels (sdk/worker.py)."""


# --- daemon -> worker commands -----------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    request: GenerateRequest
    handling: Handling = Handling()


@dataclass(frozen=True)
class EmbedRequest:
    """One /v1/embeddings request's inputs for an embedding engine, in order: each a text (the engine tokenizes it
    as the model does: its BOS or EOS where the model adds them) or token ids, sent as they are.

    For a reranker (a model whose pooling is "rank"), `query` is set (a /v1/rerank request): each input is then a
    document's text, which the engine puts beside the query as the model asks (its "rerank" template, or llama.cpp's
    query-separator-document form), and each answer is the model's scores of that pair, not a vector."""

    request_id: str
    inputs: tuple[str | tuple[int, ...], ...]
    normalize: bool = True  # each vector scaled to length 1 (OpenAI's embeddings are)
    query: str | None = None  # a reranker's query; None: an embeddings request


@dataclass(frozen=True)
class Embed:
    request: EmbedRequest


@dataclass(frozen=True)
class Embedded:
    """An EmbedRequest's answer: one vector per input, in order, each float32 little-endian bytes (OpenAI's base64
    form before base64), and the tokens the inputs took. A reranker's vector is its scores of the pair, the first
    the relevance (Qwen3-Reranker's: P(yes), P(no))."""

    request_id: str
    vectors: tuple[bytes, ...]
    n_tokens: int


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


class Engine(Protocol):
    """What a backend builds inside its worker. All methods run on the worker's one thread."""

    def info(self) -> dict:
        """Model id, context size, batch size, and whatever status should show."""

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> list:
        """Queue a request, run as `handling` says; return [Accepted] or [Rejected]."""

    def cancel(self, request_id: str) -> list:
        """Drop a request and free its sequence; return its final Delta if it was live."""

    def has_work(self) -> bool: ...

    def step(self) -> list:
        """Run one batched forward pass and return the Deltas it produced."""

    def stats(self) -> EngineStats: ...

    def warm_up(self) -> None:
        """Run once what serving runs (a full prompt chunk, a full decode batch, ...), before the worker says
        ready: kernels that crash on this CPU crash here, not in a user's request. Raise if it went wrong."""

    def safer_kernels(self) -> tuple[dict, str]:
        """The EngineSpec changes that give safer kernels, and what they turn off in words; ({}, "") if none."""

    def proofs(self) -> Proofs | None:
        """What warm_up proved, for the worker's restarts (optional: engines that prove nothing need not have it)."""

    def close(self) -> None: ...


# what a worker's stream yields (Cached stays in the daemon); a journey turns WorkerLost into a transition, and the
# API reads the rest
Event = Accepted | Prefilled | Imported | Rejected | Delta | WorkerLost | Embedded


class RequestStream(Protocol):
    """One request's events as the API reads them, whichever way the request runs.

    The API reads a journey (engine/journey.py): one request from admission to its last event, over
    whichever workers it takes (prefill, handoff, decode, a resume after a worker died, a move back to
    the GPU). A journey reads workers' own streams (engine_handle.WorkerStream). The API sees Accepted
    first, then Deltas until one has a finish_reason, or a Rejected instead; never a WorkerLost.
    """

    request_id: str
    route: Route  # where it runs
    reason: str  # why the scheduler chose that route (auto mode); "" otherwise
    moved_to: Route | str  # where an offloaded decode moved for its rest; "" when it did not move
    decided_by: str  # auto: "rule:NAME", "measured", "thresholds", ... (engine/decider.py's Decision.by); "" else
    finished: bool
    tokens_sent: int

    async def next_event(self) -> Event: ...

    def cancel(self) -> None:
        """Stop (client gone, timeout): frees the request's sequence and whatever KV record it holds."""
