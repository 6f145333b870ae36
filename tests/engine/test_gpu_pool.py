"""Pools of GPU engines (prefill engines in hetero mode): several side by side, least loaded first, one that dies
leaving its pool while it restarts and coming back when ready, backends of several kinds in one pool.

On this host the "GPU" engines are llama.cpp (and torch) workers on CPUs: prefill_cpu_affinity "0;1" puts one on
each CPU, "0;0" two on CPU 0 beside the decoder on CPU 1.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal

import pytest

from conftest import MODEL_NAME, http_json, start_daemon, wait_for
from teacher_forced import hf_folder  # noqa: F401 -- the torch engine's copy of the model
from syshaxd.config import Config
from syshaxd.engine.plan import PlanError, split_pool

pytestmark = pytest.mark.slow


def test_the_pool_the_config_asks_for():
    assert [(e.backend, e.cpus, e.devices) for e in split_pool("vllm", "", "0;1")] == [
        ("vllm", "", "0"), ("vllm", "", "1")]
    assert [(e.backend, e.cpus) for e in split_pool("vllm,torch", "0-3;4-7", "")] == [("vllm", "0-3"), ("torch", "4-7")]
    assert [e.devices for e in split_pool("vllm", "", "0,1;2,3")] == ["0,1", "2,3"]
    with pytest.raises(PlanError, match="prefill_cpu_affinity: 2 entries, but the GPU pool has 3 engines"):
        split_pool("vllm", "0;1", "0;1;2")
    Config(prefill_cpu_affinity="0;1")  # ";" lists are valid in the config
    with pytest.raises(ValueError, match="prefill_cpu_affinity"):
        Config().replace(prefill_cpu_affinity="0;x")


def complete(d, prompt: str, max_tokens: int = 24) -> dict:
    code, body = http_json(f"{d.url}/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                                        "max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True}, timeout=120)
    assert code == 200, body
    return body


def worker(d, name: str) -> dict:
    return next(w for w in d.status()["workers"] if w["name"] == name)


def served_by(d, names, at_least: int = 0) -> dict:
    """Requests each named worker finished, once they add up to at_least (a worker reports every half second)."""
    def counts():
        got = {n: worker(d, n)["stats"]["finished"] for n in names}
        return got if sum(got.values()) >= at_least else None
    return wait_for(counts, 10, f"{at_least} requests finished on {names}")


def run_load(d, n: int = 8) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return [a["choices"][0]["text"] for a in pool.map(lambda i: complete(d, f"Story number {i}:"), range(n))]


def test_a_gpu_pool_shares_the_load_and_a_dead_engine_leaves_it_and_comes_back(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "gpu",
                                "prefill_engine": "llamacpp", "prefill_cpu_affinity": "0;1", "max_num_seqs": 4,
                                "n_ctx": 1024, "worker_restart_delay": 1.0})
    try:
        assert d.status()["pools"]["gpu"] == {"serving": ["gpu0", "gpu1"], "out": []}
        assert [worker(d, n)["cpus"] for n in ("gpu0", "gpu1")] == [[0], [1]]
        expected = run_load(d)
        both = served_by(d, ["gpu0", "gpu1"], 8)
        assert all(v > 0 for v in both.values()), both  # least loaded first: both engines answered
        victim = worker(d, "gpu0")["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: any(o.startswith("gpu0 (") for o in d.status()["pools"]["gpu"]["out"]), 10,
                 "gpu0 out of its pool")
        assert d.status()["pools"]["gpu"]["serving"] == ["gpu1"]
        before = served_by(d, ["gpu1"])["gpu1"]
        assert run_load(d, 4) == expected[:4]  # gpu1 alone serves meanwhile, the same texts
        served_by(d, ["gpu1"], before + 4)
        wait_for(lambda: d.status()["pools"]["gpu"]["serving"] == ["gpu0", "gpu1"], 60, "gpu0 back in its pool")
        assert worker(d, "gpu0")["pid"] != victim
        assert run_load(d) == expected
        served_by(d, ["gpu0"], 1)  # taken back: the restarted engine serves again
    finally:
        assert d.stop() == 0, d.log()


def test_a_pool_of_two_backends_side_by_side_in_hetero_mode(default_model, hf_folder, tmp_path):
    """llama.cpp and torch prefill engines together on CPU 0: requests go to both, and one that asks for what one
    of them lacks (logprobs travel with llama.cpp's records only) is refused naming it."""
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "hetero",
                                "prefill_engine": "llamacpp,torch", "prefill_cpu_affinity": "0;0", "n_ctx": 1024})
    try:
        assert [(w["name"], w["backend"]) for w in d.status()["workers"]] == [
            ("prefill0", "llamacpp"), ("prefill1", "torch"), ("decode0", "llamacpp")]
        run_load(d, 6)
        kv = d.status()["kv"]
        assert kv["records_written"] >= 6 and kv["fallbacks"] == {}, (kv, d.status()["workers"])
        assert all(v > 0 for v in served_by(d, ["prefill0", "prefill1"], 6).values())
        code, body = http_json(f"{d.url}/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                                            "logprobs": 1})
        assert code == 400 and body["error"]["param"] == "logprobs" and "torch" in body["error"]["message"]
    finally:
        assert d.stop() == 0, d.log()


def test_a_chat_turn_goes_to_the_engine_holding_its_prefix_unless_that_one_is_too_busy():
    """engine/prefix_routing.py on its own: which engine was sent which blocks, and the slack load may take."""
    from types import SimpleNamespace

    from syshaxd.engine.prefix_routing import SLACK, PrefixRouting

    routing = PrefixRouting()
    a, b = SimpleNamespace(name="gpu0", in_flight=0), SimpleNamespace(name="gpu1", in_flight=0)
    turn1 = list(range(1000, 1100))  # 6 whole blocks
    turn2 = turn1 + list(range(2000, 2060))  # the conversation so far, then the next message
    first = routing.choose([a, b], turn1)
    other = b if first is a else a
    first.in_flight = SLACK  # busier, but within the slack: the prefix wins
    assert routing.choose([a, b], turn2) is first
    assert routing.to_json() == {"placed_by_prefix": 1, "matched_blocks": 6, "placed_by_load": 1}
    first.in_flight = SLACK + 1  # too busy: load wins
    assert routing.choose([a, b], turn2 + list(range(3000, 3040))) is other
    routing.forget(first.name)  # restarted: its cache is gone
    first.in_flight = 0
    assert routing._run(first.name, [1, 2]) == 0
