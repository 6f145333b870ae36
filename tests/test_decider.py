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
