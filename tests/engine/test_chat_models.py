"""Several chat models in one daemon: chat entries of [[models]], each served by a syshaxd of its own that the daemon
starts, forwards to, and stops (engine/chat_models.py, api/core/model_proxy.py), beside an embedding model, under
max_loaded_models = 3 (the daemon's own model counted: two entries at once).

The second chat model is families.py's qwen2 (another architecture, another vocabulary); its greedy texts are
compared with a single-model daemon's on the same file. The third is the default model under another name, which
answers as the daemon's own model does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon, wait_for
from families import make_family_model

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List ten uses for a paperclip and say why each one works.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def second_file():
    return make_family_model("qwen2", MODEL_DIR / "families")


@pytest.fixture(scope="module")
def embed_file():
    return make_family_model("qwen3-embedding", MODEL_DIR / "families")


@pytest.fixture(scope="module")
def many(default_model, second_file, embed_file, tmp_path_factory):
    """The default model, plus [[models]]: `second` (qwen2, loaded at start), `small` (the default model's file,
    on demand, unloaded after 3 s idle) and `embed` (loaded at start); at most three models loaded at once, the
    daemon's own counted: two entries."""
    tmp = tmp_path_factory.mktemp("chat-models")
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024,
                           "max_loaded_models": 3, "admin_socket": str(tmp / "admin.sock")},
                     tables=f'[[models]]\nname = "second"\npath = "{second_file}"\n'
                            f'[[models]]\nname = "small"\npath = "{default_model}"\nload = "on_demand"\n'
                            'keep_alive = "3s"\n'
                            f'[[models]]\nname = "embed"\npath = "{embed_file}"\nn_ctx = 256\n')
    d.socket = tmp / "admin.sock"
    yield d
    children = [m["pid"] for m in d.status()["chat_models"] if m["pid"]]
    assert d.stop(60) == 0, d.log()
    assert not any(psutil.pid_exists(pid) for pid in children)  # the children stop with the daemon


@pytest.fixture(scope="module")
def alone(second_file, tmp_path_factory):
    """A single-model daemon serving the qwen2 file, as a user would start one for it."""
    tmp = tmp_path_factory.mktemp("chat-alone")
    d = start_daemon(tmp, {"model": str(second_file), "model_name": "second", "n_ctx": 1024})
    yield d
    assert d.stop() == 0, d.log()


def _client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=300)


def _chat(daemon, model: str, prompt: str, **extra) -> str:
    answer = _client(daemon).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0, **extra)
    assert answer.model == model
    return answer.choices[0].message.content


def _states(daemon) -> dict[str, str]:
    return {m["id"]: m["syshax"]["state"] for m in http_json(f"{daemon.url}/v1/models")[1]["data"]}


def _chat_status(daemon, name: str) -> dict:
    return {m["name"]: m for m in daemon.status()["chat_models"]}[name]


def _tree_mib(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) >> 20


def _syshax(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args, "--socket", str(daemon.socket)],
                          capture_output=True, text=True, timeout=300)


