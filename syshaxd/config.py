"""The daemon's configuration: one typed object, read from TOML once, validated, passed down."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any, Mapping, TypeVar

from syshaxd.routing_rules import RoutingRule, RuleError, parse_rules, rules_to_json
from syshaxd.model_entries import EntryError, ModelEntry, models_to_json, parse_models
from syshaxd.sdk.types import REPACK_SETTINGS


class Mode(StrEnum):
    """Where prefill and decode run (DESIGN.md's table of modes)."""

    CPU = "cpu"
    GPU = "gpu"
    HETERO = "hetero"
    AUTO = "auto"


MODES = tuple(Mode)
QUANTIZE_TYPES = ("", "q4_0", "q8_0")
LOG_LEVELS = ("debug", "info", "warning", "error")
PREEMPTION_MODES = ("recompute",)

SYSTEM_CONFIG = Path("/etc/syshax/syshax.toml")

# Keys a running daemon applies at once (SIGHUP, `syshax config set`). Everything else
# is read when workers are planned or the listener is bound, so it needs a restart.
LIVE_KEYS = frozenset({"max_queue_size", "request_timeout", "default_max_tokens", "max_messages", "client_timeout",
                       "max_string_bytes", "log_level", "drain_timeout",
                       # auto mode's decider reads these at every decision
                       "gpu_cache_threshold", "cpu_throughput_threshold", "token_limit_multiplier",
                       "token_limit_min", "token_limit_max", "decider", "tpot_target_ms", "ttft_target_ms",
                       "routing_rules"})
DECIDERS = ("thresholds", "measured")
# a guess's rows give a lone row's bits only in chunks under 64 rows (bench_chunk_invariance.py); 16 is plenty
MAX_SPECULATIVE_TOKENS = 16


class ConfigError(ValueError):
    """A configuration key has a bad value; the message names the key and what is allowed."""


# The reference's sections (docs/reference/config.md), in the order syshaxd/etc/syshax.toml has them, and the TOML
# table each section's keys live in. A table holds one or more sections; its keys come together in the file.
_HTTP = "HTTP endpoint"
_SERVE = "What to serve"
_MODE = "Mode"
_CPU_ENGINE = "CPU engine (llama.cpp)"
_PREFIX = "Prefix cache"
_SPECULATION = "Speculative decoding"
_HETERO = "Hetero mode and the GPU engine"
_AUTO = "Auto mode"
_REQUESTS = "Requests"
_SUPERVISION = "Worker supervision"
_SECURITY = "Security and limits"
_NODES = "Decode nodes"
_OPERATIONS = "Operations"
SECTION_TABLES: dict[str, str] = {
    _HTTP: "server", _REQUESTS: "server", _SECURITY: "server", _OPERATIONS: "server",
    _SERVE: "serve",
    _MODE: "engines", _CPU_ENGINE: "engines", _HETERO: "engines", _SUPERVISION: "engines",
    _PREFIX: "prefix_cache",
    _SPECULATION: "speculation",
    _AUTO: "auto",
    _NODES: "nodes",
}
SECTIONS = tuple(SECTION_TABLES)
TABLES = tuple(dict.fromkeys(SECTION_TABLES.values()))  # [server], [serve], [engines], ... in the file's order
TOP_LEVEL_ARRAYS = frozenset({"models"})  # [[models]]: an array of tables of its own, after every table

_T = TypeVar("_T")


def key(default: _T, section: str, doc: str) -> _T:
    """A config key: its default, and the section and one or two sentences the reference prints for it
    (python -m syshaxd.docs_reference; tests/e2e/test_docs_reference.py fails on a key without them)."""
    return field(default=default, metadata={"section": section, "doc": doc})


@dataclass(frozen=True)
class Config:
    """Every key of syshaxd/etc/syshax.toml, which documents each one at length; `doc` here is the reference's."""

    host: str = key("127.0.0.1", _HTTP, "The address the API listens on. 127.0.0.1 keeps it on this machine; use "
                    "0.0.0.0 only behind a firewall or with API keys.")
    port: int = key(8000, _HTTP, "The TCP port of the OpenAI-compatible API; 0 picks a free port and logs it.")
    max_body_bytes: int = key(4 * 1024 * 1024, _HTTP, "The largest request body accepted, in bytes; a larger one "
                              "gets HTTP 413. At least 1024.")

    mode: str = key("cpu", _MODE, 'Where prefill and decode run: "cpu", "gpu", "hetero" or "auto". An auto daemon '
                    "starts both engines and can switch among the modes while it runs (`syshax mode MODE`).")
    model: str = key("", _SERVE, "The GGUF file to serve. Empty: the embedded default model, SmolLM2-135M-Instruct, "
                     "prepared into model_dir at the first start.")
    model_name: str = key("", _SERVE, 'The model id clients send as "model" and /v1/models lists. Empty: '
                          '"SmolLM2-135M-Instruct" for the default model, else the GGUF file\'s name without ".gguf".')
    model_dir: str = key("models", _SERVE, "The folder for the default model and for quantized copies of models; a "
                         "relative path starts at the daemon's working directory (the service uses /var/lib/syshax).")
    quantize: str = key("q4_0", _SERVE, 'The type an unquantized (F32, F16, BF16) GGUF is quantized to at its first '
                        'load, cached in model_dir: "q4_0", "q8_0", or "" to load every file as it is. Files already '
                        "quantized load as they are; SYSHAX_QUANTIZE overrides this key.")
    models: tuple[ModelEntry, ...] = key((), _SERVE, "Models served beside the daemon's own, written as "
                                         "`[[models]]` tables (name, path, and optionally n_ctx, threads, "
                                         "cpu_affinity, load, keep_alive; a chat model also mode, quantize, "
                                         "draft_model, batch_slots): an embedding model answers POST /v1/embeddings "
                                         "(a reranker POST /v1/rerank) under its name, in a worker of its own; a "
                                         "chat model answers the "
                                         "generation APIs under its name, from a syshaxd of its own.")
    models_dir: str = key("", _SERVE, "A folder whose GGUF files are each served as a [[models]] entry named by its "
                          'file name without ".gguf", loaded on demand (llama-server\'s --models-dir); an entry of '
                          "[[models]] with the same name wins. Empty: none.")
    max_loaded_models: int = key(0, _SERVE, "The most models loaded at once, the daemon's own model (always loaded) "
                                 "counted: with [[models]] entries, 2 or more. Loading one more entry (chat or "
                                 "embedding) unloads the least recently used idle one first. 0: no bound.")

    cpu_engine: str = key("llamacpp", _CPU_ENGINE, "The backend plugin of the CPU workers (`syshax plugins` lists the "
                          'installed ones); "llamacpp" is the built-in one.')
    n_ctx: int = key(4096, _CPU_ENGINE, "The most tokens one request may hold, prompt plus completion (capped by the "
                     "model's training context). Each batch slot gets this many KV cells, so memory grows with "
                     "n_ctx times cpu_max_batch_size.")
    cpu_max_batch_size: int = key(8, _CPU_ENGINE, "Sequences a CPU worker decodes together in one step (continuous "
                                  "batching); further requests wait in the queue and join as others finish.")
    threads: int = key(0, _CPU_ENGINE, "Threads per CPU worker. 0: OMP_NUM_THREADS if it is set, else one per CPU "
                       "in the worker's set.")
    cpu_affinity: str = key("", _CPU_ENGINE, 'The CPU workers\' CPUs as cpulists, one worker per set, separated by ";" '
                            '(e.g. "0-3;4-7" gives two workers). Empty: one worker per NUMA node, pinned to its CPUs; '
                            "CUSTOM_CPU_AFFINITY overrides this key.")
    prefill_chunk_size: int = key(256, _CPU_ENGINE, "Prompt tokens evaluated per step: a long prompt is fed in "
                                  "chunks of this size, so the sequences already decoding are not stalled for long.")

    prefix_cache_mb: int = key(512, _PREFIX, "Automatic prefix caching: MiB of /dev/shm that keep prompts' KV in "
                               "blocks, so that a prompt starting like an earlier one evaluates only the rest. "
                               '0 turns it off; a request can opt out with "cache_prompt": false.')
    prefix_cache_disk_gb: float = key(8.0, _PREFIX, "The prefix cache's disk tier, in GiB (at most half the free "
                                      "space at start): every block is also written to a file, so a prompt evicted "
                                      "from shared memory or seen before a restart is still a hit. 0 turns it off.")
    prefix_cache_dir: str = key("", _PREFIX, "Where the disk tier's files go. Empty: $CACHE_DIRECTORY/prefix (the "
                                "systemd unit's /var/cache/syshax/prefix), else ~/.cache/syshax/prefix.")
    prefix_block_tokens: int = key(16, _PREFIX, "The prefix cache's block in tokens: a shared prefix is reused in "
                                   "steps of this many tokens. It must divide prefill_chunk_size.")
    keep_generated_tokens: int = key(512, _PREFIX, "Of each answer, the tokens kept in the prefix cache (cpu mode), "
                                     "so that a chat's next turn resumes after the answer instead of evaluating it "
                                     "again; 0 keeps none. It needs tiled_attention.")

    tiled_attention: bool = key(True, _CPU_ENGINE, "Every llama.cpp worker takes every query row's attention in "
                                "tiles, so a token gets the same bits from a prompt chunk as from a decode step: "
                                "hetero gives cpu mode's tokens and resumed requests their undisturbed text. false "
                                "gives back llama.cpp's own attention; a front and its decode nodes must agree.")
    repack: str = key("auto", _CPU_ENGINE, 'llama.cpp\'s repacked weight kernels (llama-server\'s --repack): "auto" '
                      'takes the fastest kernels that run correctly on this CPU, "on" whatever the build offers '
                      '(AMX included), "off" plain kernels.')

    speculative_tokens: int = key(8, _SPECULATION, "The most tokens a decode step guesses from the request's own "
                                  "context (prompt lookup) and checks in the same step; texts stay the same, guesses "
                                  "are taken only where they are expected to pay. 0 turns it off; at most 16.")
    draft_model: str = key("", _SPECULATION, "A GGUF of a smaller model with the served model's vocabulary whose "
                           "greedy tokens are the guesses, loaded in every CPU worker. Empty: guesses come from the "
                           "request's own context only.")

    prefill_cpu_affinity: str = key("", _HETERO, 'The prefill worker\'s CPUs as a cpulist; several sets separated by '
                                    '";" make a pool of prefill engines, one on each. Empty: a quarter of the first '
                                    "NUMA node's CPUs (at least one).")
    gpu_devices: str = key("", _HETERO, 'The GPUs of each engine of the prefill pool, ";" between engines ("0;1": '
                           "one engine per GPU), set as its CUDA_VISIBLE_DEVICES. Empty: one engine, which sees the "
                           "daemon's devices.")
    ring_size_mb: int = key(256, _HETERO, "The size of the shared-memory KV ring in /dev/shm, in MiB, through which "
                            "the prefill worker hands each prompt's KV to the decode workers.")
    handoff_timeout: float = key(2.0, _HETERO, "Seconds a finished prefill waits for ring space; past it the decode "
                                 "worker recomputes the prompt itself (slower, never wrong).")
    prefill_engine: str = key("llamacpp", _HETERO, 'The backend that runs prefill in hetero mode and both phases in '
                              'gpu mode: "llamacpp", "torch", "npu" or "vllm"; several separated by commas make a '
                              "pool of engines side by side.")
    gpu_memory_utilization: float = key(0.8, _HETERO, "The GPU engine's (vLLM's) share of the device's memory for "
                                        "weights and KV cache, above 0 and at most 1. vLLM's CPU build ignores it "
                                        "and sizes its KV from n_ctx.")
    max_num_seqs: int = key(16, _HETERO, "Sequences the GPU engine generates at once (vLLM's max_num_seqs).")
    tensor_parallel_size: int = key(1, _HETERO, "GPUs one model is split across in gpu mode (vLLM's tensor "
                                    "parallelism); hetero mode needs 1.")
    preemption_mode: str = key("recompute", _HETERO, 'What vLLM does with a sequence it must pause when its KV cache '
                               'is full; only "recompute" (vLLM\'s v1 engine drops the KV and recomputes it later).')

    gpu_cache_threshold: float = key(90.0, _AUTO, "Percent of the GPU engine's KV cache in use above which it counts "
                                     "as saturated, so that a new request's decode goes to the CPU workers.")
    cpu_throughput_threshold: float = key(2.0, _AUTO, "Tokens/s (all CPU workers together) below which a busy CPU "
                                          "side takes no more offloaded decodes; an idle one always may.")
    token_limit_multiplier: float = key(2.0, _AUTO, "An offloaded decode is reconsidered after the CPU side's "
                                        "tokens/s times this many tokens (rounded to tens); if the GPU engine has "
                                        "room then, the rest of the decode moves back to it.")
    token_limit_min: int = key(16, _AUTO, "The fewest tokens after which an offloaded decode is reconsidered.")
    token_limit_max: int = key(512, _AUTO, "The most tokens after which an offloaded decode is reconsidered; at least "
                               "token_limit_min.")
    decider: str = key("thresholds", _AUTO, 'What places a new auto request: "thresholds" (sysHAX 0.2.0\'s rule: '
                       'the GPU engine while it has room) or "measured" (decider v2: the side where its decode is '
                       "expected faster, within tpot_target_ms and ttft_target_ms).")
    tpot_target_ms: float = key(0.0, _AUTO, "Decider v2 avoids a side whose expected time per output token is above "
                                "this many ms while another meets it. 0: no target.")
    ttft_target_ms: float = key(0.0, _AUTO, "Decider v2 avoids a side whose expected time to the first token is "
                                "above this many ms while another meets it. 0: no target.")
    routing_rules: tuple[RoutingRule, ...] = key((), _AUTO, "sysHAX's routing rules, written as "
                                                 "`[[auto.routing_rules]]` tables (name, priority, conditions, "
                                                 "action): the highest-priority rule that matches a request sends it "
                                                 "to its device when that has room; otherwise the decider decides.")
    prefix_routing: bool = key(True, _AUTO, "In a pool of engines that keep their own prefix caches (vLLM), a request "
                               "goes to the engine that was sent its prompt's prefix before; false: to the least "
                               "loaded one.")

    default_max_tokens: int = key(1024, _REQUESTS, "The completion length of chat requests that send no max_tokens "
                                  "(completions default to 16, as OpenAI's).")
    max_messages: int = key(2048, _REQUESTS, 'Messages one chat request may hold (OpenAI\'s limit); past it HTTP 400 '
                            'naming "messages".')
    max_string_bytes: int = key(1 << 20, _REQUESTS, "UTF-8 bytes any one string of a request may hold (a prompt, a "
                                "message's content, a stop sequence); past it HTTP 400 naming the field. At least "
                                "1024.")
    client_timeout: float = key(30.0, _REQUESTS, "Seconds a client may take to send its request head or body, to "
                                "take each piece of a streamed answer, or to send its first byte on a new "
                                "connection; past it the request gets HTTP 408 or is cancelled, or the connection is "
                                "closed.")
    max_queue_size: int = key(64, _REQUESTS, "Requests allowed to wait for a batch slot; past it new requests get "
                              "HTTP 429.")
    request_timeout: float = key(600.0, _REQUESTS, "Seconds a request may wait for its first token before it gets "
                                 "HTTP 503.")

    worker_start_timeout: float = key(300.0, _SUPERVISION, "Seconds a worker may take to load its model before the "
                                      "daemon reports it failed.")
    worker_restart_delay: float = key(1.0, _SUPERVISION, "Seconds to wait before restarting a worker that died.")

    log_level: str = key("info", _OPERATIONS, 'The log level: "debug", "info", "warning" or "error".')

    api_keys: tuple[str, ...] = key((), _SECURITY, 'API keys: when any is set (here or in api_key_file), every /v1/* '
                                    'request must send one as "Authorization: Bearer KEY", else HTTP 401; /health '
                                    "stays open. Prefer api_key_file.")
    api_key_file: str = key("", _SECURITY, "A file with one API key per line (lines starting with # are comments); "
                            '$VARIABLES expand, e.g. "$CREDENTIALS_DIRECTORY/api-keys". An unreadable or empty file '
                            "stops the daemon from starting.")
    metrics_require_key: bool = key(False, _SECURITY, "Whether /metrics needs an API key too (when keys are set); "
                                    "/health never does.")
    web_ui: bool = key(True, _SECURITY, "The web page at / (live status and a chat playground); false: / is a 404.")
    max_connections: int = key(1024, _SECURITY, "The most HTTP connections open at once (idle keep-alive ones count); "
                               "past it a new connection gets HTTP 503 and is closed.")
    worker_heartbeat_timeout: float = key(30.0, _SUPERVISION, "Seconds a loaded worker may send nothing before the "
                                          "daemon kills it as hung and starts a new one (a worker still computing "
                                          "gets up to 4 times as long). Must exceed handoff_timeout; 0 turns the "
                                          "check off.")

    node_listen: str = key("", _NODES, '"host:port": this daemon is a decode node for a front on another host and '
                           "listens there (never on every interface). Empty: not a node.")
    remote_nodes: tuple[str, ...] = key((), _NODES, 'On a front: its decode nodes\' node_listen addresses, e.g. '
                                        '["10.0.0.2:7070", "10.0.0.3:7070"]; a finished prefill goes to the least '
                                        "loaded decoder, local or remote.")
    node_secret_file: str = key("", _NODES, "The file holding the secret a front and its nodes share (at least 16 "
                                "bytes; $VARIABLES expand); only a front that proves it holds it may use a node.")
    node_link_timeout: float = key(3.0, _NODES, "Seconds a node may say nothing (it reports every 0.5 s) before the "
                                   "front drops its link; at least 0.5.")
    node_transfer_protocol: str = key("tcp", _NODES, 'The transport of the transfer engine that moves KV to the nodes: '
                                      '"tcp", or "rdma" where both hosts have NICs for it.')
    node_transfer_device: str = key("", _NODES, 'With rdma: the NIC\'s device name (e.g. "mlx5_0"); unused with tcp.')
    local_decoders: bool = key(True, _NODES, "false: the front runs no decoders of its own and decodes on its remote "
                               "nodes alone (hetero and auto modes).")
    node_front_slots: int = key(0, _NODES, "On a node: the requests each front may run on its decoders at once, so "
                                "one busy front cannot take every slot. 0: no cap.")
    node_tls_cert: str = key("", _NODES, "TLS on the nodes' control channel: this host's certificate (PEM). Set "
                             "node_tls_cert, node_tls_key and node_tls_ca on the front and every node, or none.")
    node_tls_key: str = key("", _NODES, "TLS on the nodes' control channel: this host's private key (PEM).")
    node_tls_ca: str = key("", _NODES, "TLS on the nodes' control channel: the CA that signed the peers' "
                           "certificates; a front checks that a node's certificate names the address it dials.")

    drain_timeout: float = key(30.0, _OPERATIONS, "On SIGTERM the daemon stops admitting requests (new ones get HTTP "
                               "503) and waits up to this many seconds for those it accepted before it stops its "
                               "workers.")
    admin_socket: str = key("", _OPERATIONS, "The Unix socket `syshax status`, `config get/set`, `drain`, `resume`, "
                            "`mode` and `version` talk to. Empty: $RUNTIME_DIRECTORY/admin.sock under systemd, else "
                            "$XDG_RUNTIME_DIR/syshax/admin.sock, else a default; at most 107 bytes.")
    admin_group: str = key("syshax", _OPERATIONS, "Besides root and the daemon's own user, members of this group may "
                           "use the admin socket.")

    # where this config came from, and which of its keys it found outside their tables (not TOML keys)
    source: str = field(default="", compare=False)
    flat_keys: tuple[str, ...] = field(default=(), compare=False)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some keys changed, validated like the file is."""
        merged = {f.name: getattr(self, f.name) for f in fields(self)}
        merged.update(changes)
        return dataclasses.replace(from_mapping(merged, source=self.source), flat_keys=self.flat_keys)

    def model_dir_path(self) -> Path:
        return Path(self.model_dir).expanduser()

    def prefix_cache_dir_path(self, env: Mapping[str, str]) -> Path:
        """The disk tier's folder: prefix_cache_dir, or systemd's CacheDirectory (/var/cache/syshax), or the user's
        cache folder."""
        if self.prefix_cache_dir:
            return Path(self.prefix_cache_dir).expanduser()
        if env.get("CACHE_DIRECTORY"):
            return Path(env["CACHE_DIRECTORY"].split(":")[0]) / "prefix"
        return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "syshax" / "prefix"

    def prefix_block(self) -> int:
        """The prefix cache's block: prefix_block_tokens, or the prefill chunk where that is smaller."""
        return min(self.prefix_block_tokens, self.prefill_chunk_size)


KEYS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Config) if f.name not in ("source", "flat_keys")}


