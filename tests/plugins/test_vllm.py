"""vLLM (CPU build here) as syshax's GPU engine: prefill -> ring -> llama.cpp decode, and gpu mode behind the API."""

from __future__ import annotations

import uuid

import pytest

from conftest import MODEL_DIR
from teacher_forced import Decoder, hf_folder, judge  # noqa: F401  (hf_folder is a fixture)

pytest.importorskip("vllm")

from syshaxd.sdk.types import (  # noqa: E402
    Accepted, EngineSpec, GenerateRequest, GpuSettings, Prefilled, SamplingParams)
from syshaxd.sdk.kv.ring import KVRing  # noqa: E402


@pytest.fixture(scope="module")
def ring():
    r = KVRing.create(f"test-vllm-{uuid.uuid4().hex[:8]}", 64 << 20)
    yield r
    r.unlink()
    r.close()


@pytest.fixture(scope="module")
def vllm_prefill(default_model, hf_folder, ring):
    """The test session's one in-process vLLM engine (about 20 s to start here)."""
    from syshax_vllm.engine import VllmEngine

    instance = ring.path.name[len("syshax-"):-len("-kv")]
    eng = VllmEngine(EngineSpec(
        backend="vllm", role="prefill", model_path=str(default_model), model_name="m", n_ctx=1024, threads=1,
        ring=instance, quantize="q4_0", cache_dir=str(MODEL_DIR), gpu=GpuSettings(max_num_seqs=4)))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def decoder(default_model):
    d = Decoder(default_model)
    yield d
    d.close()


def prefill(engine, tokens_list) -> list[Prefilled]:
    """Submit several prompts at once (vLLM batches them in one step) and collect their handles."""
    ids = []
    for tokens in tokens_list:
        request = GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=16,
                                  sampling=SamplingParams(temperature=0), prompt_tokens=tuple(tokens))
        (accepted,) = engine.submit(request)
        assert isinstance(accepted, Accepted), accepted
        ids.append(request.request_id)
    events = []
    while engine.has_work():
        events += engine.step()
    done = {e.request_id: e for e in events if isinstance(e, Prefilled)}
    return [done[i] for i in ids]


def take_record(ring, handle) -> bytes:
    try:
        return bytes(ring.read(handle.offset, handle.seq))
    finally:
        ring.release(handle.offset)


def test_vllm_prefill_decodes_like_llamacpp_teacher_forced(vllm_prefill, decoder, ring):
    def record_bytes_for(tokens):
        (done,) = prefill(vllm_prefill, [tokens])
        assert done.handle is not None, done.reason
        return take_record(ring, done.handle)

    good, control = judge(decoder, record_bytes_for)
    print(f"\nvLLM prefill -> llama.cpp decode, teacher-forced: {good}")
    print(f"the same with the K permutation left out (control): {control}")
    assert good.steps == 150
    assert good.agreement >= 0.95 and good.mean_kl <= 0.02, good
    assert control.agreement < 0.8 and control.mean_kl > 0.5, control
    assert ring.stats().used_bytes == 0


def test_prompts_batched_chunked_and_spanning_blocks_all_hand_off(vllm_prefill, decoder, ring):
    # one step holds several prompts; 600 tokens take three chunks of 256 and five 128-token
    # blocks, the last one partial; a one-token prompt is a partial first block
    texts = ["Hi", "The history of the Roman empire is long. " * 60, "1 2 3 4 5 6 7 8 9 10 " * 13]
    tokens = [decoder.tokenize(t) for t in texts]
    assert [len(t) for t in tokens][0] == 1 and len(tokens[1]) > 512
    handed = prefill(vllm_prefill, tokens)
    records = {tuple(t): take_record(ring, h.handle) for t, h in zip(tokens, handed)}
    good, _ = judge(decoder, lambda t: records[tuple(t)], prompts=texts)
    print(f"\nvLLM prefill, batched and chunked prompts: {good}")
    assert good.agreement >= 0.9 and good.mean_kl <= 0.05, good
    assert ring.stats().used_bytes == 0


