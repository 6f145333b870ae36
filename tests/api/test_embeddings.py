"""POST /v1/embeddings: an embedding model of [[models]] beside the chat model, in a real daemon.

The models are families.py's qwen3-embedding (Qwen3-Embedding's shape: a decoder, last-token pooling) and
bert-embedding (bge's and all-MiniLM's kind: an encoder, WordPiece, mean pooling), converted by llama.cpp's
converter; their vectors are checked against the same models in transformers (the last hidden state at the last
token, or its mean over the tokens, scaled to length 1), through the official openai client and langchain-openai's
OpenAIEmbeddings.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon, wait_for
from families import hf_folder, hf_tokenizer, make_family_model

FAMILY = "qwen3-embedding"
N_CTX = 256
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors for retrieval.",
    "syshax serves a chat model and an embedding model from one daemon.",
    "a",
    "What is the capital of France? Paris is the capital and largest city of France, on the Seine.",
    "def add(a, b):\n    return a + b\n",
]


BERT = "bert-embedding"


@pytest.fixture(scope="module")
def embed_file() -> Path:
    return make_family_model(FAMILY, MODEL_DIR / "families")


@pytest.fixture(scope="module")
def bert_file() -> Path:
    return make_family_model(BERT, MODEL_DIR / "families")


def _tables(path: Path, bert: Path) -> str:
    """The eager model, the same file under a second name loaded at its first request, and the BERT model (on
    demand too, at its own n_ctx: the 512 positions it was trained with)."""
    return (f'[[models]]\nname = "embed"\npath = "{path}"\nn_ctx = {N_CTX}\n'
            f'[[models]]\nname = "embed-lazy"\npath = "{path}"\nn_ctx = {N_CTX}\nload = "on_demand"\n'
            f'[[models]]\nname = "bert"\npath = "{bert}"\nload = "on_demand"\n')


@pytest.fixture(scope="module")
def daemon(default_model, embed_file, bert_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024,
                           "admin_socket": str(tmp / "admin.sock")}, tables=_tables(embed_file, bert_file))
    d.socket = tmp / "admin.sock"
    yield d
    code = d.stop()
    assert code == 0, f"syshaxd exited with {code}:\n{d.log()}"


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """text -> (token ids, unit vector) from transformers, float32."""
    import torch
    import transformers

    folder = hf_folder(FAMILY, MODEL_DIR / "families")
    tokenizer = hf_tokenizer(FAMILY, MODEL_DIR / "families")
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        out[text] = (ids, last / np.linalg.norm(last))
    return out


@pytest.fixture(scope="module")
def bert_reference():
    """text -> (token ids, unit vector): the BERT model's last hidden states averaged over the text's tokens
    ([CLS] and [SEP] among them), as sentence-transformers' mean pooling gives them, float32."""
    import torch
    import transformers

    tokenizer = hf_tokenizer(BERT, MODEL_DIR / "families")
    model = transformers.AutoModel.from_pretrained(hf_folder(BERT, MODEL_DIR / "families"),
                                                   dtype=torch.float32).eval()
    out = {}
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            mean = model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
        out[text] = (ids, mean / np.linalg.norm(mean))
    return out


def _post(daemon, body: dict) -> tuple[int, dict]:
    return http_json(f"{daemon.base_url}/embeddings", body)


def test_vectors_match_transformers(client, reference):
    """Each vector is the model's own (cosine >= 0.99 with transformers'), of length 1, in input order, and usage
    counts the tokens transformers' tokenizer gives."""
    answer = client.embeddings.create(model="embed", input=TEXTS)  # the client asks for base64 and decodes it
    assert answer.model == "embed" and [d.index for d in answer.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, answer.data):
        vector = np.array(item.embedding)
        ids, expected = reference[text]
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-4
        assert float(vector @ expected) >= 0.99, text
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(reference[t][0]) for t in TEXTS)