def test_greedy_texts_equal_a_single_model_daemons(many, alone):
    """Chat, completions and a stream, through the daemon to its second chat model, give the single-model
    daemon's text, token for token."""
    client, reference = _client(many), _client(alone)
    for prompt in PROMPTS:
        assert _chat(many, "second", prompt) == _chat(alone, "second", prompt)
        got = client.completions.create(model="second", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        want = reference.completions.create(model="second", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
    stream = client.chat.completions.create(model="second", messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == _chat(alone, "second",
                                                                                          PROMPTS[0])


def test_a_dead_child_loaded_at_start_is_started_again_by_itself(many):
    """The daemon stays healthy (its own model serves); a model with load = "start" whose daemon died is started
    again a second later, no request asking for it, and answers as before."""
    want = _chat(many, "second", PROMPTS[2])
    status = _chat_status(many, "second")
    assert status["loads"] == 1  # (loaded once, at start: a later load would keep /health up by itself)
    os.kill(status["pid"], signal.SIGKILL)
    assert http_json(f"{many.url}/health")[0] == 200
    wait_for(lambda: _chat_status(many, "second")["state"] == "ready"
             and _chat_status(many, "second")["pid"] not in (None, status["pid"]), 120, "second's restart")
    assert _chat_status(many, "second")["loads"] == status["loads"] + 1
    # 1 s, or 5 s if it served less than a minute before it died (QUICK_DEATH)
    assert re.search(r'chat model second: what served it died after serving \d+s; starting it again in [15]s '
                     r'\(load = "start"\)', many.log()), many.log()[-3000:]
    assert "chat model second: loading (started again by itself)" in many.log()
    assert _chat(many, "second", PROMPTS[2]) == want


def test_each_model_answers_by_name_and_the_third_loads_in_room_for_two(many):
    """The daemon's own model, `small` (its file under another name: the same texts), `second`, and the embedding
    model each answer; asking for the unloaded `small` unloads the least recently used idle entry."""
    own = [_chat(many, MODEL_NAME, p) for p in PROMPTS]
    assert own[0] != _chat(many, "second", PROMPTS[0])  # another model, another text
    assert len(_client(many).embeddings.create(model="embed", input="retrieval").data[0].embedding) == 256
    assert _states(many) == {MODEL_NAME: "ready", "second": "ready", "small": "unloaded", "embed": "ready"}
    second_pid = _chat_status(many, "second")["pid"]
    assert [_chat(many, "small", p) for p in PROMPTS] == own  # loads small: second was used least recently
    assert _states(many) == {MODEL_NAME: "ready", "second": "unloaded", "small": "ready", "embed": "ready"}
    assert ("chat model second: unloaded (to make room for small (max_loaded_models = 3, the daemon's own model "
            "counted))") in many.log()
    assert not psutil.pid_exists(second_pid)  # its daemon, and with it its workers, are gone
    assert _chat(many, "second", PROMPTS[1]) == _chat(many, "second", PROMPTS[1])  # loaded again: same answers
    states = _states(many)  # small may meanwhile have passed its 3 s keep_alive: at most two entries, second one
    assert states["second"] == "ready" and sum(s == "ready" for n, s in states.items() if n != MODEL_NAME) <= 2


def test_an_unload_gives_the_memory_back(many):
    """`syshax models unload` stops the model's daemon and workers: the daemon's processes hold that much less."""
    assert _syshax(many, "models", "load", "second").returncode == 0
    before, child = _tree_mib(many.proc.pid), _chat_status(many, "second")["rss_mib"]
    assert child > 50, child  # a daemon and its llama.cpp worker
    unloaded = _syshax(many, "models", "unload", "second")
    assert unloaded.returncode == 0 and unloaded.stdout.strip() == "second: unloaded", unloaded.stdout
    after = _tree_mib(many.proc.pid)
    assert before - after >= child * 0.8, (before, after, child)
    assert _chat_status(many, "second")["rss_mib"] == 0 and _states(many)["second"] == "unloaded"
    assert re.search(r"chat model second: unloaded \(asked by syshax models unload\); its \d+ MiB given back",
                     many.log())


def test_every_surface_shows_every_model(many):
    cards = {m["id"]: m for m in http_json(f"{many.url}/v1/models")[1]["data"]}
    assert cards[MODEL_NAME]["syshax"]["kind"] == "chat" and cards["embed"]["syshax"]["kind"] == "embedding"
    assert cards["second"]["syshax"] | {"state": None} == {"kind": "chat", "state": None, "load": "start",
                                                           "mode": "cpu"}
    shown = _syshax(many, "models", "list")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^second\s+chat\s+\S+\s+start\s+never\s", shown.stdout, re.M), shown.stdout
    assert re.search(r"^small\s+chat\s+\S+\s+on_demand\s+3s\s", shown.stdout, re.M), shown.stdout
    assert re.search(r"^embed\s+embedding\s+", shown.stdout, re.M), shown.stdout
    status = _syshax(many, "status")
    assert status.returncode == 0 and "chat model second (qwen2-" in status.stdout, status.stdout
    _chat(many, "second", "hello")
    _chat(many, MODEL_NAME, "hello")
    metrics = urllib_get(f"{many.url}/metrics")
    assert 'syshax_chat_model_loaded{model_name="second"} 1.0' in metrics
    assert re.search(r'syshax_chat_model_requests_total\{model_name="second"\} [1-9]', metrics)
    # the model's own series (vLLM's, under its model_name) join the daemon's, each family once
    from prometheus_client.parser import text_string_to_metric_families

    names = [f.name for f in text_string_to_metric_families(metrics)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    ttft = {s.labels["model_name"]: s.value for f in text_string_to_metric_families(metrics)
            if f.name == "vllm:time_to_first_token_seconds" for s in f.samples if s.name.endswith("_count")}
    assert ttft[MODEL_NAME] >= 1 and ttft["second"] >= 1, ttft
    page = urllib_get(f"{many.url}/")
    assert 'id="model-pick"' in page


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def test_requests_a_model_cannot_serve_say_why(many):
    code, answer = http_json(f"{many.url}/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]})
    assert code == 404 and answer["error"]["code"] == "model_not_found"
    code, answer = http_json(f"{many.url}/v1/embeddings", {"model": "second", "input": "hi"})
    assert code == 400 and "is a chat model" in answer["error"]["message"]
    code, answer = http_json(f"{many.url}/v1/chat/completions", {"model": "embed", "messages": [
        {"role": "user", "content": "hi"}]})
    assert code == 400 and "is an embedding model" in answer["error"]["message"]
    # the child's own checks answer in the child's words, through the daemon
    code, answer = http_json(f"{many.url}/v1/chat/completions", {"model": "second", "messages": []})
    assert code == 400 and answer["error"]["param"] == "messages"


def test_a_client_that_leaves_frees_the_childs_slot(many):
    """A stream whose client closes its socket is closed at the child too: the child logs its client left."""
    body = json.dumps({"model": "second", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 900,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    before = len(many.log())
    with socket.create_connection(("127.0.0.1", many.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: ") < 5:
            data = sock.recv(4096)
            assert data, got  # the stream ended (or was refused) early
            got += data
    wait_for(lambda: re.search(r"model second: .*client (left|disconnected) mid-stream", many.log()[before:]), 30,
             "the child to see its client leave")
    assert _chat(many, "second", "still serving")  # and it serves on


def test_a_client_that_leaves_a_whole_answer_frees_the_childs_slot(many):
    """A request without a stream whose client leaves before the answer: closed at the child too, at once."""
    _chat(many, "small", "load")  # (small: 900 tokens of the default model take seconds here, the tiny qwen2's not)
    body = json.dumps({"model": "small", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 900,
                       "n": 8, "temperature": 0, "ignore_eos": True}).encode()  # (8 x 900 tokens: many seconds)
    before = len(many.log())
    with socket.create_connection(("127.0.0.1", many.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)
    wait_for(lambda: "client left; its request to chat model small is closed" in many.log()[before:], 30,
             "the daemon to see its client leave")
    wait_for(lambda: re.search(r"model small: .*client left before the answer was ready", many.log()[before:]), 30,
             "the child to see its client leave")


def test_a_reload_reaches_the_chat_models_daemons(many):
    """A routing rule on a chat entry's model is taken (it applies in that model's daemon), which reloads too."""
    rule = json.dumps([{"name": "second on cpu", "priority": 1, "action": {"device": "CPU"},
                        "conditions": [{"field": "model", "operator": "eq", "value": "second"}]}])
    _chat(many, "second", "hello")  # loaded
    before = len(many.log())
    done = _syshax(many, "config", "set", "routing_rules", rule)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: re.search(r"model second: syshaxd: SIGHUP: reloaded .*routing_rules", many.log()[before:]), 30,
             "the child's reload")
    assert _chat(many, "second", "still serving")


def test_a_reload_while_a_model_loads_reaches_it_once_it_serves(many):
    """A model's daemon ends at a SIGHUP that comes before it handles one: new keys set while it loads are written
    to its file and sent once it says it serves. Its request is answered, and it takes the keys."""
    if _states(many)["small"] != "unloaded":
        assert _syshax(many, "models", "unload", "small").returncode == 0
    before = len(many.log())
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_chat, many, "small", PROMPTS[1])
        wait_for(lambda: "chat model small: started its daemon" in many.log()[before:], 30, "small's load")
        done = _syshax(many, "config", "set", "max_queue_size", "77")
        assert done.returncode == 0, done.stderr
        assert answer.result() == _chat(many, MODEL_NAME, PROMPTS[1])
    log = many.log()[before:]
    assert log.index('"key": "max_queue_size"') < log.index("chat model small: ready"), log[-3000:]  # while it loaded
    # (its daemon read its file after the keys were written, or before: then the reload applies them)
    reloaded = wait_for(lambda: re.search(r"model small: syshaxd: SIGHUP: reloaded (\S+): (no keys changed|applied "
                                          r"max_queue_size \d+ -> 77)", many.log()[before:]), 30,
                        "small's reload once it serves")
    assert "max_queue_size = 77" in Path(reloaded.group(1)).read_text()
    assert _chat_status(many, "small")["state"] == "ready"


def test_a_requests_keep_alive_holds_until_the_unload(many):
    """Ollama's keep_alive in a request: 0 unloads the model once the request is done; a bad one is a 400."""
    answer = _client(many).chat.completions.create(model="second", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, extra_body={"keep_alive": 0})
    assert answer.choices[0].message.content
    # (the log line comes once its daemon has stopped, after the state says unloaded)
    wait_for(lambda: re.search(r"chat model second: unloaded \(idle for \d+s, keep_alive 0s\)", many.log()), 30,
             "second's unload after keep_alive 0")
    assert _chat_status(many, "second")["keep_alive"] == -1  # its entry's again, from its next load
    code, answer = http_json(f"{many.url}/v1/chat/completions", {"model": "second", "keep_alive": "soon",
                                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and answer["error"]["param"] == "keep_alive", answer


def test_keep_alive_unloads_an_idle_chat_model(many):
    _chat(many, "small", "wake up")
    wait_for(lambda: _states(many)["small"] == "unloaded", 60, "small's unload after 3 s idle")
    assert re.search(r"chat model small: unloaded \(idle for \d+s, keep_alive 3s\)", many.log())


def test_a_failed_model_makes_room_first(many):
    """A model whose daemon died (an on-demand one, which only a request starts again) holds a place under
    max_loaded_models but serves nothing: loading another model unloads it before an idle one that serves, though
    it was used last. A model unloaded by hand stays unloaded, load = "start" or not."""
    if _states(many)["second"] != "unloaded":
        assert _syshax(many, "models", "unload", "second").returncode == 0
    assert _client(many).embeddings.create(model="embed", input="used before small").data
    want = _chat(many, "small", PROMPTS[0])
    loads = _chat_status(many, "small")["loads"]
    os.kill(_chat_status(many, "small")["pid"], signal.SIGKILL)  # an on-demand model: its next request starts it
    wait_for(lambda: _chat_status(many, "small")["state"] == "failed", 30, "the daemon to see its child die")
    assert _chat(many, "small", PROMPTS[0]) == want and _chat_status(many, "small")["loads"] == loads + 1
    os.kill(_chat_status(many, "small")["pid"], signal.SIGKILL)
    wait_for(lambda: _chat_status(many, "small")["state"] == "failed", 30, "the daemon to see its child die")
    time.sleep(2)  # (keep_started's time to start second, unloaded by hand, were it to)
    assert _states(many)["second"] == "unloaded"
    _chat(many, "second", "make room")
    assert _states(many) | {MODEL_NAME: None} == {MODEL_NAME: None, "second": "ready", "small": "unloaded",
                                                  "embed": "ready"}


def test_two_requests_for_an_unloaded_model_load_it_once(many):
    if _states(many)["small"] != "unloaded":
        _syshax(many, "models", "unload", "small")
    loads = _chat_status(many, "small")["loads"]
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda p: _chat(many, "small", p), PROMPTS))
    assert texts == [_chat(many, MODEL_NAME, p) for p in PROMPTS]
    assert _chat_status(many, "small")["loads"] == loads + 1


@pytest.mark.parametrize("keys, words", [
    ('quantize = "q3"', 'models[0] (c): quantize: must be "" (load every file as it is), "q4_0" or "q8_0"'),
    ('cpu_affinity = "4096"', "models[0] (c).cpu_affinity: CPUs 4096 are not this daemon's to use"),
    # 8,192 tokens for each of 100,000 sequences: terabytes of KV cache
    ("n_ctx = 8192\nbatch_slots = 100000", "models: the models loaded at once (c (87 MiB file, "),
])
def test_bad_chat_entries_are_refused_at_start(default_model, tmp_path, keys, words):
    """An entry its daemon could not serve stops this daemon's start, by name, not a request later."""
    d = start_daemon(tmp_path, {"model": str(default_model)}, wait=False,
                     tables=f'[[models]]\nname = "c"\npath = "{default_model}"\n{keys}\n')
    try:
        assert d.proc.wait(120) != 0
    finally:
        d.stop()
    assert words in d.log(), d.log()


def test_models_dir_serves_each_file_by_name(default_model, second_file, embed_file, tmp_path):
    """--models-dir: each GGUF of the folder by its file name, on demand, chat or embedding as its header says; not
    a vision projector, nor the quantized copy the daemon caches beside a file, nor the daemon's own file."""
    folder = tmp_path / "gguf"
    folder.mkdir()
    alpha = make_family_model("llama", MODEL_DIR / "families")
    for name, target in [("alpha.gguf", alpha), ("beta.gguf", second_file), ("vectors.gguf", embed_file),
                         ("mmproj-alpha-f16.gguf", alpha), ("beta.q4_0.gguf", second_file),
                         ("own.gguf", default_model)]:  # (own: the daemon's own file, served as its own model)
        (folder / name).symlink_to(target)
    (folder / "partial.gguf").write_bytes(b"GGUF\x03\x00")  # a file still downloading: left out, with a warning
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024},
                     args=["--models-dir", str(folder)])
    try:
        cards = {m["id"]: m["syshax"] for m in http_json(f"{d.url}/v1/models")[1]["data"]}
        assert set(cards) == {MODEL_NAME, "alpha", "beta", "vectors"}, cards
        assert re.search(r"WARNING .*models_dir \(.*partial.gguf\): .* is not a GGUF file .*; not served", d.log())
        assert [cards[n]["kind"] for n in ("alpha", "beta", "vectors")] == ["chat", "chat", "embedding"]
        assert all(cards[n]["state"] == "unloaded" and cards[n]["load"] == "on_demand" for n in ("alpha", "beta"))
        assert _chat(d, "alpha", PROMPTS[0]) != _chat(d, "beta", PROMPTS[0])
        assert len(_client(d).embeddings.create(model="vectors", input="x").data[0].embedding) == 256
    finally:
        assert d.stop(60) == 0, d.log()


def test_max_loaded_models_counts_the_daemons_own_model(default_model, tmp_path):
    """1 leaves no room for an entry beside the daemon's own model, which is always loaded: refused at start."""
    d = start_daemon(tmp_path, {"model": str(default_model), "max_loaded_models": 1}, wait=False,
                     tables=f'[[models]]\nname = "c"\npath = "{default_model}"\n')
    try:
        assert d.proc.wait(120) != 0
    finally:
        d.stop()
    assert "max_loaded_models = 1 leaves no room for the models of [[models]]" in d.log(), d.log()