def test_full_ring_is_reported_and_the_engine_keeps_going(vllm_prefill, decoder, ring):
    from syshaxd.sdk.kv.ring import RingFull

    hogs = []  # fill the ring with reservations nobody commits: no room for a record
    try:
        while True:
            hogs.append(ring.reserve(64 << 10))
    except RingFull:
        pass
    try:
        (done,) = prefill(vllm_prefill, [decoder.tokenize("The capital of France is")])
    finally:
        for hog in hogs:
            hog.abort()
        ring.reclaim()
    assert done.handle is None and done.reason == "ring_full"
    (done,) = prefill(vllm_prefill, [decoder.tokenize("The capital of France is")])
    assert done.handle is not None
    take_record(ring, done.handle)


# --- gpu mode: the vLLM engine answers the OpenAI API by itself, as the cpu-mode tests expect ---

from test_api import *  # noqa: E402,F401,F403  (the cpu-mode API tests, run here against gpu mode)


@pytest.fixture(scope="module")
def daemon(default_model, hf_folder, tmp_path_factory):
    """A gpu-mode daemon with vLLM as its one engine; the test_api tests above use it through `client`."""
    from conftest import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("gpu"), {
        "model": str(default_model), "mode": "gpu", "prefill_engine": "vllm", "max_num_seqs": 4})
    yield d
    code = d.stop()
    assert code == 0, f"syshaxd exited with {code}:\n{d.log()}"


def test_gpu_mode_runs_one_vllm_engine(daemon):
    status = daemon.status()
    assert status["mode"] == "gpu"
    (worker,) = status["workers"]
    assert worker["name"] == "gpu0" and worker["backend"] == "vllm" and worker["role"] == "generate"
    assert status["kv"] is None  # no ring: nothing is handed over


def test_hetero_daemon_with_vllm_prefill_hands_every_prompt_to_the_decoder(default_model, hf_folder, tmp_path):
    import openai

    from conftest import MODEL_NAME, start_daemon

    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "prefill_engine": "vllm",
                                "n_ctx": 1024, "max_num_seqs": 4, "prefill_cpu_affinity": "0"})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=300)
        prompts = ["The capital of France is", "The history of the Roman empire is long. " * 30]
        for prompt in prompts:
            cpu = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"syshax": {"mode": "cpu"}})
            het = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert het.choices[0].text
            assert het.usage.prompt_tokens == cpu.usage.prompt_tokens and het.usage.completion_tokens == 12
        # a prompt handed on carries no logprobs: a 400 naming the param and the modes that have them
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, logprobs=1)
        error = refused.value.body
        assert error["param"] == "logprobs" and error["code"] == "unsupported_parameter"
        assert "hetero mode" in error["message"] and "cpu mode" in error["message"]
        kv = d.status()["kv"]
        assert kv["records_written"] == kv["records_read"] == len(prompts) and kv["fallbacks"] == {}
        assert kv["ring"]["used_bytes"] == 0
        # the status says that greedy hetero here is not cpu mode's token for token, and why
        exact = d.status()["exact"]
        assert exact["hetero_equals_cpu"] is False and exact["resume_exact"] is True, exact
        assert exact["why"] == ["prefill0 runs vllm, which computes KV its own way (its handoffs are judged "
                                "teacher-forced: top-1 agreement and KL)"], exact
    finally:
        assert d.stop() == 0, d.log()


