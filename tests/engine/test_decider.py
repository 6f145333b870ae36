"""The offload decider over a table of engine states: each threshold alone, both sides full, CPU slow."""

import pytest

from syshaxd.engine.decider import Decision, EngineState, Thresholds, decide, token_limit

T = Thresholds(max_num_seqs=4, gpu_cache_threshold=90, cpu_throughput_threshold=20, cpu_max_batch_size=8,
               token_limit_multiplier=2.0, token_limit_min=32, token_limit_max=512)
IDLE_CPU = EngineState(running=0, waiting=0, kv_usage=0.0, tokens_per_second=0.0)
FAST_CPU = EngineState(running=3, waiting=0, kv_usage=0.1, tokens_per_second=120.0)


@pytest.mark.parametrize(
    "gpu, cpu, route, why",
    [
        (EngineState(1, 0, 0.2), IDLE_CPU, "gpu", "room"),
        (EngineState(4, 0, 0.2), IDLE_CPU, "hetero", "max_num_seqs"),
        (EngineState(2, 1, 0.2), FAST_CPU, "hetero", "waiting"),
        (EngineState(2, 0, 0.95), FAST_CPU, "hetero", "KV cache"),
        (EngineState(2, 0, 0.90), FAST_CPU, "gpu", "room"),  # at the threshold is not over it
        (EngineState(4, 2, 0.99), EngineState(8, 0, 0.5, 200.0), "refuse", "CPU batch full"),
        (EngineState(4, 0, 0.2), EngineState(2, 0, 0.1, 5.0), "refuse", "slow"),
        (EngineState(4, 0, 0.2), EngineState(0, 0, 0.0, 5.0), "hetero", "offloading"),  # slow but idle
    ],
)
def test_decisions(gpu, cpu, route, why):
    d = decide(gpu, cpu, T)
    assert d.verdict == route and why in d.reason, d


def test_token_limit_is_throughput_times_multiplier_rounded_and_clamped():
    assert token_limit(0, T) == 32
    assert token_limit(61, T) == 120
    assert token_limit(10_000, T) == 512
    assert decide(EngineState(4, 0, 0), FAST_CPU, T) == Decision(
        "hetero", "GPU running 4 >= max_num_seqs 4; offloading decode to the CPU", 240)


def test_token_rate_counts_a_window_of_recent_steps():
    import time

    from syshaxd.sdk.rate import TokenRate

    rate = TokenRate(window=5.0)
    assert rate.per_second() == 0.0
    rate.add(8)
    time.sleep(0.1)
    rate.add(8)
    assert 60 < rate.per_second() < 170  # 16 tokens over ~0.1 s


# --- decider v2: where a request's decode is expected faster, within the targets ----------------------------------

from syshaxd.engine.decider import Targets, decide_measured  # noqa: E402
from syshaxd.engine.estimates import Estimates, SideSpeed  # noqa: E402

ROOM = EngineState(1, 0, 0.2)
FULL = EngineState(4, 0, 0.2)
NOTHING = SideSpeed(None, None, 0, None)


def speed(tpot_ms, ttft_ms=None):
    return SideSpeed(tpot_ms / 1000, ttft_ms / 1000 if ttft_ms is not None else None, 100, 1.0)


@pytest.mark.parametrize("gpu, cpu, gpu_speed, cpu_speed, targets, route, why", [
    # the GPU engine has room, but its decode is measured slower: the request decodes on the CPU
    (ROOM, IDLE_CPU, speed(80), speed(20), Targets(), "hetero", "CPU is faster"),
    (ROOM, IDLE_CPU, speed(20), speed(80), Targets(), "gpu", "GPU is faster"),
    (ROOM, IDLE_CPU, speed(30), speed(30), Targets(), "gpu", "GPU is faster"),  # a tie stays on the GPU
    # a side that misses a target is avoided while the other meets them
    (ROOM, IDLE_CPU, speed(20, ttft_ms=900), speed(40, ttft_ms=100), Targets(ttft_ms=500), "hetero",
     "the other side misses the targets"),
    (ROOM, IDLE_CPU, speed(20), speed(40), Targets(tpot_ms=10), "gpu", "no side meets the targets"),
    # no room on the faster side: the other, if it has room
    (FULL, IDLE_CPU, speed(10), speed(40), Targets(), "hetero", "GPU full"),
    (ROOM, EngineState(8, 0, 0.5, 100.0), speed(90), speed(10), Targets(), "gpu", "CPU batch full"),
    # both full: the thresholds (refuse: queued for the GPU engine)
    (FULL, EngineState(8, 0, 0.5, 100.0), speed(90), speed(10), Targets(), "refuse", "CPU batch full"),
    # a side never measured: the thresholds decide, and say why
    (ROOM, IDLE_CPU, speed(90), NOTHING, Targets(), "gpu", "the CPU side is not measured yet"),
])
def test_measured_decisions(gpu, cpu, gpu_speed, cpu_speed, targets, route, why):
    d = decide_measured(gpu, cpu, T, gpu_speed, cpu_speed, targets)
    assert d.verdict == route and why in d.reason, d
    assert d.by == ("measured" if "not measured" not in why and route != "refuse" else "thresholds")


def test_estimates_follow_the_last_observations_by_side_and_route():
    e = Estimates()
    assert e.side("gpu", "gpu").tpot_s is None
    for _ in range(50):
        e.tokens("gpu", 0.05, 1)
        e.tokens("cpu", 0.08, 2)  # two tokens in 80 ms: 40 ms each
    e.first_token("hetero", 0.3)
    assert abs(e.side("gpu", "gpu").tpot_s - 0.05) < 1e-3 and abs(e.side("cpu", "hetero").tpot_s - 0.04) < 1e-3
    assert e.side("cpu", "hetero").ttft_s == 0.3 and e.side("gpu", "gpu").ttft_s is None
    for _ in range(60):  # the GPU side slows down: the estimate follows within a few dozen tokens
        e.tokens("gpu", 0.2, 1)
    assert 0.19 < e.side("gpu", "gpu").tpot_s <= 0.2
    assert e.to_json()["tpot_ms"] == {"gpu": pytest.approx(200, abs=10), "cpu": 40.0}
