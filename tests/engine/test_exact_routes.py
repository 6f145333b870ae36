"""The README's greedy promises, route by route, undisturbed and disturbed, on long answers (tests/greedy.py).

* cpu mode is the reference: 8 chats of 128 tokens, at once.
* hetero (llama.cpp prefill) returns exactly those tokens, and still does with its decoder killed twice under it.
* cpu mode with its worker killed twice under it returns them (a resume recomputes prompt + tokens so far: with every
  query row's attention tiled a token has the same bits from that prompt pass as from the decode step that made it).
* auto (a llama.cpp "GPU" engine of two sequences, offloading the rest and moving decodes back every 8 tokens)
  returns them, with a decoder killed under it too.
* each daemon says so in its status (`exact`), and says why not where it cannot hold (tiled_attention = false).

tests/remote/test_remote.py holds the same texts against a decode node on another host, killed and cut off.
"""

from __future__ import annotations

import pytest

from conftest import MODEL_NAME, start_daemon
from greedy import answer_all, assert_same, kill_mid_stream

pytestmark = pytest.mark.slow

BASE = {"model_name": MODEL_NAME, "n_ctx": 1024}


@pytest.fixture(scope="module")
def cpu(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("cpu"), {"model": str(default_model), **BASE})
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def reference(cpu):
    """cpu mode, undisturbed: what every route must give back."""
    got = answer_all(cpu)
    assert [n for _, n, _ in got] == [128] * len(got)
    return got


@pytest.fixture(scope="module")
def hetero(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("hetero"), {"model": str(default_model), "mode": "hetero",
                                                          "prefill_cpu_affinity": "0", **BASE})
    yield d
    assert d.stop() == 0, d.log()


def test_cpu_mode_says_a_resume_keeps_the_text(cpu):
    exact = cpu.status()["exact"]
    assert exact == {"hetero_equals_cpu": None, "resume_exact": True, "why": []}
    assert cpu.status()["workers"][0]["attention"] == "tiled"


def test_hetero_returns_cpu_modes_tokens(hetero, reference):
    assert_same(answer_all(hetero), reference, "hetero against cpu mode")
    status = hetero.status()
    assert status["exact"] == {"hetero_equals_cpu": True, "resume_exact": True, "why": []}
    assert {w["name"]: (w["attention"], w["exact_decode"]) for w in status["workers"]} == {
        "prefill0": ("tiled", True), "decode0": ("tiled", True)}
    assert status["kv"]["fallbacks"] == {}  # every answer came through the ring, none recomputed


def test_hetero_with_its_decoder_killed_twice_returns_cpu_modes_tokens(hetero, reference):
    before = hetero.status()["rescued"]
    got = answer_all(hetero, during=lambda: kill_mid_stream(hetero, "decode0"))
    assert_same(got, reference, "hetero, decode0 killed twice")
    after = hetero.status()["rescued"]
    assert after["resumed"] > before["resumed"] and after["lost"] == before["lost"]
    # the restarted decoder kept its proofs rather than proving them again
    assert "proofs kept from this worker's earlier warm-up" in hetero.log()
    assert hetero.status()["exact"]["resume_exact"] is True


def test_cpu_mode_with_its_worker_killed_twice_returns_its_own_tokens(cpu, reference):
    before = cpu.status()["rescued"]
    got = answer_all(cpu, during=lambda: kill_mid_stream(cpu, "cpu0"))
    assert_same(got, reference, "cpu mode, cpu0 killed twice")
    after = cpu.status()["rescued"]
    assert after["resumed"] > before["resumed"] and after["lost"] == before["lost"]


def test_auto_offloads_and_moves_back_with_cpu_modes_tokens(default_model, tmp_path, reference):
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "auto", "prefill_engine": "llamacpp",
                                "prefill_cpu_affinity": "0", "max_num_seqs": 2, "cpu_max_batch_size": 8,
                                "token_limit_min": 8, "token_limit_max": 8, **BASE})
    try:
        assert_same(answer_all(d), reference, "auto against cpu mode")
        auto = d.status()["auto"]
        assert auto["decisions"].get("hetero", 0) > 0 and auto["moved_to_gpu"] > 0, auto
        got = answer_all(d, during=lambda: kill_mid_stream(d, "decode0", times=1))
        assert_same(got, reference, "auto, decode0 killed")
        assert d.status()["exact"] == {"hetero_equals_cpu": True, "resume_exact": True, "why": []}
    finally:
        assert d.stop() == 0, d.log()


def test_without_tiled_attention_the_status_says_what_is_not_exact(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "prefill_cpu_affinity": "0",
                                "tiled_attention": False, **BASE})
    try:
        exact = d.status()["exact"]
        assert exact["hetero_equals_cpu"] is False and exact["resume_exact"] is False
        assert any(line.startswith("decode0 runs llama.cpp's own attention (tiled_attention = false in the config)")
                   for line in exact["why"]), exact
    finally:
        assert d.stop() == 0, d.log()
