"""Hetero mode end to end: prefill worker -> shared-memory KV ring -> CPU decode worker."""

from __future__ import annotations

import concurrent.futures
import os
import platform
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

from conftest import MODEL_NAME, start_daemon
from syshaxd.config import Config
from syshaxd.engine.plan import RingPlan, plan_engines
from syshaxd.sdk.kv.ring import ring_path

N_CTX = 1024

PROMPTS = [
    "Hi",
    "A",
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a land far away, there lived a",
    "日本の首都は",
    "Привет, как дела? Расскажи мне",
    "Ünïcödé façade — naïve café: ",
    "😀 emoji test 🚀🚀",
    "1 2 3 4 5 6 7 8 9",
    "Q: What is the boiling point of water?\nA:",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nimport torch\n",
    "The mitochondria is the powerhouse of",
    "SELECT * FROM users WHERE",
    "Roses are red, violets are blue,",
    "   leading spaces and\ttabs",
    "In 1969, Neil Armstrong",
    "List of prime numbers: 2, 3, 5, 7,",
    "word " * 990,  # near the context limit with max_tokens below
]


def shm_segments(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"syshax-{pid}-kv"))


def prefix_store_of(pid: int) -> Path:
    return Path("/dev/shm") / f"syshax-{pid}-prefix"


@pytest.fixture(scope="module")
def hetero(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("hetero"),
                     {"model": str(default_model), "mode": "hetero", "n_ctx": N_CTX, "prefill_cpu_affinity": "0"})
    yield d
    assert d.stop() == 0, d.log()
    assert shm_segments(d.proc.pid) == []  # unlinked on a clean exit


def complete(client, prompt, route, max_tokens=24, cache_prompt=True):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"syshax": {"mode": route}, "cache_prompt": cache_prompt})


def test_workers_are_placed_apart(hetero):
    workers = {w["name"]: w for w in hetero.status()["workers"]}
    assert workers["prefill0"]["role"] == "prefill" and workers["prefill0"]["cpus"] == [0]
    assert workers["decode0"]["cpus"] == [1]
    assert shm_segments(hetero.proc.pid)[0].stat().st_mode & 0o777 == 0o600


def test_hetero_returns_exactly_the_tokens_cpu_mode_returns(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    before = hetero.status()["kv"]
    parted = []
    for prompt in PROMPTS:
        max_tokens = 16 if len(prompt) > 1000 else 24
        cpu = complete(client, prompt, "cpu", max_tokens)
        het = complete(client, prompt, "hetero", max_tokens)
        if het.choices[0].text != cpu.choices[0].text:
            parted.append(prompt[:40])
        assert (het.usage.prompt_tokens, het.usage.completion_tokens) == (cpu.usage.prompt_tokens,
                                                                          cpu.usage.completion_tokens)
    if parted and not_promised_here(hetero):  # ARM (make test-arm): the status says hetero is not always cpu mode
        pytest.xfail(f"{len(parted)} of {len(PROMPTS)} texts part on this {platform.machine()} CPU, whose status says "
                     f"hetero does not always return cpu mode's tokens: {'; '.join(hetero.status()['exact']['why'])}")
    assert not parted, parted
    kv = hetero.status()["kv"]
    assert kv["records_written"] - before["records_written"] == len(PROMPTS)
    assert kv["records_read"] - before["records_read"] == len(PROMPTS)
    assert kv["fallbacks"] == before["fallbacks"]
    assert kv["bytes_moved"] > 0 and kv["handoff_latency_s"]["count"] >= len(PROMPTS)
    assert kv["ring"]["used_bytes"] == 0  # every record was released


def not_promised_here(daemon) -> bool:
    """Whether this is a CPU other than x86's whose status does not promise hetero == cpu (the patch series proves it
    on x86 only; there the promise is always made, and a test that finds it broken fails)."""
    return daemon.status()["exact"]["hetero_equals_cpu"] is False and platform.machine() not in ("x86_64", "AMD64")


def test_a_hetero_request_goes_through_the_ring_and_the_status_says_if_it_is_exact(hetero):
    """On any CPU (make test-arm runs it on aarch64): a hetero request's prompt goes through the ring to a decoder,
    and the status says whether hetero returns cpu mode's tokens, naming each worker that keeps it from doing so."""
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    before = hetero.status()
    answer = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=16,
                                       temperature=0, extra_body={"syshax": {"mode": "hetero"}, "ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].text
    after = hetero.status()
    assert after["routes"]["hetero"] == before["routes"].get("hetero", 0) + 1
    assert after["kv"]["records_read"] == before["kv"]["records_read"] + 1 and after["kv"]["ring"]["used_bytes"] == 0
    exact = after["exact"]
    assert isinstance(exact["hetero_equals_cpu"], bool) and exact["hetero_equals_cpu"] == (not exact["why"]), exact
    assert all(line.split()[0] in ("prefill0", "decode0") for line in exact["why"]), exact


def test_streaming_and_concurrency_through_the_ring(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    prompts = PROMPTS[:10]
    expected = [complete(client, p, "cpu").choices[0].text for p in prompts]

    def streamed(p):
        chunks = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"syshax": {"mode": "hetero"}})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == expected
    assert hetero.status()["routes"]["hetero"] >= len(prompts)


def test_chat_in_hetero_mode(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    cpu = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, temperature=0,
                                         extra_body={"syshax": {"mode": "cpu"}})
    het = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, temperature=0)
    assert het.choices[0].message.content == cpu.choices[0].message.content