def test_float_and_base64_agree(daemon):
    floats = _post(daemon, {"model": "embed", "input": TEXTS[0], "encoding_format": "float"})[1]
    coded = _post(daemon, {"model": "embed", "input": TEXTS[0], "encoding_format": "base64"})[1]
    as_floats = np.array(floats["data"][0]["embedding"], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(coded["data"][0]["embedding"]), dtype="<f4")
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert decoded.shape == (256,) and np.array_equal(as_floats, decoded)


def test_token_ids_equal_text(daemon, reference):
    """An input of token ids gives the vector of the text they tokenize: one array, and an array of arrays."""
    ids = [reference[t][0] for t in TEXTS[:3]]
    by_text = _post(daemon, {"model": "embed", "input": TEXTS[:3], "encoding_format": "float"})[1]
    by_ids = _post(daemon, {"model": "embed", "input": ids, "encoding_format": "float"})[1]
    one = _post(daemon, {"model": "embed", "input": ids[0], "encoding_format": "float"})[1]
    for a, b in zip(by_text["data"], by_ids["data"]):
        assert a["embedding"] == b["embedding"]
    assert one["data"][0]["embedding"] == by_text["data"][0]["embedding"]
    assert by_ids["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


def test_concurrent_equals_alone(daemon):
    """Inputs of concurrent requests take turns on the worker; each gets the very vector it gets alone."""
    alone = {t: _post(daemon, {"model": "embed", "input": t, "encoding_format": "float"})[1]["data"][0]["embedding"]
             for t in TEXTS}
    bodies = [{"model": "embed", "input": TEXTS[i:] + TEXTS[:i], "encoding_format": "float"}
              for i in range(len(TEXTS))] * 2
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: _post(daemon, b), bodies))
    for body, (status, answer) in zip(bodies, answers):
        assert status == 200, answer
        for text, item in zip(body["input"], answer["data"]):
            assert item["embedding"] == alone[text], text


def test_langchain_openai_embeddings(daemon, reference):
    """langchain-openai's OpenAIEmbeddings, as a RAG pipeline uses it, gets the model's vectors."""
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not tiktoken's (OpenAI's) token ids of them
    embedder = OpenAIEmbeddings(model="embed", base_url=daemon.base_url, api_key="unused",
                                check_embedding_ctx_length=False, max_retries=0)
    docs = embedder.embed_documents(TEXTS[:4])
    query = embedder.embed_query(TEXTS[4])
    for text, vector in zip(TEXTS[:4], docs):
        assert float(np.array(vector) @ reference[text][1]) >= 0.99
    assert float(np.array(query) @ reference[TEXTS[4]][1]) >= 0.99


def test_bert_vectors_match_transformers(daemon, client, bert_reference):
    """A BERT-style model (an encoder with mean pooling, llama.cpp's WordPiece tokenizer) loads at its first request
    and gives the model's own vectors, token counts and an over-long input's 400 at its 512 positions; through
    langchain-openai too."""
    from langchain_openai import OpenAIEmbeddings

    answer = client.embeddings.create(model="bert", input=TEXTS)
    for text, item in zip(TEXTS, answer.data):
        assert float(np.array(item.embedding) @ bert_reference[text][1]) >= 0.99, text
    assert answer.usage.prompt_tokens == sum(len(bert_reference[t][0]) for t in TEXTS)
    card = client.models.retrieve("bert").syshax
    assert card["state"] == "ready" and card["pooling"] == "mean" and card["dimensions"] == 256
    embedder = OpenAIEmbeddings(model="bert", base_url=daemon.base_url, api_key="unused",
                                check_embedding_ctx_length=False, max_retries=0)
    for text, vector in zip(TEXTS[:3], embedder.embed_documents(TEXTS[:3])):
        assert float(np.array(vector) @ bert_reference[text][1]) >= 0.99
    code, error = _post(daemon, {"model": "bert", "input": "word " * 600})
    assert code == 400 and "602 tokens, 90 over the 512 an input may hold here" in error["error"]["message"], error