def table_of(key: str) -> str:
    """The TOML table a key lives in ("server", ...); "" for [[models]], an array of tables at the top."""
    return "" if key in TOP_LEVEL_ARRAYS else SECTION_TABLES[KEYS[key].metadata["section"]]


def from_tables(data: Mapping[str, Any], source: str = "") -> tuple[dict[str, Any], tuple[str, ...]]:
    """A parsed TOML document's keys, flat, and those it holds at the top level instead of in their tables (read
    as before: the daemon logs one warning naming their tables). A key in another table than its own, or in both
    places, is a ConfigError naming it."""
    where = source or "config"
    flat: dict[str, Any] = {}
    at_top: list[str] = []
    for name, value in data.items():
        if name in TABLES and name not in KEYS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: {name}: expected the table [{name}] of keys, got {value!r}")
            for inner, inner_value in value.items():
                if inner not in KEYS:
                    raise ConfigError(f"{where}: unknown key [{name}] {inner}; the keys of [{name}]: "
                                      f"{', '.join(k for k in KEYS if table_of(k) == name)}")
                if table_of(inner) != name:
                    home = f"[{table_of(inner)}]" if table_of(inner) else "the top level, as [[models]] tables"
                    raise ConfigError(f"{where}: [{name}] {inner}: {inner} belongs in {home}; move it there")
                if inner in flat:
                    raise ConfigError(f"{where}: {inner} is set twice, at the top level and in [{name}]; keep the "
                                      f"one in [{name}]")
                flat[inner] = inner_value
        elif name not in KEYS and isinstance(value, Mapping):
            raise ConfigError(f"{where}: unknown table [{name}]; the tables: {', '.join(f'[{t}]' for t in TABLES)}, "
                              "and [[models]] entries")
        else:
            if name in flat:
                raise ConfigError(f"{where}: {name} is set twice, at the top level and in [{table_of(name)}]; keep "
                                  f"the one in [{table_of(name)}]")
            flat[name] = value
            if name in KEYS and table_of(name):
                at_top.append(name)
    return flat, tuple(at_top)