def test_requests_outlive_a_decoder_killed_twice_mid_stream(hetero):
    """Each request on the decoder when it is SIGKILLed resumes, once it is back, with its prompt and the tokens it
    had (engine/journey.py): every request is answered, and greedy, with the text of an undisturbed run."""
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    prompts = [f"{PROMPTS[i % 19]} ({i})" for i in range(64)]  # unique, short and long, arriving 8 at a time
    refused = []

    def ask(prompt):
        # A request that arrives while the only decoder restarts is refused with a 503 that says to retry shortly
        # (and a client does, as openai's does by default); the requests in flight then must not be lost.
        while True:
            try:
                return complete(client, prompt, "hetero", 48).choices[0].text
            except openai.InternalServerError as exc:
                if exc.status_code != 503 or "retry shortly" not in str(exc):
                    raise
                refused.append(prompt)
                time.sleep(0.5)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(ask, prompts))
    before = hetero.status()["rescued"]
    killed: list[int] = []

    def decoder():
        return next(w for w in hetero.status()["workers"] if w["name"] == "decode0")

    first_seen: dict[int, int] = {}  # a decoder's pid -> its generated tokens when it was first seen busy

    def decoding():
        """The decoder, once it runs 2 sequences or more and has generated 16 tokens since: mid-stream."""
        w = decoder()
        if w["state"] != "ready" or w["stats"]["running"] < 2:
            return None
        generated = w["stats"]["generated_tokens"]  # (a restarted one's first report may still be its predecessor's)
        first = first_seen[w["pid"]] = min(first_seen.get(w["pid"], generated), generated)
        return w if generated >= first + 16 else None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(ask, p) for p in prompts]
        for _ in range(2):
            busy = wait_until(lambda: (w := decoding()) and w["pid"] not in killed and w,
                              what=lambda: f"a busy decoder (killed {killed}, now {decoder()})")
            os.kill(busy["pid"], signal.SIGKILL)
            killed.append(busy["pid"])
        got = [a.result() for a in answers]
    assert got == expected
    after = hetero.status()["rescued"]
    assert after["resumed"] > before["resumed"] and after["lost"] == before["lost"], (before, after, len(refused))
    assert decoder()["restarts"] >= 2


def wait_until(check, timeout=60.0, what=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.02)
    return found