@pytest.mark.parametrize("body, status, words", [
    ({"model": "embed", "input": "word " * (N_CTX + 40)}, 400, "over the 256 an input may hold here"),
    ({"model": "embed", "input": ""}, 400, "empty string"),
    ({"model": "embed", "input": []}, 400, "array is empty"),
    ({"model": "embed", "input": [[]]}, 400, "must not be empty"),
    ({"model": "embed", "input": ["a"] * 2049}, 400, "at most 2048 inputs"),
    ({"model": "embed", "input": ["a", [1, 2]]}, 400, "not both"),
    ({"model": "embed", "input": [1, "a"]}, 400, "Invalid type for 'input[0]'"),
    ({"model": "embed", "input": [10**9]}, 400, "token id 1000000000"),
    ({"model": "embed", "input": 7}, 400, "Invalid type for 'input'"),
    ({"model": "embed", "input": ["a", "\ud800"]}, 400, "'input[1]': character 0 is a lone UTF-16 surrogate"),
    ({"model": "embed"}, 400, "you must provide 'input'"),
    ({"input": "a"}, 400, "you must provide a model"),
    ({"model": "embed", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "embed", "input": "a", "dimensions": 64}, 400, "vectors of 256 dimensions"),
    ({"model": "embed", "input": "a", "pooling": "mean"}, 400, "Unrecognized request argument supplied: pooling"),
    ({"model": MODEL_NAME, "input": "a"}, 400, "is a chat model"),
    ({"model": "nope", "input": "a"}, 404, "`embed`, `embed-lazy`"),
])
def test_bad_requests_say_why(daemon, body, status, words):
    code, answer = _post(daemon, body)
    assert code == status and words in answer["error"]["message"], answer
    assert _post(daemon, {"model": "embed", "input": "still serving"})[0] == 200


def test_over_long_input_names_it(daemon):
    code, answer = _post(daemon, {"model": "embed", "input": ["fine", "word " * (N_CTX + 10)]})
    assert code == 400 and answer["error"]["param"] == "input"
    assert answer["error"]["code"] == "context_length_exceeded"
    assert "input[1] has" in answer["error"]["message"] and "shorten or split it" in answer["error"]["message"]


def test_chat_sent_to_an_embedding_model(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "is an embedding model" in str(caught.value) and MODEL_NAME in str(caught.value)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4)
    assert answer.choices[0].message.content is not None