def flat_keys_warning(cfg: Config) -> str:
    """The one warning for keys a file holds outside their tables; "" when it holds none."""
    if not cfg.flat_keys:
        return ""
    by_table: dict[str, list[str]] = {}
    for name in cfg.flat_keys:
        by_table.setdefault(table_of(name), []).append(name)
    moves = "; ".join(f"{', '.join(names)} to [{table}]" for table, names in by_table.items())
    return (f"{cfg.source or 'config'}: {len(cfg.flat_keys)} key(s) at the top level, read as before; each now lives "
            f"in a table: move {moves} (`syshax init` writes the documented file with its tables)")


def toml_text(values: Mapping[str, Any]) -> str:
    """A config's `values` (strings, numbers, booleans, arrays, tables) as TOML: each key in its table, one key a
    line, table values written inline."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, (int, float)):
            return json.dumps(v)
        if isinstance(v, str):  # JSON's escapes are TOML's; TOML wants DEL escaped too, and no surrogate pairs
            return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {v!r} as TOML")

    tables: dict[str, list[str]] = {}
    for k, v in values.items():  # each key in its table, as the documented file has them ([server], ...)
        tables.setdefault(table_of(k) if k in KEYS else "", []).append(f"{k} = {value(v)}\n")
    top = "".join(tables.pop("", []))
    return top + "".join(f"[{table}]\n" + "".join(lines) for table, lines in tables.items())


def _check_type(key: str, value: Any) -> Any:
    expected = KEYS[key].type
    if expected == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif expected == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        value = float(value)
    elif expected == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {shown(key, value)}")
    elif expected == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
    elif expected == "tuple[RoutingRule, ...]":
        if isinstance(value, tuple) and all(isinstance(r, RoutingRule) for r in value):
            return value  # parsed already (Config.replace)
        try:
            value = parse_rules(value).rules
        except RuleError as exc:
            raise ConfigError(str(exc)) from None
    elif expected == "tuple[ModelEntry, ...]":
        try:
            value = parse_models(value)
        except EntryError as exc:
            raise ConfigError(str(exc)) from None
    elif expected == "tuple[str, ...]":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) \
                or not all(isinstance(v, str) for v in value):
            raise ConfigError(f'{key}: expected an array of strings, e.g. ["one", "two"], got {shown(key, value)}')
        value = tuple(value)
    return value


# Keys whose values are secrets: logs, errors and the admin socket show them as shown() does.
SECRET_KEYS = frozenset({"api_keys"})


def plain(key: str, value: Any) -> Any:
    """The value as JSON and TOML write it (routing rules as the tables they came from)."""
    if key == "models":
        return models_to_json(value)
    return rules_to_json(value) if key == "routing_rules" else value


def shown(key: str, value: Any) -> str:
    """The value as it may appear in a log line or an error message: secrets are masked."""
    if key in ("routing_rules", "models"):
        return repr(plain(key, value))
    if key not in SECRET_KEYS:
        return repr(value)
    n = len(value) if isinstance(value, (list, tuple)) else 1
    return f"<{n} secret value{'s' if n != 1 else ''}>"


# API keys are HTTP header values: printable ASCII, no spaces.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def check_api_key(key: str, where: str) -> None:
    """Raise ConfigError (naming `where`, never the key) unless `key` can travel as a Bearer token."""
    if not key:
        raise ConfigError(f"{where}: an API key must not be empty")
    if not set(key) <= _KEY_CHARS:
        raise ConfigError(f"{where}: an API key must be printable ASCII without spaces (it travels in the "
                          "Authorization header); generate one with: openssl rand -hex 32")


def _at_least(cfg: Config, key: str, low: float) -> None:
    if getattr(cfg, key) < low:
        raise ConfigError(f"{key}: must be at least {low}, got {getattr(cfg, key)!r}")


def _validate(cfg: Config) -> None:
    """Each table checks its own keys, in the file's order."""
    for table in TABLES:
        VALIDATORS[table](cfg)


