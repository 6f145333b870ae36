"""Prometheus metrics for /metrics: per-request latencies and tokens, and engine state read at scrape time.

Names follow vLLM's where the meaning is the same, so dashboards built for vLLM
work unchanged (label ``model_name``, as vLLM's):

  vllm:time_to_first_token_seconds     histogram  arrival at the API -> first generated token
  vllm:time_per_output_token_seconds   histogram  gap between successive output tokens (vLLM's older name)
  vllm:inter_token_latency_seconds     histogram  the same observations under vLLM's newer name
  vllm:e2e_request_latency_seconds     histogram  arrival -> last token, finished requests
  vllm:request_prompt_tokens           histogram  prompt tokens per finished request
  vllm:request_generation_tokens       histogram  generated tokens per finished request
  vllm:prompt_tokens_total             counter    prompt tokens of every accepted request
  vllm:generation_tokens_total         counter    tokens generated (what clients are billed as usage)
  vllm:request_success_total           counter    finished requests by finished_reason
  vllm:num_requests_running            gauge      sequences in an engine's running batch
  vllm:num_requests_waiting            gauge      accepted sequences waiting for a batch slot (queue depth)
  vllm:kv_cache_usage_perc             gauge      KV cells in use over all CPU engines, 0..1

and syshax's own (``syshax_`` prefix): HTTP requests by route/method/status,
batch occupancy and slots per worker, worker readiness and restarts, requests
in flight, capacity, refusals and routes, requests that outlived (or lost) their worker, draining, and the KV handoff of
hetero mode — ring capacity/used bytes/occupancy, records written/read/failed,
bytes moved, fallbacks by reason, handoff latency quantiles — and the prefix
cache: prompt tokens looked up and found (vLLM's prefix_cache_queries and
prefix_cache_hits, as syshax_prefix_cache_queries_total / _hits_total), blocks
stored and evicted, bytes held, and its disk tier (syshax_prefix_cache_disk_*: bytes held and
its budget, blocks, bytes written and read back, hits, evictions, corrupt files). Engine state is
read from ``Scheduler.status()`` (a typed SchedulerStatus) when Prometheus scrapes, never
cached; the KV series read its ``kv`` part, and are zero (latency: absent) while there is none.

Every series lives in a registry this object owns, never prometheus_client's
global default one, so two daemons in one process (tests) do not collide.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from syshaxd import __version__
from syshaxd.engine.kv_ledger import KVStatus
from syshaxd.engine.prefix_cache import PrefixStatus
from syshaxd.engine.status import AutoStatus, SchedulerStatus
from syshaxd.recent import Recent
from syshaxd.engine.lifecycle import HandleState

log = logging.getLogger(__name__)

# seconds; TTFT spans a warm short prompt on a GPU to a long prompt queued on CPU cores
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    """The daemon's metrics: observed around each request, and engine gauges collected at scrape time."""

    def __init__(self, model_name: str, status: Callable[[], SchedulerStatus],
                 service: Callable[[], dict] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self.http_requests = Counter("syshax_http_requests", "HTTP requests answered, by route, method and status.",
                                     ["route", "method", "status"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency of finished requests in seconds.",
                             m, buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               m, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", m,
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", m, registry=r)
        # what every token adds (its gap, as vLLM's two histograms, and the count): kept here, read at each scrape
        self.tokens = TokenSeries(model_name)
        r.register(self.tokens)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finished_reason.",
                                       m + ["finished_reason"], registry=r)
        # the one model's series, at zero from the start as dashboards expect, and looked up once (.labels() takes a
        # lock and builds its key each time)
        self.served = ServedSeries(
            self.ttft.labels(model_name), self.e2e.labels(model_name), self.request_prompt_tokens.labels(model_name),
            self.request_generation_tokens.labels(model_name), self.prompt_tokens.labels(model_name))
        r.register(_EngineCollector(model_name, status, service or (lambda: {})))
        self.recent = Recent()  # the last minutes, for the web page (/v1/syshax/status "recent")

    def request(self) -> "RequestTimer":
        """Start timing one generation request (call at its arrival)."""
        return RequestTimer(self)

    def count_http(self, route: str, method: str, status: int) -> None:
        self.http_requests.labels(route, method, str(status)).inc()

    def render(self, accept: str | None = None, others: Iterable[Metric] = ()) -> tuple[bytes, str]:
        """The exposition in the format the scraper asks for (Accept), and its content type; `others`: families of
        other models (the chat models of [[models]], each under its model_name), their samples added to this
        daemon's families of the same name."""
        encode, content_type = choose_encoder(accept or "")  # Prometheus' text 0.0.4 unless OpenMetrics is asked for
        return encode(_Merged(self.registry, list(others))), content_type


class _Merged:
    """A registry's families with other models' samples of the same families added (a family once, as the
    exposition formats require), and the other families after them."""

    def __init__(self, registry: CollectorRegistry, others: list[Metric]) -> None:
        self.registry = registry
        self.others = others

    def collect(self) -> Iterator[Metric]:
        extra: dict[str, list] = {}
        for family in self.others:
            extra.setdefault(family.name, []).append(family)
        for family in self.registry.collect():
            for other in extra.pop(family.name, []):
                family.samples.extend(other.samples)
            yield family
        for families in extra.values():
            first = families[0]
            for other in families[1:]:
                first.samples.extend(other.samples)
            yield first


@dataclass(frozen=True)
class ServedSeries:
    """The served model's series of the per-request metrics (model_name is its label)."""

    ttft: Histogram
    e2e: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    prompt_tokens: Counter


class TokenSeries:
    """What every generated token adds, kept as plain numbers and exposed at each scrape: the tokens generated
    (vllm:generation_tokens) and the gaps between successive tokens (vllm:time_per_output_token_seconds and
    vllm:inter_token_latency_seconds, the same observations under vLLM's older and newer names).

    A stream adds to these once per token. prometheus_client's Histogram takes a lock for its sum and again for its
    bucket at every observation (four for the two histograms, five with the counter); here it is a bisect and a
    few additions, and n gaps of one event's tokens (which share its gap) are one. Only the event loop's thread
    adds and scrapes, so nothing is locked."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.bounds = TPOT_BUCKETS
        self.gap_counts = [0] * (len(self.bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self.gap_sum = 0.0
        self.generated = 0

    def add(self, n: int, gaps: int, gap: float) -> None:
        """n tokens arrived in one event, `gaps` of them after a gap of `gap` seconds each."""
        self.generated += n
        if gaps:
            self.gap_counts[bisect_left(self.bounds, gap)] += gaps  # le is inclusive: a gap on a bound is in it
            self.gap_sum += gaps * gap

    def describe(self):
        return []  # unchecked, as _EngineCollector: the registry learns the names when it collects

    def collect(self) -> Iterator[Metric]:
        label = [self.model_name]
        generated = CounterMetricFamily("vllm:generation_tokens", "Tokens generated.", labels=["model_name"])
        generated.add_metric(label, self.generated)
        yield generated
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.gap_counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        for name, doc in (("vllm:time_per_output_token_seconds",
                           "Time per output token (gap between successive tokens) in seconds."),
                          ("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.")):
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, buckets, self.gap_sum)
            yield family


class RequestTimer:
    """One request's timings: accepted (prompt tokens), tokens as they arrive, finished."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._s = metrics.served
        self._label = metrics.model_name
        self.arrival = time.monotonic()
        self.prompt_tokens = 0
        self.generated = 0
        self._last: float | None = None  # when the latest token arrived
        self._done = False

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._s.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """n tokens arrived together (one event); their gap is shared out among them."""
        if n <= 0:
            return
        now = time.monotonic()
        s = self._s
        if self._last is None:
            s.ttft.observe(now - self.arrival)
            self._m.recent.first_token(now - self.arrival)
            gaps, gap = n - 1, 0.0
        else:
            gaps, gap = n, (now - self._last) / n
        self._m.tokens.add(n, gaps, gap)
        self._m.recent.tokens(n, gaps, gap)
        self._last = now
        self.generated += n

    def finished(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        s = self._s
        s.e2e.observe(time.monotonic() - self.arrival)
        s.request_prompt_tokens.observe(self.prompt_tokens)
        s.request_generation_tokens.observe(self.generated)
        self._m.request_success.labels(self._label, reason).inc()
        self._m.recent.finished()


def _embedding_families(models):
    """The embedding models and rerankers of [[models]], each under its own model_name."""
    labels = ["model_name"]
    loaded = GaugeMetricFamily("syshax_embedding_model_loaded", "1 while an embedding model's worker is ready, "
                               "else 0 (unloaded, loading, restarting or failed).", labels=labels)
    requests = CounterMetricFamily("syshax_embedding_requests", "Embeddings requests an embedding model answered, "
                                   "rerank requests a reranker answered (refused ones included).", labels=labels)
    inputs = CounterMetricFamily("syshax_embedding_inputs", "Inputs an embedding model made vectors of (a "
                                 "reranker's: documents it scored).", labels=labels)
    tokens = CounterMetricFamily("syshax_embedding_tokens", "Tokens of the inputs an embedding model made vectors "
                                 "of, or of the pairs a reranker scored (usage.prompt_tokens).", labels=labels)
    for m in models:
        loaded.add_metric([m.name], 1.0 if m.state == HandleState.READY else 0.0)
        requests.add_metric([m.name], m.requests)
        inputs.add_metric([m.name], m.inputs)
        tokens.add_metric([m.name], m.tokens)
    yield from (loaded, requests, inputs, tokens)


def _chat_model_families(models):
    """The chat models of [[models]], each served by its own daemon (whose own /metrics has its engine's figures)."""
    labels = ["model_name"]
    loaded = GaugeMetricFamily("syshax_chat_model_loaded", "1 while a chat model of [[models]] has its daemon "
                               "ready, else 0 (unloaded, starting or failed).", labels=labels)
    requests = CounterMetricFamily("syshax_chat_model_requests", "Requests passed on to a chat model of "
                                   "[[models]] (those its daemon could not be reached for included).", labels=labels)
    loads = CounterMetricFamily("syshax_chat_model_loads", "Times a chat model of [[models]] was loaded (its "
                                "daemon started).", labels=labels)
    memory = GaugeMetricFamily("syshax_chat_model_resident_bytes", "Resident memory of a chat model's daemon and "
                               "its workers; 0 while unloaded.", labels=labels)
    for m in models:
        loaded.add_metric([m.name], 1.0 if m.state == HandleState.READY else 0.0)
        requests.add_metric([m.name], m.requests)
        loads.add_metric([m.name], m.loads)
        memory.add_metric([m.name], m.rss_mib * 2**20)
    yield from (loaded, requests, loads, memory)


class _EngineCollector:
    """Gauges and counters read from Scheduler.status() (and the service's own state) at each scrape."""

    def __init__(self, model_name: str, status: Callable[[], SchedulerStatus], service: Callable[[], dict]) -> None:
        self.model_name = model_name
        self.status = status
        self.service = service

    def describe(self):
        return []  # unchecked: the families depend on what status() holds at scrape time

    def collect(self) -> Iterator[Metric]:
        try:
            status = self.status()
            service = self.service() or {}
        except Exception:  # a scrape must not fail because the engine state is odd for a moment
            log.exception("could not read the scheduler's status for /metrics")
            return
        yield from self._engines(status)
        yield from self._daemon(status, service)
        yield from self._kv(status.kv)
        yield from self._prefix(status.prefix_cache)
        if status.auto is not None:
            yield from self._auto(status.auto)
        if status.nodes:
            yield from self._nodes(status.nodes)
        if status.embedding_models:
            yield from _embedding_families(status.embedding_models)
        if status.chat_models:
            yield from _chat_model_families(status.chat_models)

    def _nodes(self, nodes):
        yield from _node_families(nodes)

    def _engines(self, status: SchedulerStatus):
        m = [self.model_name]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in an engine's running batch.",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a batch slot.",
                                    labels=["model_name"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage over all engines; 1 means 100 percent.",
                               labels=["model_name"])
        occupancy = GaugeMetricFamily("syshax_batch_occupancy", "Running sequences over batch slots, per worker (0..1).",
                                      labels=["worker", "role"])
        slots = GaugeMetricFamily("syshax_batch_slots", "Batch slots (sequences decoded together), per worker.",
                                  labels=["worker", "role"])
        up = GaugeMetricFamily("syshax_worker_ready", "1 if the engine worker is loaded and serving.",
                               labels=["worker", "role", "backend", "state"])
        restarts = CounterMetricFamily("syshax_worker_restarts", "Times the supervisor restarted the worker.",
                                       labels=["worker"])
        n_run = n_wait = 0
        cells = used = 0.0
        for w in status.workers:
            stats = w.stats
            n_run += stats.running
            n_wait += stats.waiting
            if stats.max_batch_size:
                occupancy.add_metric([w.name, w.role], stats.running / stats.max_batch_size)
                slots.add_metric([w.name, w.role], stats.max_batch_size)
                weight = stats.max_batch_size * stats.n_ctx
                cells += weight
                used += weight * stats.kv_usage
            up.add_metric([w.name, w.role, w.backend, w.state], 1.0 if w.state == HandleState.READY else 0.0)
            restarts.add_metric([w.name], float(w.restarts))
        running.add_metric(m, n_run)
        waiting.add_metric(m, n_wait)
        kv.add_metric(m, used / cells if cells else 0.0)
        yield from (running, waiting, kv, occupancy, slots, up, restarts)

    def _daemon(self, status: SchedulerStatus, service: dict):
        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            return g

        yield gauge("syshax_requests_in_flight", "Requests held by engine workers.", status.in_flight)
        yield gauge("syshax_capacity", "Requests the daemon holds at once: batch slots plus the queue.",
                    status.capacity)
        yield gauge("syshax_ready", "1 once every engine worker is loaded.", 1 if status.ready else 0)
        yield gauge("syshax_draining", "1 while the daemon takes no new requests (shutdown or syshax drain).",
                    1 if service.get("draining") else 0)
        yield gauge("syshax_http_generations_active", "Completion requests the API admitted and has not finished.",
                    service.get("active", 0))
        yield _labelled(CounterMetricFamily, "syshax_requests_refused", "Requests refused by the scheduler, by reason.",
                        "reason", status.refused)
        yield _labelled(CounterMetricFamily, "syshax_requests_rescued",
                        "Requests whose worker died under them: resent (before their first token), resumed (after, "
                        "with the tokens so far) or lost (ended with the error).", "outcome", status.rescued)
        yield _labelled(CounterMetricFamily, "syshax_requests_routed", "Requests routed, by route (cpu, hetero, ...).",
                        "route", status.routes)
        info = GaugeMetricFamily("syshax_info", "The daemon's version and mode (value 1).", labels=["version", "mode"])
        info.add_metric([__version__, str(status.mode)], 1.0)
        yield info

    def _kv(self, kv: KVStatus | None):
        ring = kv.ring if kv is not None else None
        for family, name, doc, value in (
                (GaugeMetricFamily, "syshax_kv_ring_capacity_bytes", "Size of the shared-memory KV ring.",
                 ring and ring.capacity),
                (GaugeMetricFamily, "syshax_kv_ring_used_bytes", "Bytes of the KV ring held by records.",
                 ring and ring.used_bytes),
                (GaugeMetricFamily, "syshax_kv_ring_occupancy", "Used over capacity of the KV ring (0..1).",
                 ring and ring.occupancy),
                (CounterMetricFamily, "syshax_kv_records_written", "KV records the prefill side wrote.",
                 kv and kv.records_written),
                (CounterMetricFamily, "syshax_kv_records_read", "KV records a decoder imported.",
                 kv and kv.records_read),
                (CounterMetricFamily, "syshax_kv_records_failed", "KV records a decoder could not use.",
                 kv and kv.records_failed),
                (CounterMetricFamily, "syshax_kv_bytes_moved", "Bytes of KV handed from prefill to decode.",
                 kv and kv.bytes_moved)):
            yield _single(family, name, doc, value)
        yield _labelled(CounterMetricFamily, "syshax_kv_fallbacks",
                        "Requests whose decoder recomputed the prompt instead of importing it.", "reason",
                        kv.fallbacks if kv else {})
        latency = kv.handoff_latency_s if kv else None
        if latency is not None and latency.count:
            g = GaugeMetricFamily("syshax_kv_handoff_latency_seconds",
                                  "Prefill-to-decode handoff latency over recent requests, by quantile.",
                                  labels=["quantile"])
            for quantile, value in (("0.5", latency.p50), ("0.9", latency.p90), ("0.99", latency.p99)):
                g.add_metric([quantile], value)
            yield g

    def _prefix(self, cache: PrefixStatus | None):
        for family, name, doc, value in (
                (CounterMetricFamily, "syshax_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 cache and cache.queries),
                (CounterMetricFamily, "syshax_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.",
                 cache and cache.hits),
                (CounterMetricFamily, "syshax_prefix_cache_blocks_stored", "Blocks written to the cache.",
                 cache and cache.stored),
                (CounterMetricFamily, "syshax_prefix_cache_generated_blocks",
                 "Of the blocks written, blocks of generated tokens (keep_generated_tokens).",
                 cache and cache.generated),
                (CounterMetricFamily, "syshax_prefix_cache_evictions", "Cached blocks evicted for new ones.",
                 cache and cache.evictions),
                (GaugeMetricFamily, "syshax_prefix_cache_used_bytes", "Bytes of the prefix cache holding blocks.",
                 cache and cache.bytes),
                (GaugeMetricFamily, "syshax_prefix_cache_capacity_bytes", "Size of the prefix cache (prefix_cache_mb).",
                 cache and cache.capacity_bytes)):
            yield _single(family, name, doc, value)
        disk = cache.disk if cache is not None else None
        for family, name, doc, count in (
                (GaugeMetricFamily, "syshax_prefix_cache_disk_used_bytes", "Bytes of block files in the prefix "
                 "cache's disk tier.", disk and disk.bytes),
                (GaugeMetricFamily, "syshax_prefix_cache_disk_capacity_bytes", "Size of the disk tier "
                 "(prefix_cache_disk_gb, or half the free space where that is less).", disk and disk.capacity_bytes),
                (GaugeMetricFamily, "syshax_prefix_cache_disk_blocks", "Blocks the disk tier holds.",
                 disk and disk.blocks),
                (CounterMetricFamily, "syshax_prefix_cache_disk_written_bytes", "Bytes written to the disk tier.",
                 disk and disk.bytes_written),
                (CounterMetricFamily, "syshax_prefix_cache_disk_read_bytes", "Bytes read back from the disk tier.",
                 disk and disk.bytes_read),
                (CounterMetricFamily, "syshax_prefix_cache_disk_hits", "Blocks read back from the disk tier into "
                 "shared memory for a prompt.", disk and disk.loaded),
                (CounterMetricFamily, "syshax_prefix_cache_disk_evictions", "Block files removed to stay within the "
                 "disk tier's budget.", disk and disk.evictions),
                (CounterMetricFamily, "syshax_prefix_cache_disk_corrupt", "Block files that failed their checksum or "
                 "identity when read (deleted; their tokens computed again).", disk and disk.corrupt)):
            yield _single(family, name, doc, count)

    def _auto(self, auto: AutoStatus):
        yield _labelled(CounterMetricFamily, "syshax_auto_decisions", "auto mode's offload decisions, by outcome "
                        "(gpu, hetero: decode offloaded to the CPU, refuse: both sides full).", "decision",
                        auto.decisions)
        yield _labelled(CounterMetricFamily, "syshax_auto_decided_by", "What placed auto mode's requests: "
                        "rule:NAME (a routing rule), measured (decider v2), thresholds (0.2.0's), gpu_not_ready, "
                        "logprobs.", "by", auto.decided_by)
        matched = CounterMetricFamily("syshax_routing_rule_matches", "Requests a routing rule matched, by whether "
                                      "its device had room (routed) or the decider decided (no_room).",
                                      labels=["rule", "outcome"])
        for rule in auto.rules:
            n, without = auto.rules_matched.get(rule, 0), auto.rules_without_room.get(rule, 0)
            matched.add_metric([rule, "routed"], float(n - without))
            matched.add_metric([rule, "no_room"], float(without))
        yield matched
        for name, value, doc in (("reconsidered", auto.reconsidered,
                                  "Offloaded decodes reconsidered after their token limit."),
                                 ("moved_to_gpu", auto.moved_to_gpu,
                                  "Offloaded decodes that moved back to the GPU engine.")):
            c = CounterMetricFamily(f"syshax_auto_{name}", doc)
            c.add_metric([], float(value))
            yield c


def _node_families(nodes):
    """Per decode node on another host: its link, the KV records and bytes written to it, and how long each took."""
    up = GaugeMetricFamily("syshax_node_up", "1 while the link to the decode node is up.", labels=["node"])
    transfers = CounterMetricFamily("syshax_node_transfers", "KV records written into the node's ring.",
                                    labels=["node"])
    failures = CounterMetricFamily("syshax_node_transfer_failures", "KV records that did not reach the node (its "
                                   "decoder recomputed the prompt).", labels=["node"])
    moved = CounterMetricFamily("syshax_node_bytes_moved", "Bytes of KV written to the node.", labels=["node"])
    lost = CounterMetricFamily("syshax_node_links_lost", "Times the link to the node went down.", labels=["node"])
    seconds = GaugeMetricFamily("syshax_node_transfer_seconds", "Seconds per KV record sent to the node (room asked "
                                "for, then the write), over the last 1000.", labels=["node", "quantile"])
    for n in nodes:
        up.add_metric([n.address], 1.0 if n.link == "up" else 0.0)
        transfers.add_metric([n.address], float(n.transfers))
        failures.add_metric([n.address], float(n.transfer_failures))
        moved.add_metric([n.address], float(n.bytes_moved))
        lost.add_metric([n.address], float(n.links_lost))
        for q in ("p50", "p90", "p99"):
            seconds.add_metric([n.address, f"0.{q[1:]}"], getattr(n.transfer_seconds, q))
    return up, transfers, failures, moved, lost, seconds


def _single(family, name: str, doc: str, value):
    """One unlabelled series; zero while what it counts does not exist (no ring, no prefix cache)."""
    metric = family(name, doc)
    metric.add_metric([], float(value or 0))
    return metric


def _labelled(family, name: str, doc: str, label: str, counts: dict):
    f = family(name, doc, labels=[label])
    for key, n in counts.items():
        f.add_metric([str(key)], float(n))
    return f
