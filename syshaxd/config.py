"""The daemon's configuration: one typed object, read from TOML once, validated, passed down."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Mapping

from syshaxd.engine.routing_rules import RoutingRule, RuleError, parse_rules, rules_to_json
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


@dataclass(frozen=True)
class Config:
    """Every key of syshaxd/etc/syshax.toml; the file documents each one."""

    # HTTP endpoint
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024

    # what to serve
    mode: str = "cpu"
    model: str = ""  # a GGUF path; empty serves the prepared default model
    model_name: str = ""  # the id clients send as "model"; empty: derived from the file
    model_dir: str = "models"  # where the default model is prepared and quantized copies cached
    quantize: str = "q4_0"  # an F32/F16/BF16 GGUF is quantized to this at first load (cached); quantized ones stay

    # CPU engine (llama.cpp)
    cpu_engine: str = "llamacpp"  # the backend plugin of the CPU workers ("syshax plugins" lists them)
    n_ctx: int = 4096  # the most tokens one request may hold (prompt + completion), per sequence
    cpu_max_batch_size: int = 8  # sequences decoded together in one llama_decode
    threads: int = 0  # 0: OMP_NUM_THREADS, else the number of CPUs in the worker's set
    cpu_affinity: str = ""  # cpulists, ";" between workers ("0-3;4-7"); CUSTOM_CPU_AFFINITY overrides it
    prefill_chunk_size: int = 256  # prompt tokens per step, so a long prompt does not stall the batch
    prefix_cache_mb: int = 512  # prompt KV kept for reuse (automatic prefix caching) in /dev/shm; 0: off
    # the prefix cache's disk tier: every block is copied to a file, so that a prompt seen before is a hit after
    # shared memory evicted it or the daemon restarted (engine/prefix_disk.py); 0: off
    prefix_cache_disk_gb: float = 8.0
    # where its files go; "": $CACHE_DIRECTORY/prefix (systemd's CacheDirectory), else ~/.cache/syshax/prefix
    prefix_cache_dir: str = ""
    prefix_block_tokens: int = 16  # a shared prefix is reused in steps of this many tokens (vLLM's block)
    keep_generated_tokens: int = 512  # of each answer, kept in the prefix cache for a chat's next turn; 0: none
    # every llama.cpp worker tiles every query row's attention: every route and a resume give the same tokens
    tiled_attention: bool = True
    repack: str = "auto"  # llama.cpp's repacked weight kernels (llama-server's --repack): auto, on, off
    # speculative decoding: the most tokens of a request's own context a decode step guesses and checks; 0: off
    speculative_tokens: int = 8
    # a GGUF of a smaller model of the same vocabulary whose tokens are the guesses; "": the request's own context
    draft_model: str = ""

    # hetero mode: a prefill worker hands each prompt's KV to the decode workers through a ring
    prefill_cpu_affinity: str = ""  # the prefill worker's CPUs ("0-3;4-7": one GPU engine each); "": a quarter of
    # the first node's
    gpu_devices: str = ""  # "0;1": one GPU engine per device (CUDA_VISIBLE_DEVICES each); "": one engine
    ring_size_mb: int = 256  # the shared-memory KV ring in /dev/shm
    handoff_timeout: float = 2.0  # seconds a prefill waits for ring space before the decoder recomputes
    prefill_engine: str = "llamacpp"  # the backend plugin of the prefill worker ("syshax plugins" lists them)
    # the GPU engine (vLLM): prefill_engine in hetero mode, the one engine in gpu mode
    gpu_memory_utilization: float = 0.8  # of the device's memory for weights and KV (vLLM-CPU: KV sized from n_ctx)
    max_num_seqs: int = 16  # sequences the GPU engine runs at once
    tensor_parallel_size: int = 1  # GPUs one model is split across (gpu mode; prefill takes 1)
    preemption_mode: str = "recompute"  # what vLLM does to a sequence it must pause: only "recompute" (v1)

    # auto mode (sysHAX's auto_pd_offload): the GPU engine serves while it can; when it is saturated a
    # new request's decode goes to the CPU workers
    gpu_cache_threshold: float = 90.0  # percent of the GPU engine's KV cache in use past which it is saturated
    cpu_throughput_threshold: float = 2.0  # tokens/s under which a busy CPU side takes no more offloaded decodes
    token_limit_multiplier: float = 2.0  # an offloaded decode is reconsidered after CPU tokens/s times this tokens
    token_limit_min: int = 16  # ... but after no fewer tokens than this
    token_limit_max: int = 512  # ... and no more than this
    # which decider places a new auto request: "thresholds" (sysHAX 0.2.0's: the GPU engine while it has room) or
    # "measured" (v2: where its decode is expected faster, within tpot_target_ms and ttft_target_ms)
    decider: str = "thresholds"
    tpot_target_ms: float = 0.0  # decider v2 avoids a side whose expected time per output token is above it; 0: none
    ttft_target_ms: float = 0.0  # ... or whose expected time to the first token is; 0: none
    # [[routing_rules]]: sysHAX's soft rules on request fields, highest priority first (engine/routing_rules.py)
    routing_rules: tuple[RoutingRule, ...] = ()
    # a pool of engines that keep their own prefix caches (vLLM): a request goes where its prompt's prefix is
    prefix_routing: bool = True

    # requests
    default_max_tokens: int = 1024  # chat requests without max_tokens
    max_messages: int = 2048  # messages in one chat request (OpenAI's limit); past it 400 naming "messages"
    max_string_bytes: int = 1 << 20  # UTF-8 bytes of any one string in a request; past it 400 naming the field
    client_timeout: float = 30.0  # seconds a client may take to send its body, take a piece of its stream,
    # send a request head, or send the first byte on a new connection
    max_queue_size: int = 64  # requests waiting for a batch slot before 429
    request_timeout: float = 600.0  # seconds a request may wait for a slot before 503

    # worker supervision
    worker_start_timeout: float = 300.0
    worker_restart_delay: float = 1.0

    log_level: str = "info"

    # --- security and limits: API keys, connections, hung workers ---
    api_keys: tuple[str, ...] = ()  # when any key is set (here or in api_key_file), /v1/* needs one as a Bearer token
    api_key_file: str = ""  # one key per line (# comments); $VARS expand, e.g. "$CREDENTIALS_DIRECTORY/api-keys"
    metrics_require_key: bool = False  # /metrics needs an API key too (/health never does)
    web_ui: bool = True  # GET / serves the status page and chat playground (api/web_routes.py)
    max_connections: int = 1024  # open HTTP connections; past it a new one gets 503 and is closed
    worker_heartbeat_timeout: float = 30.0  # seconds a ready worker may send nothing before it is killed; 0: off

    # --- decode nodes on other hosts (syshaxd/remote/): the front writes each prompt's KV into a node's ring ---
    node_listen: str = ""  # "host:port": this daemon is a decode node that serves its front there; "": not a node
    remote_nodes: tuple[str, ...] = ()  # a front's decode nodes, "host:port" each (their node_listen)
    node_secret_file: str = ""  # the secret a front and its nodes share (at least 16 bytes); $VARS expand
    node_link_timeout: float = 3.0  # seconds a node may say nothing before its link is dropped
    node_transfer_protocol: str = "tcp"  # the transfer engine's transport: tcp, or rdma where NICs have it
    node_transfer_device: str = ""  # rdma: the NIC's device name (e.g. "mlx5_0"); tcp: unused
    local_decoders: bool = True  # false: the front decodes only on its remote nodes (hetero and auto modes)
    node_front_slots: int = 0  # on a node: the requests each front may run on its decoders at once; 0: no cap
    # TLS on the control channel, off when all three are empty: this host's certificate and key (PEM), and the CA
    # that signed its peers' (a front and its nodes each check the other's; $VARS expand)
    node_tls_cert: str = ""
    node_tls_key: str = ""
    node_tls_ca: str = ""

    # --- operations: shutdown drain, admin socket. Keep this block last. ---
    drain_timeout: float = 30.0  # seconds SIGTERM waits for accepted requests before stopping workers
    admin_socket: str = ""  # the admin Unix socket; empty: $RUNTIME_DIRECTORY, else a default (api/admin.py)
    admin_group: str = "syshax"  # members may use the admin socket (besides root and the daemon's user)

    # where this config came from (not a TOML key)
    source: str = field(default="", compare=False)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some keys changed, validated like the file is."""
        merged = {f.name: getattr(self, f.name) for f in fields(self)}
        merged.update(changes)
        return from_mapping(merged, source=self.source)

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