def _validate_serve(cfg: Config) -> None:
    if cfg.quantize not in QUANTIZE_TYPES:
        raise ConfigError(f'quantize: must be "" (load every file as it is), "q4_0" or "q8_0" (the type an '
                          f'unquantized F32/F16/BF16 file is quantized to at first load); got {cfg.quantize!r}')
    _at_least(cfg, "max_loaded_models", 0)


def _validate_engines(cfg: Config) -> None:
    at_least = partial(_at_least, cfg)
    if cfg.mode not in MODES:
        raise ConfigError(f"mode: must be one of {', '.join(MODES)}; got {cfg.mode!r}")
    if cfg.repack not in REPACK_SETTINGS:
        raise ConfigError(f'repack: must be "auto" (the fastest kernels that run correctly on this CPU), "on" or '
                          f'"off" (plain kernels); got {cfg.repack!r}')
    at_least("n_ctx", 64)
    at_least("cpu_max_batch_size", 1)
    at_least("threads", 0)
    at_least("prefill_chunk_size", 1)
    at_least("ring_size_mb", 1)
    at_least("handoff_timeout", 0.0)
    for key in ("cpu_engine", "prefill_engine"):
        if not getattr(cfg, key):
            raise ConfigError(f'{key}: must name a backend, e.g. "llamacpp" (see `syshax plugins`)')
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization: must be above 0 and at most 1, got {cfg.gpu_memory_utilization!r}")
    at_least("max_num_seqs", 1)
    at_least("tensor_parallel_size", 1)
    if cfg.preemption_mode not in PREEMPTION_MODES:
        raise ConfigError(f'preemption_mode: must be "recompute" (vLLM\'s v1 engine recomputes a preempted '
                          f'sequence; "swap" went with v0); got {cfg.preemption_mode!r}')
    at_least("worker_start_timeout", 1)
    at_least("worker_restart_delay", 0)
    from syshaxd.sdk.placement import parse_cpulist

    for key in ("cpu_affinity", "prefill_cpu_affinity"):
        value = getattr(cfg, key)
        if value:
            try:
                for part in value.split(";"):
                    parse_cpulist(part, what=key)
            except ValueError as exc:
                raise ConfigError(str(exc) if str(exc).startswith(key) else f"{key}: {exc}") from None
    at_least("worker_heartbeat_timeout", 0)
    if 0 < cfg.worker_heartbeat_timeout <= cfg.handoff_timeout:
        raise ConfigError(f"worker_heartbeat_timeout: must be above handoff_timeout ({cfg.handoff_timeout:g}s, "
                          "which a prefill may spend waiting for ring space) or 0 to turn the check off; "
                          f"got {cfg.worker_heartbeat_timeout:g}")


