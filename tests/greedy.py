"""The greedy chats behind the README's exactness promises, and the helpers that answer them under disturbance.

Every route must give these texts token for token: cpu mode undisturbed is the reference; hetero, auto's offload and
moves, a remote node, and each of them with decoders killed or links cut under them, must give it back. The answers
are long (MAX_TOKENS, with ignore_eos so that none ends early) and several run at once, because a near-tie shows only
over long texts and a stale token only under load.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import openai

from conftest import MODEL_NAME

MAX_TOKENS = 128

SYSTEM = "You are a helpful assistant. Answer in full sentences."
CHATS: list[list[dict]] = [
    [{"role": "user", "content": "Explain how a steam engine works, step by step."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a short story about a lighthouse."}],
    # the three-message chat whose text a resume changed in hetero (issue 34)
    [{"role": "user", "content": "Qu'est-ce que la photosynthèse ?"},
     {"role": "assistant", "content": "La photosynthèse est le processus par lequel les plantes produisent du sucre."},
     {"role": "user", "content": "Explique-le plus en détail, s'il te plaît."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List ten uses of a paperclip and explain each."}],
    [{"role": "user", "content": "def merge_sort(xs):\n    # finish this function and explain it"}],
    [{"role": "user", "content": "What were the causes of the French Revolution?"}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me about the history of tea in China and in Britain."}],
    [{"role": "user", "content": "Describe the water cycle to a ten-year-old, with examples."}],
]


def client_of(daemon, timeout: float = 600) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url, api_key="x", max_retries=0, timeout=timeout)


def answer(client: openai.OpenAI, messages: list[dict], stream: bool, route: str | None = None,
           max_tokens: int = MAX_TOKENS) -> tuple[str, int, str]:
    """One greedy chat answer of max_tokens tokens: (text, completion tokens, finish reason). A 503 that says to
    retry (a request that arrived while the only decoder restarted) is retried, as the openai client would."""
    extra = {"ignore_eos": True} | ({"syshax": {"mode": route}} if route else {})
    while True:
        try:
            if not stream:
                out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, extra_body=extra)
                return out.choices[0].message.content, out.usage.completion_tokens, out.choices[0].finish_reason
            text, usage, finish = "", None, None
            for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                        temperature=0, stream=True, extra_body=extra,
                                                        stream_options={"include_usage": True}):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage, finish
        except openai.InternalServerError as exc:
            if exc.status_code != 503 or "retry" not in str(exc):
                raise
            time.sleep(0.5)


def answer_all(daemon, route: str | None = None, chats=CHATS, during=None) -> list[tuple[str, int, str]]:
    """Every chat at once (half of them streamed); `during()` runs meanwhile (it kills or cuts something)."""
    client = client_of(daemon)
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        futures = [pool.submit(answer, client, m, i % 2 == 1, route) for i, m in enumerate(chats)]
        if during is not None:
            during()
        return [f.result() for f in futures]


def assert_same(got: list[tuple[str, int, str]], expected: list[tuple[str, int, str]], what: str) -> None:
    """Every answer is the reference's text, with exactly max_tokens tokens (none lost, none repeated)."""
    assert [n for _, n, _ in got] == [MAX_TOKENS] * len(got), f"{what}: token counts {[n for _, n, _ in got]}"
    assert [f for _, _, f in got] == ["length"] * len(got), what
    differ = [i for i, (g, e) in enumerate(zip(got, expected)) if g[0] != e[0]]
    assert not differ, f"{what}: {len(got) - len(differ)} of {len(got)} equal; chat {differ[0]}:\n" \
                       f"got      {got[differ[0]][0]!r}\nexpected {expected[differ[0]][0]!r}"


def worker(daemon, name: str) -> dict:
    return next(w for w in daemon.status()["workers"] if w["name"] == name)


def kill_mid_stream(daemon, name: str, times: int = 2, after_tokens: int = 16, timeout: float = 120) -> list[int]:
    """SIGKILL worker `name` `times` times, each once it runs 2 sequences or more and has generated after_tokens
    tokens per sequence it runs since it was first seen busy (its restarted self included): mid-stream, every time.
    Per sequence, not in all: a request whose worker died before its first token is sent again once and has its
    prompt computed anew, and the daemon ends it (a 503 the client retries) if that worker dies too before its first
    token. With 8 sequences, 16 tokens in all came before two re-sent prompts were done once the decode step grew
    cheaper (llama.cpp patches 0008 and 0009), and the test's kill, not the daemon, broke its promise."""
    killed: list[int] = []
    first_seen: dict[int, int] = {}
    for _ in range(times):
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, f"{name} never got busy enough to kill: {worker(daemon, name)}"
            w = worker(daemon, name)
            if w["state"] == "ready" and w["pid"] not in killed and w["stats"]["running"] >= 2:
                generated = w["stats"]["generated_tokens"]
                first = first_seen[w["pid"]] = min(first_seen.get(w["pid"], generated), generated)
                if generated >= first + after_tokens * w["stats"]["running"]:
                    break
            time.sleep(0.02)
        os.kill(w["pid"], signal.SIGKILL)
        killed.append(w["pid"])
    return killed