def test_models_status_metrics_and_on_demand_load(daemon, client):
    """/v1/models lists every model with its state; the on-demand one loads at its first request; the status,
    `syshax status` and /metrics show them."""
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "embed", "embed-lazy", "bert"}
    assert cards["embed"].syshax == {"kind": "embedding", "state": "ready", "load": "start", "dimensions": 256,
                                     "pooling": "last"}
    assert cards["embed-lazy"].syshax["state"] == "unloaded"
    lazy = client.embeddings.create(model="embed-lazy", input=TEXTS[0])  # waits for the load
    eager = client.embeddings.create(model="embed", input=TEXTS[0])
    assert lazy.data[0].embedding == eager.data[0].embedding  # the same file in another worker: the same bits
    assert client.models.retrieve("embed-lazy").syshax["state"] == "ready"
    assert "embedding model embed-lazy: loading (on its first request)" in daemon.log()

    status = daemon.status()
    models = {m["name"]: m for m in status["embedding_models"]}
    assert models["embed"]["state"] == "ready" and models["embed"]["requests"] >= 1
    assert models["embed"]["worker"]["role"] == "embed" and models["embed"]["tokens"] > 0
    code, health = http_json(f"{daemon.url}/health")
    assert code == 200 and {"embed-embed", "embed-embed-lazy"} <= {w["name"] for w in health["workers"]}

    shown = subprocess.run([sys.executable, "-m", "syshaxd.cli", "status", "--socket", str(daemon.socket)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "embedding model embed (" in shown.stdout and "embedding model embed-lazy (" in shown.stdout, shown.stdout

    import urllib.request

    scraped = urllib.request.urlopen(f"{daemon.url}/metrics", timeout=10).read().decode()
    assert 'syshax_embedding_model_loaded{model_name="embed"} 1.0' in scraped
    assert 'syshax_embedding_requests_total{model_name="embed-lazy"} 1.0' in scraped


def test_a_dead_embedding_worker_is_replaced(daemon):
    pid = daemon.status()["embedding_models"][0]["worker"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: daemon.status()["embedding_models"][0]["worker"]["state"] == "ready"
             and daemon.status()["embedding_models"][0]["worker"]["pid"] != pid, 120, "the worker's restart")
    assert _post(daemon, {"model": "embed", "input": "back again"})[0] == 200


def test_chat_keys_on_an_embedding_model_are_refused_at_start(default_model, embed_file, tmp_path):
    """mode, quantize, draft_model and batch_slots are a chat model's: on an embedding entry they say so."""
    d = start_daemon(tmp_path, {"model": str(default_model)}, wait=False,
                     tables=f'[[models]]\nname = "e"\npath = "{embed_file}"\nmode = "cpu"\n')
    try:
        assert d.proc.wait(120) != 0
    finally:
        d.stop()
    assert "models[0] (e): mode set on an embedding model" in d.log()


@pytest.mark.parametrize("table, words", [
    ('[[models]]\nname = "e"\n', "models[0]: path is required"),
    ('[[models]]\nname = "e"\npath = "/x.gguf"\nmode = "fast"\n', 'mode: must be "cpu", "gpu"'),
    ('[[models]]\nname = "e"\npath = "/x.gguf"\nload = "later"\n', 'load: must be "start"'),
    ('[[models]]\nname = "e"\npath = "/x.gguf"\nbatch = 8\n', "unknown key(s) batch"),
    ('[[models]]\nname = "e"\npath = "/x.gguf"\nkeep_alive = "soon"\n', "keep_alive: expected seconds"),
    ('[[models]]\nname = "e"\npath = "/x.gguf"\n[[models]]\nname = "e"\npath = "/y.gguf"\n', "more than one"),
])
def test_bad_entries_are_refused_by_name(table, words, tmp_path):
    from syshaxd.config import ConfigError, load

    path = tmp_path / "syshax.toml"
    path.write_text(table)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert words in str(caught.value)


def test_entries_round_trip_through_the_admin_form(embed_file):
    """`syshax config get models` shows the tables as written (defaults left out); they parse back the same."""
    from syshaxd.config import from_mapping, plain

    cfg = from_mapping({"models": [{"name": "embed", "path": str(embed_file), "n_ctx": 512, "load": "on_demand",
                                    "keep_alive": "5m"}]})
    shown = plain("models", cfg.models)
    assert shown == [{"name": "embed", "path": str(embed_file), "n_ctx": 512, "load": "on_demand",
                      "keep_alive": 300.0}]
    assert from_mapping({"models": json.loads(json.dumps(shown))}).models == cfg.models


# --- loading and unloading ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def swapping(default_model, embed_file, tmp_path_factory):
    """Three entries of one file under max_loaded_models = 3 (two entries beside the daemon's own model): one
    loaded at start, two on demand, one of those unloaded after 2 s idle."""
    tmp = tmp_path_factory.mktemp("swapping")
    entry = f'path = "{embed_file}"\nn_ctx = {N_CTX}\n'
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024,
                           "max_loaded_models": 3, "admin_socket": str(tmp / "admin.sock")},
                     tables=f'[[models]]\nname = "a"\n{entry}'
                            f'[[models]]\nname = "b"\n{entry}load = "on_demand"\n'
                            f'[[models]]\nname = "c"\n{entry}load = "on_demand"\nkeep_alive = "2s"\n')
    d.socket = tmp / "admin.sock"
    yield d
    assert d.stop() == 0, d.log()