def test_killed_prefill_worker_falls_back_and_nothing_is_lost(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    prompt = "word " * 900
    expected = complete(client, prompt, "cpu", 8).choices[0].text
    before = hetero.status()["kv"]["fallbacks"].get("prefill_died", 0)
    pid = next(w["pid"] for w in hetero.status()["workers"] if w["name"] == "prefill0")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, client, prompt, "hetero", 8, False)  # no cache: prefill takes seconds
        time.sleep(0.3)  # the prompt takes seconds to prefill on one core
        os.kill(pid, signal.SIGKILL)
        assert future.result().choices[0].text == expected
    status = hetero.status()
    assert status["kv"]["fallbacks"].get("prefill_died", 0) == before + 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        w = next(w for w in hetero.status()["workers"] if w["name"] == "prefill0")
        if w["state"] == "ready" and w["pid"] != pid:
            break
        time.sleep(0.2)
    assert complete(client, "Hi", "hetero").choices[0].text == complete(client, "Hi", "cpu").choices[0].text
    assert "recomputing the prompt" in hetero.log()


def test_a_cpu_mode_daemon_refuses_the_hetero_route(daemon):
    client = openai.OpenAI(base_url=daemon.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, "Hi", "hetero")
    assert exc.value.body["code"] == "unsupported_route"


def test_full_ring_makes_the_decoder_recompute(default_model, tmp_path):
    # a 1 MiB ring can never hold a 100-token record (about 2.3 MB): the producer gives up at once
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "ring_size_mb": 1,
                                "handoff_timeout": 0.2, "prefill_cpu_affinity": "0"})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=120)
        prompt = "tell me more " * 40
        assert complete(client, prompt, "hetero").choices[0].text == complete(client, prompt, "cpu").choices[0].text
        assert d.status()["kv"]["fallbacks"] == {"ring_full": 1}
        assert "recomputing the prompt" in d.log()
    finally:
        assert d.stop() == 0


def test_planning_names_the_ring_and_the_daemon_creates_it(default_model):
    cfg = Config(mode="hetero", prefill_cpu_affinity="0", ring_size_mb=8)
    engines = plan_engines(cfg, default_model, MODEL_NAME, {}, instance="plan-only")
    assert engines.ring == RingPlan("plan-only", 8 << 20)
    assert {spec.ring for _, spec in engines.workers} == {"plan-only"}
    assert not ring_path("plan-only").exists()  # planning leaves nothing in /dev/shm


def test_a_daemon_killed_with_sigkill_leaves_no_worker_and_its_ring_is_swept_at_the_next_start(default_model,
                                                                                                tmp_path):
    first = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "ring_size_mb": 8})
    workers = [w["pid"] for w in first.status()["workers"]]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their daemon"
        time.sleep(0.1)
    assert len(shm_segments(first.proc.pid)) == 1  # left behind by kill -9
    assert prefix_store_of(first.proc.pid).exists()
    second = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "ring_size_mb": 8})
    try:
        assert shm_segments(first.proc.pid) == [] and not prefix_store_of(first.proc.pid).exists()
        assert "removed a KV ring" in second.log() and "removed a prefix cache" in second.log()
    finally:
        assert second.stop() == 0
    assert shm_segments(second.proc.pid) == [] and not prefix_store_of(second.proc.pid).exists()


def test_the_prefill_worker_and_the_decoders_share_the_prefix_cache(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=300)
    prompt = "A short history of bread: " + "word " * 300  # one whole block of 256 tokens, and more
    expected = complete(client, prompt, "cpu", 16, cache_prompt=False).choices[0].text
    first = complete(client, prompt, "hetero", 16)  # the prefill worker keeps the block
    again = complete(client, prompt, "hetero", 16)  # ... and takes it back
    on_cpu = complete(client, prompt, "cpu", 16)  # a decoder takes what the prefill worker kept
    assert [r.choices[0].text for r in (first, again, on_cpu)] == [expected] * 3
    # the whole prompt: its block, its last chunk and its last token's logits
    assert [r.usage.prompt_tokens_details.cached_tokens for r in (again, on_cpu)] == [first.usage.prompt_tokens] * 2
    assert hetero.status()["prefix_cache"]["hits"] >= 2 * first.usage.prompt_tokens
