"""Which engine workers a configuration asks for, where each one runs, and the KV ring they need between them.

Planning has no side effects: it reads the host's topology and the installed plugins and returns a
plan; the daemon creates what the plan names (the ring's shared-memory segment) and removes it at exit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from syshaxd.config import Config
from syshaxd.sdk import faults
from syshaxd.sdk.types import EngineSpec, GpuSettings, Pool, Role
from syshaxd.sdk.gguf.header import GGUFError, read_gguf_header
from syshaxd.sdk.gguf.layout import KVLayout, kv_layout
from syshaxd.engine.numa import ENV_CPU_AFFINITY, plan_cpu_workers, plan_prefill_worker, read_host_topology
from syshaxd.sdk.placement import ENV_THREADS, PlacementError, format_cpulist


log = logging.getLogger(__name__)


def _fault(env: dict) -> str:
    """SYSHAX_FAULT, the tests' fault injection (sdk/faults.py), checked."""
    try:
        return faults.parse(env.get("SYSHAX_FAULT", ""))
    except faults.FaultError as exc:
        raise PlanError(str(exc)) from None


class PlanError(RuntimeError):
    """The configuration asks for workers this host cannot run; the message says what to change."""


@dataclass(frozen=True)
class RingPlan:
    """The shared-memory KV ring a plan needs: the instance its workers attach to, and its capacity."""

    instance: str
    size: int  # bytes


@dataclass(frozen=True)
class PrefixStorePlan:
    """The prefix cache's block store: its instance, slots of one block's KV record each, and wide slots of one
    prompt chunk's KV record and its last token's logits each (a whole prompt's last chunk)."""

    instance: str
    n_slots: int
    slot_bytes: int
    n_wide: int
    wide_bytes: int
    block_tokens: int  # prefix_block_tokens, or the chunk when that is smaller
    chunk_tokens: int  # the prefill chunk size
    keep_tokens: int = 0  # keep_generated_tokens in cpu mode (the workers run their own prompts there), else 0


@dataclass
class Engines:
    """The planned workers (name, spec), the ring they share in hetero and auto modes, and the prefix cache."""

    workers: list[tuple[str, EngineSpec]]
    ring: RingPlan | None = None  # the daemon creates it before the workers start, and unlinks it at exit
    prefix: PrefixStorePlan | None = None  # likewise


# the share of prefix_cache_mb kept for whole prompts' last chunks (a repeated prompt then runs nothing)
WIDE_SHARE = 0.25