def _states(daemon) -> dict[str, str]:
    return {m["name"]: m["state"] for m in daemon.status()["embedding_models"]}


def _syshax(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args, "--socket", str(daemon.socket)],
                          capture_output=True, text=True, timeout=120)


def test_max_loaded_models_unloads_the_least_recently_used(swapping):
    assert _states(swapping) == {"a": "ready", "b": "unloaded", "c": "unloaded"}
    assert _post(swapping, {"model": "b", "input": "load b"})[0] == 200
    assert _states(swapping) == {"a": "ready", "b": "ready", "c": "unloaded"}
    pid_a = {m["name"]: m for m in swapping.status()["embedding_models"]}["a"]["worker"]["pid"]
    assert _post(swapping, {"model": "c", "input": "load c"})[0] == 200  # a is the least recently used
    assert _states(swapping)["a"] == "unloaded" and _states(swapping)["c"] == "ready"
    assert ("embedding model a: unloaded (to make room for c (max_loaded_models = 3, the daemon's own model "
            "counted))") in swapping.log()
    assert not _alive(pid_a)  # its memory is given back with its process
    assert http_json(f"{swapping.url}/health")[0] == 200  # unloaded on purpose: still healthy


def test_keep_alive_unloads_an_idle_model(swapping):
    if _states(swapping)["c"] != "ready":
        assert _post(swapping, {"model": "c", "input": "load c"})[0] == 200
    wait_for(lambda: re.search(r"embedding model c: unloaded \(idle for \d+s, keep_alive 2s\); its \d+ MiB given "
                               "back", swapping.log()), 30, "c's unload after 2 s idle")
    c = {m["name"]: m for m in swapping.status()["embedding_models"]}["c"]
    assert c["rss_mib"] == 0 and c["worker"] is None and c["unloads"] >= 1
    answer = _post(swapping, {"model": "c", "input": "back", "encoding_format": "float"})  # loads it again
    assert answer[0] == 200 and len(answer[1]["data"][0]["embedding"]) == 256
    wait_for(lambda: _states(swapping)["c"] == "unloaded", 30, "c's unload after 2 s idle again")
    time.sleep(2.5)  # long unused: a load asked for by hand counts its keep_alive from the load
    assert http_json(f"{swapping.url}/models/load", {"model": "c"}) == (200, {"success": True})
    time.sleep(1.0)
    assert _states(swapping)["c"] == "ready"


def test_a_requests_keep_alive_unloads_it_when_done(swapping):
    """Ollama's keep_alive in the request: 0 unloads the model once the request is done; a bad one is a 400."""
    code, answer = _post(swapping, {"model": "b", "input": "one", "keep_alive": 0})
    assert code == 200 and len(answer["data"]) == 1
    wait_for(lambda: re.search(r"embedding model b: unloaded \(idle for \d+s, keep_alive 0s\)", swapping.log()), 30,
             "b's unload after keep_alive 0")
    code, answer = _post(swapping, {"model": "b", "input": "one", "keep_alive": "later"})
    assert code == 400 and answer["error"]["param"] == "keep_alive", answer


def test_syshax_models_list_load_unload(swapping):
    shown = _syshax(swapping, "models", "list")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^c\s+embedding\s+\S+\s+on_demand\s+2s\s", shown.stdout, re.M), shown.stdout
    loaded = _syshax(swapping, "models", "load", "a")
    assert loaded.returncode == 0 and loaded.stdout.startswith("a: ready (worker pid"), loaded.stdout + loaded.stderr
    pid = {m["name"]: m for m in swapping.status()["embedding_models"]}["a"]["worker"]["pid"]
    unloaded = _syshax(swapping, "models", "unload", "a")
    assert unloaded.returncode == 0 and unloaded.stdout.strip() == "a: unloaded", unloaded.stdout
    assert not _alive(pid) and _states(swapping)["a"] == "unloaded"
    wrong = _syshax(swapping, "models", "unload", "nope")
    assert wrong.returncode == 2 and "'nope' is no model of [[models]]" in wrong.stderr


