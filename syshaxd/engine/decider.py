"""sysHAX's PD-offload decider, made a pure function of engine state and typed thresholds.

The GPU engine serves while it can; when it is saturated (running at max_num_seqs, a waiting
queue, or KV usage over gpu_cache_threshold) a new request's decode goes to the CPU workers,
unless they are full too (then the request is refused) — as the seed's scheduler decided,
from live worker state rather than scraped Prometheus text.
"""

from __future__ import annotations

from dataclasses import dataclass

from syshaxd.sdk.types import Route


@dataclass(frozen=True)
class Thresholds:
    max_num_seqs: int  # GPU sequences at which it counts as full
    gpu_cache_threshold: float  # percent of the GPU KV cache in use past which it counts as full
    cpu_throughput_threshold: float  # tokens/s below which a busy CPU side takes no more work
    cpu_max_batch_size: int
    token_limit_multiplier: float
    token_limit_min: int
    token_limit_max: int


@dataclass(frozen=True)
class EngineState:
    running: int
    waiting: int
    kv_usage: float  # 0..1
    tokens_per_second: float = 0.0


@dataclass(frozen=True)
class Decision:
    """Where an auto request goes: the GPU engine, its prompt there and its decode on a CPU worker (hetero), a CPU
    worker alone (while the GPU engine is not ready); None: nowhere yet, both sides are full."""

    route: Route | None
    reason: str
    token_limit: int = 0  # CPU decode budget before the request is reconsidered; 0: none

    @property
    def verdict(self) -> str:
        """The decision in a word, as the status counts it: a route, or "refuse"."""
        return self.route or "refuse"


def token_limit(cpu_tokens_per_second: float, t: Thresholds) -> int:
    """The seed's budget: CPU throughput times the multiplier, rounded to tens, clamped."""
    raw = int(round(cpu_tokens_per_second * t.token_limit_multiplier, -1))
    return min(max(raw, t.token_limit_min), t.token_limit_max)


def decide(gpu: EngineState, cpu: EngineState, t: Thresholds) -> Decision:
    if gpu.running >= t.max_num_seqs:
        why = f"GPU running {gpu.running} >= max_num_seqs {t.max_num_seqs}"
    elif gpu.waiting > 0:
        why = f"GPU has {gpu.waiting} waiting"
    elif gpu.kv_usage * 100 > t.gpu_cache_threshold:
        why = f"GPU KV cache {gpu.kv_usage * 100:.1f}% > {t.gpu_cache_threshold:g}%"
    else:
        return Decision(Route.GPU, "GPU has room")
    if cpu.running >= t.cpu_max_batch_size:
        return Decision(None, f"{why}; CPU batch full ({cpu.running}/{t.cpu_max_batch_size})")
    if cpu.running >= 1 and cpu.tokens_per_second < t.cpu_throughput_threshold:
        return Decision(None, f"{why}; CPU busy and slow ({cpu.tokens_per_second:.0f} tok/s < "
                                  f"{t.cpu_throughput_threshold:g})")
    return Decision(Route.HETERO, f"{why}; offloading decode to the CPU", token_limit(cpu.tokens_per_second, t))