def _validate_prefix_cache(cfg: Config) -> None:
    at_least = partial(_at_least, cfg)
    at_least("prefix_cache_mb", 0)
    at_least("prefix_cache_disk_gb", 0)
    at_least("prefix_block_tokens", 1)
    at_least("keep_generated_tokens", 0)
    if cfg.prefill_chunk_size % cfg.prefix_block():
        raise ConfigError(f"prefix_block_tokens: {cfg.prefix_block_tokens} does not divide prefill_chunk_size "
                          f"({cfg.prefill_chunk_size}); a cached block must never straddle two prompt chunks. "
                          "Choose a divisor, e.g. 16 with a chunk of 256")


def _validate_speculation(cfg: Config) -> None:
    if not 0 <= cfg.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"speculative_tokens: must be 0 (off) to {MAX_SPECULATIVE_TOKENS} (the most tokens a "
                          f"decode step guesses); got {cfg.speculative_tokens!r}")
    if cfg.draft_model and cfg.speculative_tokens == 0:
        raise ConfigError(f"draft_model: {cfg.draft_model!r} guesses tokens for speculative decoding, which "
                          "speculative_tokens = 0 turns off; set speculative_tokens (1 to "
                          f"{MAX_SPECULATIVE_TOKENS}) or leave draft_model empty")


