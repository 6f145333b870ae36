"""Every family llama.cpp serves, in cpu mode and in hetero: a tiny random-weight model of each (tests/families.py,
written by llama.cpp's own converter), given as the F16 file a user converts, quantized to q4_0 at first load.

* cpu mode serves each: several greedy chats at once, every answer its full length, and the warm-up proves the
  exact promises (a decode step gives a prompt chunk's bits) at head sizes 64, 96, 128 and 256, with MoE layers,
  q/k norms, QKV biases and sliding-window layers.
* hetero (a llama.cpp prefill worker handing each prompt's KV to a decoder over the ring) returns cpu mode's tokens
  for every family whose KV the record carries; a family with sliding-window layers (gemma 2 and 3) is refused at
  start, naming the family, never served with wrong tokens.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from conftest import MODEL_DIR, MODEL_NAME, start_daemon
from families import FAMILIES, make_family_model
from greedy import CHATS, answer, client_of

from syshaxd.engine.plan import SLIDING_WINDOW_ARCHS

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
# chats without a system message: Gemma's templates refuse one
FAMILY_CHATS = [c for c in CHATS if all(m["role"] != "system" for m in c)]
BASE = {"model_name": MODEL_NAME, "n_ctx": 512}


def _model(family: str):
    return make_family_model(family, MODEL_DIR / "families")


def _answers(daemon) -> list[tuple[str, int, str]]:
    client = client_of(daemon)
    with concurrent.futures.ThreadPoolExecutor(len(FAMILY_CHATS)) as pool:
        futures = [pool.submit(answer, client, m, i % 2 == 1, None, MAX_TOKENS) for i, m in enumerate(FAMILY_CHATS)]
        return [f.result() for f in futures]


def _serve(tmp_path_factory, family: str, mode: str):
    config = {"model": str(_model(family)), "model_dir": str(tmp_path_factory.getbasetemp() / f"cache-{family}"),
              "mode": mode, **BASE}
    return start_daemon(tmp_path_factory.mktemp(f"{family}-{mode}"),
                        config | ({"prefill_cpu_affinity": "0"} if mode == "hetero" else {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_serves_in_cpu_mode_and_hetero_returns_its_tokens(family, tmp_path_factory):
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        status = cpu.status()
        assert status["model_file"]["file_type"] == "F16" and status["model_file"]["quantized_to"] == "q4_0"
        # the quantized copy's output matrix is q8_0, whose products are exact: the promises hold in every family
        assert status["exact"] == {"hetero_equals_cpu": None, "resume_exact": True, "why": []}, status["exact"]
        reference = _answers(cpu)
        assert [(n, f) for _, n, f in reference] == [(MAX_TOKENS, "length")] * len(FAMILY_CHATS)
    finally:
        assert cpu.stop() == 0, cpu.log()
    if family.startswith("gemma"):
        with pytest.raises(RuntimeError) as refused:
            _serve(tmp_path_factory, family, "hetero")
        assert f"is a {family} model, whose sliding-window layers" in str(refused.value)
        assert family in SLIDING_WINDOW_ARCHS
        return
    hetero = _serve(tmp_path_factory, family, "hetero")
    try:
        assert hetero.status()["exact"]["hetero_equals_cpu"] is True, hetero.status()["exact"]
        got = _answers(hetero)
    finally:
        assert hetero.stop() == 0, hetero.log()
    differ = [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]
    assert not differ, f"{family}: hetero gave {len(got) - len(differ)} of {len(got)} of cpu mode's texts; chat " \
                       f"{differ[0]}:\ngot      {got[differ[0]]!r}\nexpected {reference[differ[0]]!r}"