def test_auto_daemon_with_vllm_offloads_when_saturated_and_every_text_is_right(default_model, hf_folder, tmp_path):
    """End to end with the real GPU engine: vLLM (CPU build) as the GPU engine with max_num_seqs 2; 12 requests at once."""
    from conftest import MODEL_NAME, http_json, start_daemon
    from test_auto import AUTO, counting_prompt, reference, run_all, settle

    d = start_daemon(tmp_path, {"model": str(default_model), **AUTO, "prefill_engine": "vllm"})
    try:
        prompts = [counting_prompt(i) for i in range(12)]
        answers = run_all(d.url, prompts, 24, stream=lambda i: i % 3 == 0)
        routes = [a["syshax"]["route"] for a in answers]
        assert {"gpu", "hetero"} <= set(routes), routes
        # Each prompt alone, on the route it took under load: the same text. Not compared with the CPU worker's
        # text: vLLM computes another engine's bits, and on prompt 7 ("73, ..., 78,") vLLM (like llama.cpp's own
        # attention) says " 80" where the CPU workers' tiled attention says " 79" -- a near-tie, which is why a
        # cross-engine handoff is judged teacher-forced (test_vllm_prefill_decodes_like_llamacpp_teacher_forced)
        for prompt, answer in zip(prompts, answers):
            (alone,) = run_all(d.url, [prompt], 24, mode=answer["syshax"]["route"])
            assert answer["choices"][0]["text"] == alone["choices"][0]["text"], (prompt, answer["syshax"])
        # the handoff is right where the engines agree: most of these sharply peaked prompts
        cpu = reference(d.url, prompts, 24)
        assert sum(a["choices"][0]["text"] == c for a, c in zip(answers, cpu)) >= len(prompts) - 2, (answers, cpu)
        st = settle(d)
        assert st["routes"]["gpu"] >= routes.count("gpu") and st["routes"]["hetero"] >= routes.count("hetero")
        assert st["kv"]["records_read"] >= routes.count("hetero") and not st["kv"]["fallbacks"]
        assert st["auto"]["decisions"]["hetero"] >= routes.count("hetero")
        assert [w["backend"] for w in st["workers"]] == ["vllm", "llamacpp"]
        # vLLM does not declare handed_on_logprobs: an offloaded decode would lose them, so auto keeps such a
        # request on the CPU rather than leave it to the decider
        status, lp = http_json(f"{d.url}/v1/completions", {"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 3,
                                                           "temperature": 0, "logprobs": 2})
        assert status == 200 and lp["syshax"]["route"] == "cpu" and "logprobs" in lp["syshax"]["reason"]
        assert len(lp["choices"][0]["logprobs"]["token_logprobs"]) == 3
    finally:
        assert d.stop() == 0, d.log()


def test_the_front_door_refuses_by_what_each_installed_backend_declares():
    """One function refuses for every backend, reading the Capabilities its plugin declares: vLLM hands a prompt on
    without its logprobs, torch has neither logprobs nor grammars, llama.cpp has both."""
    from syshaxd.engine.capabilities import Stop, Unsupported, check
    from syshaxd.sdk.plugins import backend_capabilities

    caps = backend_capabilities({"vllm", "torch", "llamacpp"})
    decoder = Stop("llamacpp", caps["llamacpp"])
    logprobs = GenerateRequest(request_id="a", max_tokens=2, prompt="Hi", logprobs=0)
    echo = GenerateRequest(request_id="b", max_tokens=2, prompt="Hi", prompt_logprobs=1)
    schema = GenerateRequest(request_id="c", max_tokens=2, prompt="Hi", grammar='root ::= "x"',
                             grammar_field="response_format")
    for request in (logprobs, echo):
        with pytest.raises(Unsupported, match="hetero mode.*vllm prefill engine.*cpu mode") as refused:
            check(request, "hetero", [Stop("vllm", caps["vllm"], hands_on=True), decoder])
        assert refused.value.param == "logprobs"
        check(request, "gpu", [Stop("vllm", caps["vllm"])])  # where it generates, it computes them
        check(request, "hetero", [Stop("llamacpp", caps["llamacpp"], hands_on=True), decoder])
    check(schema, "hetero", [Stop("vllm", caps["vllm"], hands_on=True), decoder])
    with pytest.raises(Unsupported, match="torch engine in hetero mode: it samples the first token without") as no:
        check(schema, "hetero", [Stop("torch", caps["torch"], hands_on=True), decoder])
    assert no.value.param == "response_format"


def test_gpu_mode_logprobs_and_echo(client, daemon):
    """vLLM's raw logprobs (its default logprobs_mode), in the same shapes as cpu mode's."""
    from conftest import MODEL_NAME

    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=3, echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 6 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert max(top, key=top.get) == token and top[token] == logprob  # greedy: the chosen one is top-1
        assert list(top.values()) == sorted(top.values(), reverse=True)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert all(len(c.logprobs.content) >= 1 and len(c.logprobs.content[0].top_logprobs) == 2 for c in chat.choices)