def _validate_auto(cfg: Config) -> None:
    at_least = partial(_at_least, cfg)
    if not 0.0 < cfg.gpu_cache_threshold <= 100.0:
        raise ConfigError(f"gpu_cache_threshold: a percent above 0 and at most 100, got {cfg.gpu_cache_threshold!r}")
    at_least("cpu_throughput_threshold", 0.0)
    if cfg.token_limit_multiplier <= 0:
        raise ConfigError(f"token_limit_multiplier: must be above 0, got {cfg.token_limit_multiplier!r}")
    at_least("token_limit_min", 1)
    if cfg.decider not in DECIDERS:
        raise ConfigError(f'decider: must be "thresholds" (sysHAX 0.2.0\'s offload thresholds) or "measured" (v2: '
                          f'where a request\'s decode is expected faster); got {cfg.decider!r}')
    at_least("tpot_target_ms", 0.0)
    at_least("ttft_target_ms", 0.0)
    if cfg.token_limit_max < cfg.token_limit_min:
        raise ConfigError(f"token_limit_max: must be at least token_limit_min ({cfg.token_limit_min}), "
                          f"got {cfg.token_limit_max}")


def _validate_server(cfg: Config) -> None:
    at_least = partial(_at_least, cfg)
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port: must be 0..65535, got {cfg.port}")
    at_least("max_body_bytes", 1024)
    at_least("default_max_tokens", 1)
    at_least("max_messages", 1)
    at_least("max_string_bytes", 1024)
    at_least("client_timeout", 0.1)
    at_least("max_queue_size", 0)
    at_least("request_timeout", 0.001)
    for i, key in enumerate(cfg.api_keys):
        check_api_key(key, f"api_keys[{i}]")
    # api_key_file is read when the daemon starts or reloads (api.core.auth.configured_keys), not here:
    # a Config.replace (`syshax mode`, `config set`) must not touch the disk
    at_least("max_connections", 1)
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}; got {cfg.log_level!r}")
    at_least("drain_timeout", 0)
    if cfg.admin_socket and len(os.fsencode(os.path.abspath(os.path.expanduser(cfg.admin_socket)))) > 107:
        raise ConfigError(f"admin_socket: a Unix socket path must be at most 107 bytes, got {cfg.admin_socket!r}; "
                          "choose a shorter path")


