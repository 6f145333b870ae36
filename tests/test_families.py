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


# --- the cross-engine codec: a torch prefill engine's KV decoded by llama.cpp -----------------------------------

@pytest.mark.parametrize("family", ["llama3", "qwen3", "mistral", "phi3"])
def test_torch_prefill_hands_each_proven_family_on_teacher_forced(family, tmp_path):
    """The torch engine's record, imported into the llama.cpp decoder, gives the decoder's own next-token
    distributions: judged teacher-forced (random weights make near-ties common, hence 85 %, where the default model
    gets 95 %), per family whose K layout and rope the codec knows (head_dim 128 with GQA, n_head * head_dim !=
    n_embd, q/k norms, llama 3 rope scaling, fused QKV)."""
    pytest.importorskip("transformers")
    import uuid

    from teacher_forced import Decoder, judge
    from test_torch_prefill import instance_of, prefill, take_record

    from syshax_torch.engine import TorchPrefillEngine
    from syshaxd.sdk.gguf.quantize import ensure_quantized
    from syshaxd.sdk.kv.ring import KVRing
    from syshaxd.sdk.types import EngineSpec

    source, cache = _model(family), MODEL_DIR / "families"
    ring = KVRing.create(f"test-fam-{uuid.uuid4().hex[:8]}", 64 << 20)
    engine = TorchPrefillEngine(EngineSpec(backend="torch", role="prefill", model_path=str(source), model_name="m",
                                           n_ctx=512, threads=2, ring=instance_of(ring), quantize="q4_0",
                                           cache_dir=str(cache)))
    decoder = Decoder(ensure_quantized(source, "q4_0", cache))
    try:
        def record_bytes_for(tokens):
            done = prefill(engine, tokens)
            assert done.handle is not None, done.reason
            return take_record(ring, done.handle)

        good, _ = judge(decoder, record_bytes_for)
        print(f"\n{family}: torch prefill -> llama.cpp decode, teacher-forced: {good}")
        assert good.steps == 150 and good.agreement >= 0.85 and good.mean_kl <= 0.005, good
    finally:
        engine.close()
        decoder.close()
        ring.unlink()
        ring.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_hetero_with_a_torch_engine_refuses_a_family_its_codec_does_not_know(family, tmp_path_factory):
    """mixtral's experts came back as garbage served with 200 (20 % top-1), qwen3moe's failed to load: both are
    refused at start, naming the family, and pointed at the llama.cpp prefill engine, which serves them."""
    with pytest.raises(RuntimeError) as refused:
        start_daemon(tmp_path_factory.mktemp(f"{family}-torch"),
                     {"model": str(_model(family)), "mode": "hetero", "prefill_engine": "torch", **BASE})
    message = str(refused.value)
    assert "prefill_engine torch" in message and 'prefill_engine = "llamacpp"' in message, message
    assert ("mixture of 4 experts" if family == "mixtral" else "is a qwen3moe model") in message