KEYS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Config) if f.name != "source"}


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
    return rules_to_json(value) if key == "routing_rules" else value


def shown(key: str, value: Any) -> str:
    """The value as it may appear in a log line or an error message: secrets are masked."""
    if key == "routing_rules":
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


def _validate(cfg: Config) -> None:
    def at_least(key: str, low: float) -> None:
        if getattr(cfg, key) < low:
            raise ConfigError(f"{key}: must be at least {low}, got {getattr(cfg, key)!r}")

    if cfg.mode not in MODES:
        raise ConfigError(f"mode: must be one of {', '.join(MODES)}; got {cfg.mode!r}")
    if cfg.quantize not in QUANTIZE_TYPES:
        raise ConfigError(f'quantize: must be "" (load every file as it is), "q4_0" or "q8_0" (the type an '
                          f'unquantized F32/F16/BF16 file is quantized to at first load); got {cfg.quantize!r}')
    if cfg.repack not in REPACK_SETTINGS:
        raise ConfigError(f'repack: must be "auto" (the fastest kernels that run correctly on this CPU), "on" or '
                          f'"off" (plain kernels); got {cfg.repack!r}')
    if not 0 <= cfg.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"speculative_tokens: must be 0 (off) to {MAX_SPECULATIVE_TOKENS} (the most tokens a "
                          f"decode step guesses); got {cfg.speculative_tokens!r}")
    if cfg.draft_model and cfg.speculative_tokens == 0:
        raise ConfigError(f"draft_model: {cfg.draft_model!r} guesses tokens for speculative decoding, which "
                          "speculative_tokens = 0 turns off; set speculative_tokens (1 to "
                          f"{MAX_SPECULATIVE_TOKENS}) or leave draft_model empty")
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}; got {cfg.log_level!r}")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port: must be 0..65535, got {cfg.port}")
    at_least("max_body_bytes", 1024)
    at_least("n_ctx", 64)
    at_least("cpu_max_batch_size", 1)
    at_least("threads", 0)
    at_least("prefill_chunk_size", 1)
    at_least("ring_size_mb", 1)
    at_least("prefix_cache_mb", 0)
    at_least("prefix_cache_disk_gb", 0)
    at_least("prefix_block_tokens", 1)
    at_least("keep_generated_tokens", 0)
    if cfg.prefill_chunk_size % cfg.prefix_block():
        raise ConfigError(f"prefix_block_tokens: {cfg.prefix_block_tokens} does not divide prefill_chunk_size "
                          f"({cfg.prefill_chunk_size}); a cached block must never straddle two prompt chunks. "
                          "Choose a divisor, e.g. 16 with a chunk of 256")
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
    at_least("default_max_tokens", 1)
    at_least("max_messages", 1)
    at_least("max_string_bytes", 1024)
    at_least("client_timeout", 0.1)
    at_least("max_queue_size", 0)
    at_least("request_timeout", 0.001)
    at_least("worker_start_timeout", 1)
    at_least("worker_restart_delay", 0)
    from syshaxd.sdk.placement import parse_cpulist

    for key, several in (("cpu_affinity", True), ("prefill_cpu_affinity", True)):
        value = getattr(cfg, key)
        if value:
            try:
                for part in value.split(";") if several else [value]:
                    parse_cpulist(part, what=key)
            except ValueError as exc:
                raise ConfigError(str(exc) if str(exc).startswith(key) else f"{key}: {exc}") from None
    # --- security and limits ---
    for i, key in enumerate(cfg.api_keys):
        check_api_key(key, f"api_keys[{i}]")
    # api_key_file is read when the daemon starts or reloads (api.auth.configured_keys), not here:
    # a Config.replace (`syshax mode`, `config set`) must not touch the disk
    at_least("max_connections", 1)
    at_least("worker_heartbeat_timeout", 0)
    if 0 < cfg.worker_heartbeat_timeout <= cfg.handoff_timeout:
        raise ConfigError(f"worker_heartbeat_timeout: must be above handoff_timeout ({cfg.handoff_timeout:g}s, "
                          "which a prefill may spend waiting for ring space) or 0 to turn the check off; "
                          f"got {cfg.worker_heartbeat_timeout:g}")
    _validate_nodes(cfg)
    # --- operations ---
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
    if kind == "tuple[RoutingRule, ...]":  # a JSON array of rule tables, as [[routing_rules]] holds them
        import json

        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f'{key}: expected a JSON array of rules, e.g. [{{"name": "long answers", "priority": '
                              '10, "conditions": [{"field": "max_tokens", "operator": "gte", "value": 1024}], '
                              '"action": {"device": "CPU"}}]') from None
    if kind == "tuple[str, ...]":  # a JSON array, or words separated by commas
        if text.strip().startswith("["):
            import json

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
    unknown = sorted(set(data) - set(KEYS) - {"source"})
    if unknown:
        raise ConfigError(
            f"{source or 'config'}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(KEYS))}"
        )
    values = {k: _check_type(k, v) for k, v in data.items() if k != "source"}
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
    """Read a TOML file (None: built-in defaults), apply overrides (command-line flags), validate."""
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
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return from_mapping(data, source=source)