TRANSFER_PROTOCOLS = ("tcp", "rdma")  # the transfer engine's transports (syshaxd/remote/transfer.py)
ALL_INTERFACES = frozenset({"0.0.0.0", "::", "*"})


def split_address(address: str, key: str) -> tuple[str, int]:
    """("host", port) from a decode node's "host:port" (IPv6 in brackets); ValueError naming the config `key`."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f'{key}: expected "host:port", e.g. "10.0.0.2:7070"; got {address!r}')
    return host, int(port)


def _validate_nodes(cfg: Config) -> None:
    try:
        if cfg.node_listen:
            host, _ = split_address(cfg.node_listen, "node_listen")
            if host in ALL_INTERFACES:
                raise ConfigError(f"node_listen: {host!r} is every interface; name the address the front reaches "
                                  "this node at (a node listens only where its front is)")
        for i, address in enumerate(cfg.remote_nodes):
            split_address(address, f"remote_nodes[{i}]")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.node_listen and cfg.remote_nodes:
        raise ConfigError("node_listen and remote_nodes: a daemon is a decode node (node_listen) or a front with "
                          "nodes (remote_nodes), not both")
    if cfg.node_transfer_protocol not in TRANSFER_PROTOCOLS:
        raise ConfigError(f"node_transfer_protocol: must be one of {', '.join(TRANSFER_PROTOCOLS)}; "
                          f"got {cfg.node_transfer_protocol!r}")
    if cfg.node_front_slots < 0:
        raise ConfigError(f"node_front_slots: must be 0 (no cap) or more, got {cfg.node_front_slots!r}")
    if cfg.node_link_timeout < 0.5:
        raise ConfigError(f"node_link_timeout: must be at least 0.5 (a node reports every 0.5 s), "
                          f"got {cfg.node_link_timeout!r}")
    tls = {"node_tls_cert": cfg.node_tls_cert, "node_tls_key": cfg.node_tls_key, "node_tls_ca": cfg.node_tls_ca}
    if any(tls.values()) and not all(tls.values()):
        raise ConfigError(f"{', '.join(k for k, v in tls.items() if not v)}: TLS on the nodes' channel needs all of "
                          "node_tls_cert, node_tls_key and node_tls_ca (each side shows its certificate and checks "
                          "the other's), or none of them")
    if not cfg.local_decoders and not (cfg.remote_nodes and cfg.mode in ("hetero", "auto")):
        raise ConfigError("local_decoders = false: needs remote_nodes and mode hetero or auto (the decoders are "
                          "then the remote nodes' alone)")


VALIDATORS: dict[str, Callable[[Config], None]] = {
    "server": _validate_server, "serve": _validate_serve, "engines": _validate_engines,
    "prefix_cache": _validate_prefix_cache, "speculation": _validate_speculation, "auto": _validate_auto,
    "nodes": _validate_nodes,
}


def coerce(key: str, text: str) -> Any:
    """Turn a command-line string into the type `key` holds (for `syshax config KEY VALUE`)."""
    if key not in KEYS:
        raise ConfigError(f"unknown key {key!r}; known keys: {', '.join(sorted(KEYS))}")
    kind = KEYS[key].type
    if kind == "bool":
        if text.lower() in ("true", "yes", "on", "1"):
            return True
        if text.lower() in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {text!r}")
    if kind == "tuple[ModelEntry, ...]":  # a JSON array of tables, as [[models]] holds them
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f'{key}: expected a JSON array of tables, e.g. [{{"name": "embed", "path": '
                              '"/models/embed.gguf"}]') from None
    if kind == "tuple[RoutingRule, ...]":  # a JSON array of rule tables, as [[auto.routing_rules]] holds them
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f'{key}: expected a JSON array of rules, e.g. [{{"name": "long answers", "priority": '
                              '10, "conditions": [{"field": "max_tokens", "operator": "gte", "value": 1024}], '
                              '"action": {"device": "CPU"}}]') from None
    if kind == "tuple[str, ...]":  # a JSON array, or words separated by commas
        if text.strip().startswith("["):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                raise ConfigError(f'{key}: expected a JSON array of strings, e.g. ["one", "two"]') from None
            return _check_type(key, parsed)
        return tuple(part.strip() for part in text.split(",") if part.strip())
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {'an integer' if kind == 'int' else 'a number'}, got {text!r}") from None
    return text


def from_mapping(data: Mapping[str, Any], source: str = "") -> Config:
    """Build and validate a Config from a flat mapping of keys (a parsed TOML document)."""
    unknown = sorted(set(data) - set(KEYS) - {"source", "flat_keys"})
    if unknown:
        raise ConfigError(
            f"{source or 'config'}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(KEYS))}"
        )
    values = {k: _check_type(k, v) for k, v in data.items() if k not in ("source", "flat_keys")}
    cfg = Config(source=source, **values)
    _validate(cfg)
    return cfg


def find_config(explicit: str | None) -> Path | None:
    """The config file to read: `explicit`, else $SYSHAX_CONFIG, ./etc/syshax.toml, SYSTEM_CONFIG; None: defaults."""
    if explicit:
        return Path(explicit)
    for candidate in (os.environ.get("SYSHAX_CONFIG"), "etc/syshax.toml", str(SYSTEM_CONFIG)):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def load(path: str | os.PathLike | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a TOML file (None: built-in defaults), its keys in their tables or (as before) at the top level; apply
    overrides (command-line flags); validate."""
    data: dict[str, Any] = {}
    source = ""
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {source} does not exist; create one with `syshax init {source}`") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return from_document(data, source, overrides)


def from_document(document: Mapping[str, Any], source: str = "",
                  overrides: Mapping[str, Any] | None = None) -> Config:
    """A parsed TOML document (its keys in their tables, or at the top level), with overrides by key (None: not
    set), validated. load reads a file into it; `syshax config` checks an edited document with it before saving."""
    data, flat = from_tables(document, source)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return dataclasses.replace(from_mapping(data, source=source), flat_keys=flat)
