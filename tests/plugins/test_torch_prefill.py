"""transformers prefill -> ring -> llama.cpp q4_0 decode: teacher-forced agreement, and a hetero daemon using it."""

from __future__ import annotations

import uuid

import openai
import pytest

from conftest import MODEL_DIR, MODEL_NAME, start_daemon
from teacher_forced import Decoder, hf_folder, judge  # noqa: F401  (hf_folder is a fixture)

pytest.importorskip("torch")
pytest.importorskip("transformers")

from syshaxd.sdk.types import Accepted, EngineSpec, GenerateRequest, Prefilled, Refusal, SamplingParams  # noqa: E402
from syshaxd.sdk.kv.ring import KVRing  # noqa: E402


@pytest.fixture(scope="module")
def ring():
    r = KVRing.create(f"test-torch-{uuid.uuid4().hex[:8]}", 64 << 20)
    yield r
    r.unlink()
    r.close()


def instance_of(ring) -> str:
    return ring.path.name[len("syshax-"):-len("-kv")]


@pytest.fixture(scope="module")
def torch_engine(default_model, hf_folder, ring):
    from syshax_torch.engine import TorchPrefillEngine

    eng = TorchPrefillEngine(EngineSpec(
        backend="torch", role="prefill", model_path=str(default_model), model_name="m", n_ctx=1024, threads=1,
        ring=instance_of(ring), quantize="q4_0", cache_dir=str(MODEL_DIR)))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def decoder(default_model):
    d = Decoder(default_model)
    yield d
    d.close()


def prefill(engine, tokens: list[int]) -> Prefilled:
    request = GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=16, sampling=SamplingParams(temperature=0),
                              prompt_tokens=tuple(tokens))
    events = engine.submit(request)
    assert isinstance(events[0], Accepted), events
    while engine.has_work():
        events += engine.step()
    (done,) = [e for e in events if isinstance(e, Prefilled)]
    return done


def take_record(ring, handle) -> bytes:
    try:
        return bytes(ring.read(handle.offset, handle.seq))
    finally:
        ring.release(handle.offset)


def records_of(engine, ring):
    """record_bytes_for, as teacher_forced.judge takes it: the bytes of the record `engine` writes for a prompt."""
    def record_bytes_for(tokens):
        done = prefill(engine, tokens)
        assert done.handle is not None, done.reason
        return take_record(ring, done.handle)

    return record_bytes_for


def test_torch_prefill_decodes_like_llamacpp_teacher_forced(torch_engine, decoder, ring):
    good, control = judge(decoder, records_of(torch_engine, ring))
    print(f"\ntorch prefill -> llama.cpp decode, teacher-forced: {good}")
    print(f"the same with the K permutation left out (control): {control}")
    assert good.steps == 150
    assert good.agreement >= 0.95 and good.mean_kl <= 0.02, good
    # the control must fail, and by far: the permutation is what makes the handoff right
    assert control.agreement < 0.8 and control.mean_kl > 0.5, control
    assert ring.stats().used_bytes == 0


def test_torch_record_carries_the_decoders_fingerprint_and_first_token(torch_engine, decoder, ring):
    from syshaxd.sdk.kv.record import decode

    tokens = decoder.tokenize("The capital of France is")
    done = prefill(torch_engine, tokens)
    record = decode(take_record(ring, done.handle), expect=decoder.fingerprint)
    assert record.n_tokens == done.handle.n_tokens == len(tokens)
    # the first token is the prefill engine's own greedy choice: on this small model it may differ
    # from llama.cpp's (here it does), which is why the handoff is judged teacher-forced
    assert 0 <= done.handle.first_token < decoder.n_vocab
    assert torch_engine.stats().finished >= 1


def test_torch_engine_rejects_what_llamacpp_rejects(torch_engine):
    too_long = GenerateRequest(request_id="x", max_tokens=8, prompt_tokens=tuple([42] * 1020))
    (event,) = torch_engine.submit(too_long)
    assert event.kind == Refusal.INVALID and event.code == "context_length_exceeded"
    (event,) = torch_engine.submit(GenerateRequest(request_id="y", max_tokens=8, prompt_tokens=(10**6,)))
    assert event.code == "invalid_prompt"


@pytest.fixture(scope="module")
def torch_hetero(default_model, hf_folder, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("torch-hetero"),
                     {"model": str(default_model), "mode": "hetero", "prefill_engine": "torch", "n_ctx": 1024,
                      "prefill_cpu_affinity": "0"})
    yield d
    assert d.stop() == 0, d.log()


def test_hetero_daemon_with_torch_prefill_answers_the_openai_api(torch_hetero):
    client = openai.OpenAI(base_url=torch_hetero.base_url, api_key="x", max_retries=0, timeout=300)
    workers = {w["name"]: w for w in torch_hetero.status()["workers"]}
    assert workers["prefill0"]["backend"] == "torch" and workers["prefill0"]["state"] == "ready"
    before = torch_hetero.status()["kv"]
    prompts = ["The capital of France is", "Once upon a time", "def quicksort(arr):"]
    for prompt in prompts:
        cpu = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"syshax": {"mode": "cpu"}})
        het = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert het.choices[0].text
        assert het.usage.prompt_tokens == cpu.usage.prompt_tokens and het.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=20, temperature=0)
    assert chat.choices[0].message.content.strip() and chat.usage.prompt_tokens > 20
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Roses are red,", max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    kv = torch_hetero.status()["kv"]
    n = len(prompts) + 2
    assert kv["records_written"] - before["records_written"] == n
    assert kv["records_read"] - before["records_read"] == n
    assert kv["fallbacks"] == before["fallbacks"] == {}
    assert kv["ring"]["used_bytes"] == 0


def test_hetero_with_torch_prefill_refuses_logprobs_and_schemas_before_any_engine(torch_hetero):
    """torch's plugin declares neither logprobs nor grammars: the front door refuses both with a 400 that names the
    field, no record is written, and the same requests run on a CPU worker."""
    client = openai.OpenAI(base_url=torch_hetero.base_url, api_key="x", max_retries=0, timeout=300)
    before = torch_hetero.status()["kv"]["records_written"]
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    asks = [("logprobs", lambda **kw: client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                                                 logprobs=1, **kw)),
            ("response_format", lambda **kw: client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                response_format=schema, **kw))]
    for field, ask in asks:
        with pytest.raises(openai.BadRequestError) as refused:
            ask()
        assert refused.value.body["param"] == field and refused.value.body["code"] == "unsupported_parameter"
        assert "torch" in refused.value.body["message"]
        ask(extra_body={"syshax": {"mode": "cpu"}})
    assert torch_hetero.status()["kv"]["records_written"] == before


def test_gpu_mode_refuses_a_backend_that_cannot_generate(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "gpu", "prefill_engine": "torch"}, wait=False)
    try:
        code = d.proc.wait(timeout=60)
    finally:
        d.stop()
    assert code == 2 and "backend 'torch' cannot generate (gpu mode runs both phases on it)" in d.log(), d.log()
