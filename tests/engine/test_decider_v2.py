"""Decider v2 (decider = "measured") in a daemon: a new auto request goes where its decode is measured faster.

auto mode with a llama.cpp "GPU" engine on CPU 0 and a CPU decoder on CPU 1; SYSHAX_SLOW makes one of them slower
by a known time per step (sdk/faults.py), so the test knows which side is faster and can assert the decision.
"""

from __future__ import annotations

import signal

import pytest

from conftest import MODEL_NAME, http_json, start_daemon, wait_for

pytestmark = pytest.mark.slow

# speculation off: SYSHAX_SLOW slows a side per step, and these tests take a step for a token (with guesses a
# slowed llama.cpp step gave 1 to 9 tokens of "Count with me", its TPOT under the target meant to be missed)
AUTO = {"mode": "auto", "prefill_engine": "llamacpp", "prefill_cpu_affinity": "0", "max_num_seqs": 4,
        "cpu_max_batch_size": 4, "n_ctx": 1024, "model_name": MODEL_NAME, "decider": "measured",
        "speculative_tokens": 0}


def complete(d, prompt: str, max_tokens: int = 12, mode: str | None = None) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if mode:
        body["syshax"] = {"mode": mode}
    code, answer = http_json(f"{d.url}/v1/completions", body, timeout=120)
    assert code == 200, answer
    return answer


def measure_both_sides(d) -> dict:
    for i in range(2):
        complete(d, f"Count with me {i}:", 16, mode="gpu")
        complete(d, f"Count with me {i}:", 16, mode="hetero")
    return d.status()["auto"]["estimates"]


@pytest.mark.parametrize("slow, faster", [("gpu0=0.06", "hetero"), ("decode0=0.06", "gpu")])
def test_a_request_goes_where_its_decode_is_measured_faster(default_model, tmp_path, slow, faster):
    d = start_daemon(tmp_path, {"model": str(default_model), **AUTO}, env={"SYSHAX_SLOW": slow})
    try:
        # before both sides are measured, the thresholds decide (the GPU engine has room)
        first = complete(d, "Hello")["syshax"]
        assert first["route"] == "gpu" and first["decided_by"] == "thresholds"
        assert "not measured yet" in first["reason"]
        tpot = measure_both_sides(d)["tpot_ms"]
        slower, quicker = ("gpu", "cpu") if faster == "hetero" else ("cpu", "gpu")
        assert tpot[slower] > tpot[quicker] + 30, tpot  # 60 ms of sleep per step on the slowed side
        for i in range(3):  # the GPU engine has room all along: only the measurements send these to the CPU
            note = complete(d, f"Tell me about {i}")["syshax"]
            assert note["route"] == faster and note["decided_by"] == "measured", note
            assert f"{'CPU' if faster == 'hetero' else 'GPU'} is faster" in note["reason"]
        # the same load under 0.2.0's thresholds (a live key: reloaded) stays on the GPU engine while it has room
        d.config_path.write_text(d.config_path.read_text().replace('decider = "measured"',
                                                                    'decider = "thresholds"'))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in d.log(), 30, "the reload")
        assert complete(d, "Tell me about 9")["syshax"] == {"route": "gpu", "reason": "GPU has room",
                                                           "decided_by": "thresholds"}
        assert d.status()["auto"]["decider"] == "thresholds"
    finally:
        assert d.stop() == 0, d.log()


def test_when_no_side_meets_the_target_the_faster_takes_the_request(default_model, tmp_path):
    """The GPU engine slowed to ~60 ms a token, the CPU decoder to ~90: a 50 ms TPOT target is missed by both, so
    the faster (the GPU) still takes it, and the answer says so."""
    d = start_daemon(tmp_path, {"model": str(default_model), **AUTO, "tpot_target_ms": 50.0},
                     env={"SYSHAX_SLOW": "gpu0=0.06,decode0=0.09"})
    try:
        measure_both_sides(d)
        note = complete(d, "Hello there")["syshax"]
        assert note["route"] == "gpu" and "no side meets the targets" in note["reason"], note
    finally:
        assert d.stop() == 0, d.log()
