"""sysHAX's PD-offload decider, made a pure function of engine state and typed thresholds.

The GPU engine serves while it can; when it is saturated (running at max_num_seqs, a waiting
queue, or KV usage over gpu_cache_threshold) a new request's decode goes to the CPU workers,
unless they are full too (then the request is refused) — as the seed's scheduler decided,
from live worker state rather than scraped Prometheus text.
"""

from __future__ import annotations

from dataclasses import dataclass

from syshaxd.engine.estimates import SideSpeed
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
    # what decided: "thresholds" (0.2.0's), "measured" (v2), "rule:NAME", "gpu_not_ready", "logprobs"
    by: str = "thresholds"

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


@dataclass(frozen=True)
class Targets:
    """Decider v2's service targets, in ms (0: none)."""

    tpot_ms: float = 0.0
    ttft_ms: float = 0.0


def _speed_words(name: str, side: SideSpeed) -> str:
    assert side.tpot_s is not None  # only measured sides are named
    ttft = f", TTFT {1000 * side.ttft_s:.0f} ms" if side.ttft_s is not None else ""
    return f"{name} {1 / side.tpot_s:.1f} tok/s per request (TPOT {1000 * side.tpot_s:.1f} ms{ttft})"


def decide_measured(gpu: EngineState, cpu: EngineState, t: Thresholds, gpu_speed: SideSpeed, cpu_speed: SideSpeed,
                    targets: Targets) -> Decision:
    """Decider v2, sysHAX's later rule made explicit: a new request goes to the side where its decode is expected
    faster -- the GPU engine (gpu route) or a CPU worker after the GPU engine's prefill (hetero) -- among the sides
    with room whose expected TPOT and TTFT meet the targets (all sides with room when none does). Room: the GPU
    engine by the thresholds (running, waiting, KV), the CPU side a free batch slot. Until both sides have been
    measured, and when neither has room, the thresholds decide."""
    fallback = decide(gpu, cpu, t)
    if gpu_speed.tpot_s is None or cpu_speed.tpot_s is None:
        unmeasured = "GPU" if gpu_speed.tpot_s is None else "CPU"
        return Decision(fallback.route, f"{fallback.reason} (the {unmeasured} side is not measured yet)",
                        fallback.token_limit)
    gpu_room = fallback.route == Route.GPU
    cpu_room = cpu.running < t.cpu_max_batch_size
    sides = [(Route.GPU, gpu_speed) for _ in range(gpu_room)] + [(Route.HETERO, cpu_speed) for _ in range(cpu_room)]
    if not sides:
        return fallback

    def meets(speed: SideSpeed) -> bool:
        return ((not targets.tpot_ms or 1000 * (speed.tpot_s or 0.0) <= targets.tpot_ms)  # both measured (above)
                and (not targets.ttft_ms or speed.ttft_s is None or 1000 * speed.ttft_s <= targets.ttft_ms))

    within = [s for s in sides if meets(s[1])]
    route, speed = min(within or sides, key=lambda s: (s[1].tpot_s, s[0] != Route.GPU))
    where = "GPU" if route == Route.GPU else "CPU"
    why = [_speed_words("GPU", gpu_speed), _speed_words("CPU", cpu_speed)]
    if not gpu_room:
        why.append(f"GPU full ({fallback.reason.split(';')[0]})")
    if not cpu_room:
        why.append(f"CPU batch full ({cpu.running}/{t.cpu_max_batch_size})")
    if (targets.tpot_ms or targets.ttft_ms) and not within:
        why.append("no side meets the targets")
    elif len(within) < len(sides):
        why.append("the other side misses the targets")
    limit = token_limit(cpu.tokens_per_second, t) if route == Route.HETERO else 0
    return Decision(route, f"{'; '.join(why)}: {where} is faster", limit, by="measured")