def test_router_load_and_unload_endpoints(swapping):
    assert http_json(f"{swapping.url}/models/load", {"model": "b"}) == (200, {"success": True})
    assert _states(swapping)["b"] == "ready"
    assert http_json(f"{swapping.url}/models/unload", {"model": "b"}) == (200, {"success": True})
    assert _states(swapping)["b"] == "unloaded"
    code, answer = http_json(f"{swapping.url}/models/unload", {"model": MODEL_NAME})
    assert code == 400 and "stays loaded" in answer["error"]["message"]
    assert http_json(f"{swapping.url}/models/load", {"model": "nope"})[0] == 404


def test_an_unload_waits_for_the_requests_in_flight(swapping):
    """A request running when its model is told to unload gets every vector; the unload happens after it."""
    assert http_json(f"{swapping.url}/models/load", {"model": "b"})[0] == 200
    body = {"model": "b", "input": [f"{i} " + "word " * (N_CTX - 20) for i in range(64)], "encoding_format": "float"}
    # (64 inputs of about 240 tokens: a few seconds of work)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_post, swapping, body)
        wait_for(lambda: {m["name"]: m for m in swapping.status()["embedding_models"]}["b"]["worker"]["stats"]
                 ["waiting"] > 0 or running.done(), 30, "the request to reach the worker")
        assert http_json(f"{swapping.url}/models/unload", {"model": "b"}, timeout=120) == (200, {"success": True})
        code, answer = running.result(120)
    assert code == 200 and len(answer["data"]) == 64
    assert _states(swapping)["b"] == "unloaded"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def tight(default_model, embed_file, tmp_path_factory):
    """Room for one entry at a time (max_loaded_models = 2, the daemon's own model counted): x, and y with
    keep_alive 0 (unloaded once its requests are done), both on demand."""
    tmp = tmp_path_factory.mktemp("tight")
    entry = f'path = "{embed_file}"\nn_ctx = {N_CTX}\nload = "on_demand"\n'
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024,
                           "max_loaded_models": 2},
                     tables=f'[[models]]\nname = "x"\n{entry}[[models]]\nname = "y"\n{entry}keep_alive = 0\n')
    yield d
    assert d.stop() == 0, d.log()


def test_two_models_asked_at_once_in_room_for_one_take_turns(tight):
    """Neither unloads the other while it loads or is wanted: each request is answered, each model loaded once
    for it."""
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda name: _post(tight, {"model": name, "input": f"for {name}"}),
                                ["x", "y", "x", "y"]))
    assert [code for code, _ in answers] == [200] * 4, answers
    models = {m["name"]: m for m in tight.status()["embedding_models"]}
    assert models["x"]["loads"] + models["y"]["loads"] <= 4  # no load was thrown away half-way and redone


def test_keep_alive_zero_unloads_once_the_request_is_done(tight):
    code, answer = _post(tight, {"model": "y", "input": "load and go", "encoding_format": "float"})
    assert code == 200 and len(answer["data"][0]["embedding"]) == 256
    # the log line comes once the worker has stopped, after the state says unloaded
    wait_for(lambda: re.search(r"embedding model y: unloaded \(idle for \d+s, keep_alive 0s\)", tight.log()), 30,
             "y's unload after its request")
    assert _states(tight)["y"] == "unloaded"


def test_a_client_that_leaves_has_its_inputs_dropped(tight):
    """A request whose client closes the connection before its vectors are ready stops taking turns."""
    import socket

    body = json.dumps({"model": "x", "input": [f"{i} " + "word " * (N_CTX - 20) for i in range(64)]}).encode()
    with socket.create_connection(("127.0.0.1", tight.port)) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)  # the model loads (when not loaded) and starts on the inputs
    wait_for(lambda: "client left; its inputs are dropped" in tight.log(), 60, "the request's cancel")
    assert _post(tight, {"model": "x", "input": "still serving"})[0] == 200
