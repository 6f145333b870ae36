"""OpenAI's extras on a real cpu-mode daemon through the official client: /tokenize and /detokenize, logprobs,
echo, n > 1 and prompt lists -- checked against a plain llama-cpp-python forward pass of the same GGUF."""

from __future__ import annotations

import pytest

from conftest import MODEL_NAME, STOCK_ATTENTION, http_json

# the reference is llama-cpp-python in this process: the daemon takes its attention (conftest.py)
DAEMON_CONFIG = STOCK_ATTENTION


# --- /tokenize and /detokenize ------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(daemon):
    status, body = http_json(f"{daemon.url}/tokenize", {"content": "The capital of France is"})
    assert status == 200
    assert body["count"] == len(body["tokens"]) == 5  # as test_api's usage counts it
    assert body["max_model_len"] == 4096
    status, back = http_json(f"{daemon.url}/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["content"] == "The capital of France is"


def test_tokenize_takes_vllm_fields_and_pieces(daemon):
    _, a = http_json(f"{daemon.url}/tokenize", {"prompt": "Hello world", "model": MODEL_NAME})
    _, b = http_json(f"{daemon.url}/tokenize", {"content": "Hello world", "with_pieces": True})
    assert [p["id"] for p in b["tokens"]] == a["tokens"]
    assert "".join(p["piece"] for p in b["tokens"]) == "Hello world"


def test_tokenize_chat_messages_as_the_engine_counts_them(client, daemon):
    messages = [{"role": "user", "content": "Say hello."}]
    _, body = http_json(f"{daemon.url}/tokenize", {"messages": messages})
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert body["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "model": "nope"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_token_endpoints_refuse_bad_bodies(daemon, path, body, param):
    status, answer = http_json(f"{daemon.url}{path}", body)
    assert status in (400, 404) and answer["error"]["param"] == param


# --- logprobs, echo: against a plain llama-cpp-python forward pass ------------------------------------

TOL = 1e-3  # logprob units: the daemon's batched decode and a lone forward pass round differently, slightly


@pytest.fixture(scope="module")
def reference(default_model):
    """log-softmax of every position's logits, from llama_cpp.Llama on the same GGUF."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(default_model), n_ctx=512, logits_all=True, verbose=False, n_threads=1,
                          flash_attn=True)

    def logprobs(tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(tokens)
        scores = np.array(llm.scores[: len(tokens)], dtype=np.float64)
        shifted = scores - scores.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    yield logprobs
    llm.close()


def _ids(daemon, text: str) -> list[int]:
    return http_json(f"{daemon.url}/tokenize", {"content": text})[1]["tokens"]


def test_greedy_completion_logprobs_are_top1_and_match_a_forward_pass(client, daemon, reference):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=5,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert max(top, key=top.get) == token and top[token] == logprob  # greedy: the chosen one is top-1
        assert 5 <= len(top) <= 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    # the sampled tokens' logprobs, as a lone forward pass over prompt + completion computes them
    ids = _ids(daemon, prompt)
    completion = _ids(daemon, prompt + r.choices[0].text)[len(ids):]
    full = ids + completion
    ref = reference(full)
    for i, logprob in enumerate(lp.token_logprobs):
        pos = len(ids) + i
        assert abs(ref[pos - 1, full[pos]] - logprob) < TOL, (i, ref[pos - 1, full[pos]], logprob)


# the long prompt runs in two chunks of prefill_chunk_size (256): logits for every position of both
@pytest.mark.parametrize("prompt", ["Paris is the capital of France.",
                                    " ".join(f"{i} apples and" for i in range(75)) + " so on."])
def test_echo_with_logprobs_scores_the_prompt(client, daemon, reference, prompt):
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    ids = _ids(daemon, prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == prompt
    ref = reference(ids)
    for pos in range(1, len(ids)):
        assert abs(ref[pos - 1, ids[pos]] - lp.token_logprobs[pos]) < TOL, pos
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_without_logprobs_and_with_a_completion(client):
    r = client.completions.create(model=MODEL_NAME, prompt="One, two,", max_tokens=4, echo=True, temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt="One, two,", max_tokens=4, temperature=0)
    assert r.choices[0].text == "One, two," + plain.choices[0].text
    assert r.choices[0].logprobs is None


def test_streamed_logprobs_match_the_plain_answer(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0].logprobs
    tokens, values = [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == plain.tokens and values == plain.token_logprobs


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(client):
    kw = dict(model=MODEL_NAME, prompt=["Once upon a time", "One, two,"], max_tokens=3, temperature=0, logprobs=1,
              echo=True)
    plain = client.completions.create(**kw)
    texts: dict[int, str] = {}
    values: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert texts == {c.index: c.text for c in plain.choices}
    assert values == {c.index: c.logprobs.token_logprobs for c in plain.choices}
    assert all(texts[i].startswith(p) for i, p in enumerate(kw["prompt"]))


def test_chat_logprobs_shape(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert bytes(c.bytes).decode() == c.token
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw) for ch in chunk.choices
                if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": ["x", 5]}, "prompt"),
])
def test_completion_extras_refuse_bad_values(daemon, body, param):
    status, answer = http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME} | body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_chat_top_logprobs_needs_logprobs(daemon):
    status, answer = http_json(f"{daemon.base_url}/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert status == 400 and answer["error"]["param"] == "top_logprobs"


# --- n > 1 and prompt lists ----------------------------------------------------------------------------


def test_n_greedy_gives_equal_choices(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=8, temperature=0, n=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == sum(
        len(c.text) > 0 and 8 or 0 for c in r.choices)


def test_n_with_a_seed_gives_different_choices(client):
    kw = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=12, temperature=1.0, n=4, seed=7)
    r = client.completions.create(**kw)
    assert len({c.text for c in r.choices}) == 4
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + j: reproducible


def test_prompt_list_gives_one_choice_per_prompt(client, daemon):
    prompts = ["The capital of France is", "One, two, three,", "Hello"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, r.choices):
        alone = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
        assert choice.text == alone.choices[0].text
    assert r.usage.prompt_tokens == sum(len(_ids(daemon, p)) for p in prompts)
    ids = [_ids(daemon, p) for p in prompts]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in by_ids.choices] == list(range(6))
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices for _ in range(2)]
    assert by_ids.usage.prompt_tokens == r.usage.prompt_tokens


def test_streamed_n_carries_choice_indexes(client):
    kw = dict(model=MODEL_NAME, prompt=["Red, green,", "Monday, Tuesday,"], max_tokens=6, temperature=0, n=2)
    plain = client.completions.create(**kw)
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage:
            assert chunk.usage.completion_tokens == plain.usage.completion_tokens
    assert texts == {c.index: c.text for c in plain.choices}
    assert set(finishes) == {0, 1, 2, 3}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1


# --- hetero: the prefill engine's logprobs travel with the KV record ------------------------------------


@pytest.fixture(scope="module")
def hetero(default_model, tmp_path_factory):
    from conftest import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("hetero-extras"),
                     {"model": str(default_model), "mode": "hetero", "n_ctx": 1024, "prefill_cpu_affinity": "0"})
    yield d
    assert d.stop() == 0, d.log()


def test_hetero_logprobs_and_echo_equal_cpu_modes(hetero):
    import openai

    client = openai.OpenAI(base_url=hetero.base_url, api_key="unused", max_retries=0, timeout=120)
    answers = {}
    before = hetero.status()["kv"]
    for mode in ("hetero", "cpu"):
        r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                      temperature=0, logprobs=3, echo=True, extra_body={"syshax": {"mode": mode}})
        assert r.model_extra["syshax"]["route"] == mode
        answers[mode] = r.choices[0]
    hetero_lp, cpu_lp = answers["hetero"].logprobs, answers["cpu"].logprobs
    assert answers["hetero"].text == answers["cpu"].text
    assert hetero_lp.tokens == cpu_lp.tokens and hetero_lp.token_logprobs[0] is None
    for a, b in zip(hetero_lp.token_logprobs[1:], cpu_lp.token_logprobs[1:]):
        assert abs(a - b) < TOL
    kv = hetero.status()["kv"]  # the hetero answer's logprobs came through the record, not a recompute
    assert kv["records_read"] - before["records_read"] == 1 and kv["fallbacks"] == before["fallbacks"]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert [len(c.logprobs.content) for c in chat.choices] == [len(chat.choices[0].logprobs.content)] * 2