@pytest.mark.parametrize("i", [3, 6, 18])
def test_gpu_mode_json_schema_validates(client, i):
    """vLLM constrains with the daemon's grammar (structured_outputs, xgrammar reading the GBNF)."""
    import json

    import jsonschema
    from test_structured import CASES, schema_format

    prompt, schema = CASES[i]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=60, temperature=0.7, seed=i, response_format=schema_format(schema))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_gpu_mode_forced_tool_call_and_bad_grammar(client):
    import openai as oa
    from test_structured import TOOLS, WEATHER_ASK, assert_call, obj

    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=60, temperature=0)
    assert_call(r)
    with pytest.raises(oa.BadRequestError):  # \d: neither llama.cpp's nor xgrammar's GBNF; the engine lives on
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": obj(
                {"n": {"type": "string", "pattern": "^\\d+$"}})}})
    assert client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_ASK, max_tokens=2)


def test_hetero_with_vllm_prefill_json_schema_validates(default_model, hf_folder, tmp_path):
    """vLLM samples the first token under the grammar; the llama.cpp decoder's grammar accepts it and goes on."""
    import json

    import jsonschema
    import openai

    from conftest import MODEL_NAME, start_daemon
    from test_structured import CASES, schema_format

    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "prefill_engine": "vllm",
                                "n_ctx": 1024, "max_num_seqs": 4, "prefill_cpu_affinity": "0"})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=300)
        for i in (0, 6, 13):
            prompt, schema = CASES[i]
            r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=80, temperature=0.7, seed=i,
                                               response_format=schema_format(schema))
            assert r.choices[0].finish_reason == "stop" and r.model_extra["syshax"]["route"] == "hetero"
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        kv = d.status()["kv"]
        assert kv["records_read"] == 3 and kv["fallbacks"] == {}
    finally:
        assert d.stop() == 0, d.log()


def test_a_pool_of_vllm_engines_places_a_chat_turn_where_its_prefix_is_cached(default_model, hf_folder, tmp_path):
    """Two vLLM engines, each with its own prefix cache: a conversation's next turn goes back to the engine that ran
    the turn before, though the other is less loaded then, and vLLM finds its prefix cached there."""
    import threading

    from conftest import MODEL_NAME, http_json, start_daemon, wait_for

    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "gpu",
                                "prefill_engine": "vllm", "prefill_cpu_affinity": "0;1", "max_num_seqs": 4,
                                "n_ctx": 1024})

    def chat(messages, max_tokens=8):
        code, body = http_json(f"{d.url}/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                                 "max_tokens": max_tokens, "temperature": 0,
                                                                 "ignore_eos": True}, timeout=300)
        assert code == 200, body
        return body

    def stats(name):
        return next(w for w in d.status()["workers"] if w["name"] == name)["stats"]

    try:
        system = "You answer questions about the history of clocks. " * 20  # several blocks of 16 tokens
        turn = [{"role": "system", "content": system}, {"role": "user", "content": "Who made the first clock?"}]
        first = chat(turn)
        holder = wait_for(lambda: next((n for n in ("gpu0", "gpu1") if stats(n)["finished"] == 1), None), 10,
                          "the engine of the first turn")
        answered = []
        busy = threading.Thread(target=lambda: answered.append(chat(
            [{"role": "user", "content": "Count to a thousand."}], 100)["usage"]["completion_tokens"]))
        busy.start()  # it goes to the engine of the first turn (both idle: the first ready), which is busier then
        wait_for(lambda: stats(holder)["running"] >= 1, 30, "the busy request on the holder")
        cached = stats(holder)["cached_tokens"]
        turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the first pendulum clock?"}]
        chat(turn)
        busy.join(300)
        assert answered == [100]  # the busy request was answered too (a thread's failure would go unseen)
        assert d.status()["prefix_routing"]["placed_by_prefix"] == 1, d.status()["prefix_routing"]
        assert stats(holder)["cached_tokens"] - cached >= 16 * 5  # vLLM found the system prompt's blocks there
    finally:
        assert d.stop() == 0, d.log()