def _page_round(n: int) -> int:
    return -(-n // 4096) * 4096


def _draft_model(cfg: Config) -> str:
    """The draft model's GGUF (config draft_model), checked to be a file here, where a mistake can stop the start
    with a message; its vocabulary is checked against the model's by the engines that load it."""
    if not cfg.draft_model:
        return ""
    path = Path(cfg.draft_model).expanduser()
    if not path.is_file():
        raise PlanError(f"draft_model: {path} does not exist or is not a file; give a GGUF of a smaller model of the "
                        "served model's family, or leave it empty (guesses then come from the request's own context)")
    try:
        read_gguf_header(path)
    except (GGUFError, OSError) as exc:
        raise PlanError(f"draft_model: {exc}; give a GGUF file (llama.cpp's model format)") from None
    return str(path.resolve())


def plan_prefix_store(cfg: Config, model_path: Path, instance: str) -> PrefixStorePlan | None:
    """prefix_cache_mb of slots, f16 KV as llama.cpp keeps it: a quarter in wide slots of prefill_chunk_size
    tokens with one token's logits, the rest in slots of one block of prefix_block_tokens."""
    from syshaxd.sdk.gguf.header import GGUFError, fingerprint_from_gguf, n_vocab_from_gguf
    from syshaxd.sdk.kv.record import DType, record_size

    if cfg.prefix_cache_mb <= 0 or cfg.mode not in ("cpu", "hetero"):
        return None  # gpu and auto: the GPU engine (vLLM) keeps its own prefix cache
    try:
        fingerprint = fingerprint_from_gguf(model_path)
        n_vocab = n_vocab_from_gguf(model_path)
    except (GGUFError, OSError) as exc:
        # the engines will say what is wrong with the file, through /health and the log
        log.warning("no prefix cache: cannot size it from %s (%s)", model_path.name, exc)
        return None
    chunk, block = cfg.prefill_chunk_size, cfg.prefix_block()
    budget = cfg.prefix_cache_mb * 1024 * 1024
    wide = _page_round(record_size(fingerprint, chunk, DType.F16) + 4 * n_vocab)
    slot = _page_round(record_size(fingerprint, block, DType.F16))
    n_wide = max(1, int(budget * WIDE_SHARE) // wide)
    n_slots = (budget - n_wide * wide) // slot
    if n_slots < 1:
        raise PlanError(f"prefix_cache_mb: {cfg.prefix_cache_mb} MiB holds no prompt chunk of {chunk} tokens with its "
                        f"logits ({wide / 2**20:.1f} MiB) beside a block of {block} tokens; raise it, lower "
                        "prefill_chunk_size, or set 0")
    keep = cfg.keep_generated_tokens if cfg.mode == "cpu" else 0
    return PrefixStorePlan(instance, n_slots, slot, n_wide, wide, block, chunk, keep)


def _layout(model_path: Path) -> KVLayout | None:
    try:
        return kv_layout(model_path)
    except (GGUFError, OSError):
        return None  # the engines say what is wrong with the file


def _refuse_what_the_engines_cannot_carry(model_path: Path, where: str, handoff: bool, others: str = "") -> None:
    """What a model keeps beside one plain KV cache (sdk/gguf/layout.py), refused at start where an engine on the way
    cannot carry it, so that the daemon exits saying why instead of answering 503. llama.cpp engines move a sequence's
    whole state, between their own contexts and as a KV record of llama.cpp's state from a prefill engine to a decoder
    (FLAG_LLAMA_STATE), so with llama.cpp engines alone every layout serves. `others` names what else is on the way
    and takes K and V rows per head of one cache ("prefill_engine torch", "a decode node's handoff"; "": nothing):
    a recurrent state is refused with it, sliding-window layers and MLA where prompts are handed between engines
    (`handoff`). `where` starts the message ("hetero mode")."""
    layout = _layout(model_path)
    if layout is None or layout.plain or not others:
        return
    if layout.recurrent:
        what = "whose recurrent state"
    elif not handoff:
        return
    elif layout.sliding_window:
        what = "whose sliding-window layers keep a second KV cache that"
    else:
        what = "with multi-head latent attention (MLA), whose compressed KV"
    hint = "" if others.startswith("a decode node") else ', or with llama.cpp engines ("llamacpp")'
    raise PlanError(f"{where}: {model_path.name} is a {layout.arch} model {what} {others} does not carry; serve it in "
                    f"cpu mode (--mode cpu){hint}")


def _warn_if_the_ring_is_small(model_path: Path, capacity: int, n_ctx: int) -> None:
    """A prompt's KV record must fit the ring whole, or its decoder computes the prompt again: say so at start when
    the ring cannot hold one prompt of n_ctx tokens of this model (a 32B model's 2,048 tokens are 512 MiB)."""
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf
    from syshaxd.sdk.kv.record import DType, record_size
    from syshaxd.sdk.kv.ring import RECORD_HEADER

    try:
        fp = fingerprint_from_gguf(model_path)
    except (GGUFError, OSError):
        return

    def in_ring(n_tokens: int) -> int:  # what a record of n_tokens takes in the ring, its ring header included
        return RECORD_HEADER + record_size(fp, n_tokens, DType.F16)

    need = in_ring(n_ctx)
    if capacity < need:
        fits, over = 0, n_ctx  # the longest prompt whose record fits: in_ring(fits) <= capacity < in_ring(over)
        while over - fits > 1:
            mid = (fits + over) // 2
            fits, over = (mid, over) if in_ring(mid) <= capacity else (fits, mid)
        per_token = in_ring(1) - in_ring(0)
        log.warning("ring_size_mb %d holds the KV of a prompt of at most %d tokens of this model (%d KiB a token), "
                    "n_ctx is %d: a longer prompt is computed again by its decoder; ring_size_mb = %d holds one of "
                    "n_ctx tokens", capacity >> 20, fits, per_token >> 10, n_ctx, -(-need >> 20))


def _refuse_codecs_unproven_for(model_path: Path, mode: str, other_backends: set[str]) -> None:
    """A torch or vLLM engine hands its prompts on in hetero and auto modes only for the families its codec is proven
    on (sdk/hf_model.py); the llama.cpp prefill engine hands every family's on."""
    if mode not in ("hetero", "auto") or not other_backends:
        return
    from syshaxd.sdk.hf_model import codec_refusal

    try:
        refusal = codec_refusal(model_path)
    except (GGUFError, OSError):
        return  # the engines say what is wrong with the file
    if refusal:
        raise PlanError(f"{mode} mode with prefill_engine {', '.join(sorted(other_backends))}: {refusal}")


def _with_prefix_store(engines: Engines, cfg: Config, model_path: Path, instance: str) -> Engines:
    """Every worker may use the prefix cache; the engines that implement it (llama.cpp) attach the store, and keep
    what requests generate where the plan says so (cpu mode) and their tiled attention proves it exact."""
    layout = _layout(model_path)
    if layout is not None and not layout.plain:
        what = ("its recurrent state stands for all its tokens" if layout.recurrent else
                "its sliding-window layers keep a second KV cache" if layout.sliding_window else
                "MLA keeps its KV compressed")
        if not cfg.prefix_cache_mb:
            return engines
        # each worker keeps whole states after prompts instead, in its own memory (checkpoints.py)
        log.info("prefix cache for %s: %s, which blocks of K and V rows per head do not carry; each worker keeps "
                 "whole states after prompts instead, up to prefix_cache_mb (%d MiB) in its own memory",
                 model_path.name, what, cfg.prefix_cache_mb)
        return Engines([(name, replace(spec, state_checkpoints_mb=cfg.prefix_cache_mb))
                        for name, spec in engines.workers], engines.ring, engines.prefix)
    store = plan_prefix_store(cfg, model_path, instance)
    if store is None:
        return engines
    keep = store.keep_tokens > 0 and cfg.tiled_attention
    return Engines([(name, replace(spec, prefix_store=instance, keep_generated=keep))
                    for name, spec in engines.workers], engines.ring, store)


def _overrides(cfg: Config, env: dict) -> dict:
    # the environment overrides the config file, as the seed's CUSTOM_CPU_AFFINITY did
    out = {}
    if env.get(ENV_CPU_AFFINITY) or cfg.cpu_affinity:
        out[ENV_CPU_AFFINITY] = env.get(ENV_CPU_AFFINITY) or cfg.cpu_affinity
    if env.get(ENV_THREADS) or cfg.threads:
        out[ENV_THREADS] = env.get(ENV_THREADS) or str(cfg.threads)
    return out


def default_prefill_cpus(cpus: frozenset[int]) -> frozenset[int]:
    """A quarter of the first node's CPUs (at least one) when the config names none."""
    ordered = sorted(cpus)
    return frozenset(ordered[: max(1, len(ordered) // 4)])


# the roles the prefill_engine backend needs in each mode, and how the error says it
_ROLES_NEEDED = {"hetero": ({"prefill"}, "prefill"),
                 "gpu": ({"generate"}, "generate (gpu mode runs both phases on it)"),
                 "auto": ({"generate", "prefill"}, "generate and prefill (auto mode runs both phases on it, "
                                                   "or the prompt alone)")}


def _backend(key: str, name: str, roles: set[str], doing: str, device: str | None = None) -> str:
    """The backend config `key` names, checked here so a wrong name fails at start, not in a worker."""
    from syshaxd.sdk.plugins import BackendNotFound, find_backend, make_plugin_manager

    try:
        backend = find_backend(make_plugin_manager(), name)
    except BackendNotFound as exc:
        raise PlanError(f"{key}: {exc}") from None
    if not roles <= backend.roles:
        raise PlanError(f"{key}: backend {name!r} cannot {doing} (its roles: {', '.join(sorted(backend.roles))})")
    if device is not None and backend.device != device:
        raise PlanError(f"{key}: backend {name!r} runs on {backend.device}; {key} needs one on {device}")
    available = backend.availability()
    if not available.available:
        raise PlanError(f"{key}: backend {name!r} is not available here: {available.reason}")
    return backend.name


def _prefill_backend(name: str, mode: str) -> str:
    """The prefill_engine backend. In gpu mode the same backend does both phases, so there it must be able to
    `generate`; in auto mode it must also be able to `prefill` (hand a prompt's KV to the CPU)."""
    roles, doing = _ROLES_NEEDED[mode]
    return _backend("prefill_engine", name, roles, doing)


@dataclass(frozen=True)
class GpuEngine:
    """One engine of the GPU pool (hetero: the prefill pool): its backend, its CPUs and its devices."""

    backend: str
    cpus: str  # a cpulist; "": the default (a quarter of the first node's CPUs, or all of them in gpu mode)
    devices: str  # CUDA_VISIBLE_DEVICES for it; "": as the daemon has it


def split_pool(backends: str, cpu_sets: str, devices: str) -> list[GpuEngine]:
    """The GPU pool the config asks for: prefill_engine ("vllm", or "vllm,torch": one engine each), prefill_cpu_affinity
    ("0-3", or "0-3;4-7": one engine each) and gpu_devices ("0;1": one engine each, "0,1;2,3" two devices each).
    As many engines as the longest list; a list of one serves them all. PlanError when the lists disagree."""
    lists = {"prefill_engine": [b.strip() for b in backends.split(",")],
             "prefill_cpu_affinity": [c.strip() for c in cpu_sets.split(";")] if cpu_sets else [""],
             "gpu_devices": [d.strip() for d in devices.split(";")] if devices else [""]}
    n = max(len(v) for v in lists.values())
    for key, values in lists.items():
        if len(values) not in (1, n):
            others = ", ".join(f"{k} {len(v)}" for k, v in lists.items() if len(v) > 1)
            raise PlanError(f"{key}: {len(values)} entries, but the GPU pool has {n} engines ({others}); give one "
                            "entry, which every engine takes, or one per engine")
        if not all(values) and len(values) > 1:
            raise PlanError(f"{key}: an empty entry in {backends if key == 'prefill_engine' else cpu_sets or devices!r}")
    pick = lambda values, i: values[i if len(values) > 1 else 0]  # noqa: E731
    return [GpuEngine(pick(lists["prefill_engine"], i), pick(lists["prefill_cpu_affinity"], i),
                      pick(lists["gpu_devices"], i)) for i in range(n)]


def _cpu_backend(name: str, mode: str) -> str:
    """The cpu_engine backend of the CPU workers: on the CPU, generating, and in hetero and auto modes also
    decoding a prompt another engine ran (importing its KV record)."""
    if mode == "cpu":
        return _backend("cpu_engine", name, {"generate"}, "generate", device="cpu")
    return _backend("cpu_engine", name, {"generate", "decode"}, "generate and decode (the CPU workers take "
                    "KV records from the prefill engine)", device="cpu")


def _guessing(engines: Engines, env: dict) -> Engines:
    """SYSHAX_GUESS=always: every decode step takes every guess it has, paying or not (sdk/faults.py; tests only)."""
    value = env.get("SYSHAX_GUESS", "")
    if value not in ("", "always"):
        raise PlanError(f"SYSHAX_GUESS: only \"always\" (every guess checked, tests only) is known; got {value!r}")
    if not value:
        return engines
    return replace(engines, workers=[(name, replace(spec, guess_always=True)) for name, spec in engines.workers])


def _slowed(engines: Engines, env: dict) -> Engines:
    """SYSHAX_SLOW's step delays on the workers it names (sdk/faults.py; tests only)."""
    try:
        slow = faults.parse_slow(env.get("SYSHAX_SLOW", ""))
    except faults.FaultError as exc:
        raise PlanError(str(exc)) from None
    unknown = set(slow) - {name for name, _ in engines.workers}
    if unknown:
        raise PlanError(f"SYSHAX_SLOW names no worker of this plan: {', '.join(sorted(unknown))}")
    if not slow:
        return engines
    return replace(engines, workers=[(name, replace(spec, step_delay=slow.get(name, 0.0)))
                                     for name, spec in engines.workers])


def plan_engines(cfg: Config, model_path: Path, model_name: str, env: dict, instance: str | None = None) -> Engines:
    """The workers, ring and prefix cache for cfg; see _plan_workers."""
    engines = _guessing(_slowed(_plan_workers(cfg, model_path, model_name, env, instance), env), env)
    return _with_prefix_store(engines, cfg, model_path, instance or f"{os.getpid()}")


def _plan_workers(cfg: Config, model_path: Path, model_name: str, env: dict, instance: str | None) -> Engines:
    """Workers for cfg.mode; in hetero and auto modes also the shared-memory KV ring they need (not created here).

    cpu: CPU workers (pool "cpu"). gpu: the GPU engine alone (pool "gpu"). hetero: a prefill worker
    (pool "prefill") and CPU decoders. auto: the GPU engine, which also writes KV records, and CPU
    decoders. On a host without a GPU the "GPU" engine runs on prefill_cpu_affinity's CPUs.
    """
    # every llama.cpp worker of every mode takes the same attention (tiled_attention), so that every route gives a
    # token the same bits: hetero's decoders cpu mode's tokens, a resume the undisturbed run's
    base = EngineSpec(
        backend=cfg.cpu_engine, role=Role.GENERATE, model_path=str(model_path), model_name=model_name,
        n_ctx=cfg.n_ctx, max_batch_size=cfg.cpu_max_batch_size, threads=1,
        prefill_chunk_size=cfg.prefill_chunk_size, quantize=cfg.quantize, cache_dir=str(cfg.model_dir_path()),
        handoff_timeout=cfg.handoff_timeout, repack=cfg.repack, fault=_fault(env), tiled_attention=cfg.tiled_attention,
        speculative_tokens=cfg.speculative_tokens, draft_model=_draft_model(cfg),
        gpu=GpuSettings(cfg.gpu_memory_utilization, cfg.max_num_seqs, cfg.tensor_parallel_size, cfg.preemption_mode),
    )
    pool = split_pool(cfg.prefill_engine, cfg.prefill_cpu_affinity, cfg.gpu_devices) if cfg.mode != "cpu" else []
    others = [f"prefill_engine {b}" for b in sorted({e.backend for e in pool} - {"llamacpp"})]
    others += [f"cpu_engine {cfg.cpu_engine}"] if cfg.cpu_engine != "llamacpp" else []
    _refuse_what_the_engines_cannot_carry(model_path, f"{cfg.mode} mode", handoff=cfg.mode in ("hetero", "auto"),
                                          others=" and ".join(others))
    topology = read_host_topology()
    try:
        if cfg.mode == "cpu":
            _cpu_backend(cfg.cpu_engine, cfg.mode)
            placements = plan_cpu_workers(topology, _overrides(cfg, env), role="generate")
            return Engines([(f"cpu{p.index}", replace(base, threads=p.threads, placement=p)) for p in placements])
        _refuse_codecs_unproven_for(model_path, cfg.mode, {e.backend for e in pool} - {cfg.cpu_engine})
        if cfg.mode == "gpu":
            # the engines do both phases; on a host without a GPU they run on these CPUs
            placed = [(e, plan_prefill_worker(topology, e.cpus or topology.cpus)) for e in pool]
            return Engines([(f"gpu{i}", _gpu_spec(base, e, p, Role.GENERATE, Pool.GPU, cfg.max_num_seqs,
                                                  _prefill_backend(e.backend, "gpu")))
                            for i, (e, p) in enumerate(placed)])
        if len(topology.cpus) < 2 and not cfg.prefill_cpu_affinity and cfg.local_decoders:
            raise PlanError(f"{cfg.mode} mode needs at least two CPUs (one for prefill, one for decode) "
                            f"and this process may use {format_cpulist(topology.cpus)}; use --mode cpu")
        first_node = next(n.cpus for n in topology.nodes if n.cpus)
        placed = [(e, plan_prefill_worker(topology, e.cpus or default_prefill_cpus(first_node))) for e in pool]
        reserved = frozenset().union(*(p.cpus for _, p in placed))
        # local_decoders = false: the decoders are the remote nodes' (remote/front.py), added by the daemon
        decoders = plan_cpu_workers(topology, _overrides(cfg, env), reserved=reserved, role="decode") \
            if cfg.local_decoders else []
    except PlacementError as exc:
        raise PlanError(str(exc)) from None

    _cpu_backend(cfg.cpu_engine, cfg.mode)
    instance = instance or f"{os.getpid()}"
    ring = RingPlan(instance, cfg.ring_size_mb * 1024 * 1024)
    _warn_if_the_ring_is_small(model_path, ring.size, cfg.n_ctx)
    if cfg.mode == "auto":  # the GPU engines generate, and hand a prompt on when told to
        workers = [(f"gpu{i}", _gpu_spec(base, e, p, Role.GENERATE, Pool.GPU, cfg.max_num_seqs,
                                         _prefill_backend(e.backend, cfg.mode), instance))
                   for i, (e, p) in enumerate(placed)]
    else:
        workers = [(f"prefill{i}", _gpu_spec(base, e, p, Role.PREFILL, Pool.PREFILL, 1,
                                             _prefill_backend(e.backend, cfg.mode), instance))
                   for i, (e, p) in enumerate(placed)]
    workers += [(f"decode{p.index}", replace(base, role=Role.GENERATE, threads=p.threads, placement=p,
                                             ring=instance)) for p in decoders]
    return Engines(workers, ring)


def _gpu_spec(base: EngineSpec, engine: GpuEngine, placement, role: Role, pool: Pool, batch: int, backend: str,
              ring: str = "") -> EngineSpec:
    """A GPU-pool engine's spec: its backend, CPUs and devices."""
    return replace(base, backend=backend, role=role, pool=pool, max_batch_size=batch, threads=placement.threads,
                   placement=placement, ring=ring, gpu=replace(base.gpu, devices=engine.devices))


def plan_node(cfg: Config, model_path: Path, model_name: str, env: dict, instance: str | None = None) -> Engines:
    """A decode node's workers (remote/node.py): decoders on every CPU set, as cpu mode places them, reading the
    node's own KV ring, which its front writes records into."""
    base = EngineSpec(
        backend=_cpu_backend(cfg.cpu_engine, "hetero"), role=Role.GENERATE, model_path=str(model_path),
        model_name=model_name, n_ctx=cfg.n_ctx, max_batch_size=cfg.cpu_max_batch_size,
        prefill_chunk_size=cfg.prefill_chunk_size, quantize=cfg.quantize, cache_dir=str(cfg.model_dir_path()),
        handoff_timeout=cfg.handoff_timeout, repack=cfg.repack, fault=_fault(env), tiled_attention=cfg.tiled_attention,
        speculative_tokens=cfg.speculative_tokens, draft_model=_draft_model(cfg))
    _refuse_what_the_engines_cannot_carry(model_path, "a decode node", handoff=True,
                                          others="a decode node's handoff")
    instance = instance or f"node-{os.getpid()}"
    try:
        placements = plan_cpu_workers(read_host_topology(), _overrides(cfg, env), role="decode")
    except PlacementError as exc:
        raise PlanError(str(exc)) from None
    return Engines([(f"decode{p.index}", replace(base, threads=p.threads, placement=p, ring=instance))
                    for p in placements], RingPlan(instance, cfg.ring_size_mb * 1024 * 1024))
