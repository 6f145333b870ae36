"""POST /v1/rerank and /rerank: rerankers of [[models]] beside the chat model and an embedding model, in a real
daemon.

The rerankers are families.py's qwen3-reranker (Qwen3-Reranker's kind: the qwen3 arch, which llama.cpp's converter
writes with "rank" pooling, a classifier of the LM head's "yes" and "no" rows, and the model's prompt as a "rerank"
template) and bert-reranker (a cross-encoder: BERT with a one-output classifier, which the converter writes with
its label and no pooling type, as bge-reranker's GGUFs are). Qwen3's scores are checked against the same model in
transformers, scored as Qwen3-Reranker's card scores it: the prompt with the query and the document, the last
token's logits of "yes" and "no", softmaxed, P(yes). The cross-encoder's against transformers' hidden states, scored
as llama.cpp scores the file: [CLS] query [SEP] document [SEP] (transformers' own pair), the [CLS] row through the
classifier (the converter leaves BERT's pooler layer out).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon
from families import hf_folder, hf_tokenizer, make_family_model

FAMILY = "qwen3-reranker"
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France, on the Seine.",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Berlin is the capital of Germany.",
    "a",
]


@pytest.fixture(scope="module")
def files() -> tuple:
    return tuple(make_family_model(f, MODEL_DIR / "families") for f in (FAMILY, "bert-embedding", "bert-reranker"))


@pytest.fixture(scope="module")
def daemon(default_model, files, tmp_path_factory):
    reranker, embedder, cross = files
    tmp = tmp_path_factory.mktemp("rerank")
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024,
                           "admin_socket": str(tmp / "admin.sock")},
                     tables=f'[[models]]\nname = "rerank"\npath = "{reranker}"\nn_ctx = 256\n'
                            f'[[models]]\nname = "embed"\npath = "{embedder}"\n'
                            f'[[models]]\nname = "cross"\npath = "{cross}"\nload = "on_demand"\n')
    d.socket = tmp / "admin.sock"
    yield d
    code = d.stop()
    assert code == 0, f"syshaxd exited with {code}:\n{d.log()}"


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[int, float]]:
    """document -> (the pair's tokens, P(yes)) from transformers, float32, with the file's own rerank prompt."""
    import gguf
    import torch
    import transformers

    path = make_family_model(FAMILY, MODEL_DIR / "families")
    template = str(gguf.GGUFReader(str(path)).fields["tokenizer.chat_template.rerank"].contents())
    tokenizer = hf_tokenizer(FAMILY, MODEL_DIR / "families")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder(FAMILY, MODEL_DIR / "families"),
                                                              dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    out = {}
    for document in DOCUMENTS:
        ids = tokenizer(template.replace("{query}", QUERY).replace("{document}", document),
                        add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        out[document] = (len(ids), float(torch.softmax(torch.stack([logits[yes], logits[no]]), 0)[0]))
    return out


@pytest.fixture(scope="module")
def cross_reference() -> dict[str, tuple[int, float]]:
    """document -> (the pair's tokens, score) of the cross-encoder, from transformers' float32 hidden states."""
    import torch
    import transformers

    tokenizer = hf_tokenizer("bert-reranker", MODEL_DIR / "families")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        hf_folder("bert-reranker", MODEL_DIR / "families"), dtype=torch.float32).eval()
    out = {}
    for document in DOCUMENTS:
        ids = tokenizer(QUERY, document)["input_ids"]  # [CLS] query [SEP] document [SEP]
        with torch.no_grad():  # token types all 0, as llama.cpp passes them
            first = model.bert(torch.tensor([ids])).last_hidden_state[0, 0]
            out[document] = (len(ids), float(model.classifier(first)[0]))
    return out


def _post(daemon, body: dict, path: str = "/v1/rerank") -> tuple[int, dict]:
    return http_json(f"{daemon.url}{path}", body)


def test_scores_match_transformers(daemon, reference):
    """Each document's relevance_score is the model's P(yes) (within 0.01 of transformers'), the results come best
    first with each document's index, and usage counts the pairs' tokens."""
    code, answer = _post(daemon, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS})
    assert code == 200, answer
    assert answer["object"] == "list" and answer["model"] == "rerank"
    results = answer["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert abs(r["relevance_score"] - reference[DOCUMENTS[r["index"]]][1]) < 0.01, r
        assert "document" not in r
    assert answer["usage"]["prompt_tokens"] == sum(n for n, _ in reference.values())
    # the same pair scored alone gives the same bits: one pair a pass
    alone = _post(daemon, {"model": "rerank", "query": QUERY, "documents": [DOCUMENTS[3]]})[1]
    assert alone["results"][0]["relevance_score"] == next(r["relevance_score"] for r in results if r["index"] == 3)


def test_a_cross_encoder_scores_as_llama_cpp_reads_it(daemon, cross_reference):
    """A classifier GGUF with no pooling type (bge-reranker's kind) is a reranker, loaded at its first request: its
    scores are the [CLS] row through the classifier, its raw logit (within 0.01 of transformers'), on pairs laid out
    [CLS] query [SEP] document [SEP] as transformers lays them out, and usage counts those tokens."""
    code, answer = _post(daemon, {"model": "cross", "query": QUERY, "documents": DOCUMENTS})
    assert code == 200, answer
    for r in answer["results"]:
        assert abs(r["relevance_score"] - cross_reference[DOCUMENTS[r["index"]]][1]) < 0.01, r
    assert answer["usage"]["prompt_tokens"] == sum(n for n, _ in cross_reference.values())
    assert http_json(f"{daemon.base_url}/models/cross")[1]["syshax"]["pooling"] == "rank"


def test_top_n_return_documents_and_the_plain_path(daemon):
    full = _post(daemon, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS})[1]["results"]
    code, cut = _post(daemon, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                               "return_documents": True}, path="/rerank")
    assert code == 200, cut
    assert [r["index"] for r in cut["results"]] == [r["index"] for r in full[:2]]
    assert all(r["document"] == {"text": DOCUMENTS[r["index"]]} for r in cut["results"])
    many = _post(daemon, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 99})[1]
    assert len(many["results"]) == len(DOCUMENTS)


@pytest.mark.parametrize("body, status, words", [
    ({"model": "rerank", "documents": ["a"]}, 400, "you must provide 'query'"),
    ({"model": "rerank", "query": "", "documents": ["a"]}, 400, "must not be an empty string"),
    ({"model": "rerank", "query": 3, "documents": ["a"]}, 400, "Invalid type for 'query'"),
    ({"model": "rerank", "query": "q"}, 400, "you must provide 'documents'"),
    ({"model": "rerank", "query": "q", "documents": []}, 400, "the array is empty"),
    ({"model": "rerank", "query": "q", "documents": "a"}, 400, "Invalid type for 'documents'"),
    ({"model": "rerank", "query": "q", "documents": ["a", 1]}, 400, "Invalid type for 'documents[1]'"),
    ({"model": "rerank", "query": "q", "documents": ["a", ""]}, 400, "'documents[1]': a document must not"),
    ({"model": "rerank", "query": "q", "documents": ["a"] * 2049}, 400, "at most 2048 documents"),
    ({"model": "rerank", "query": "q", "documents": ["a"], "top_n": 0}, 400, "Invalid 'top_n'"),
    ({"model": "rerank", "query": "q", "documents": ["a"], "return_documents": "yes"}, 400,
     "Invalid type for 'return_documents'"),
    ({"model": "rerank", "query": "q", "documents": ["a"], "rank_fields": ["x"]}, 400,
     "Unrecognized request argument supplied: rank_fields"),
    ({"model": "rerank", "query": "q", "documents": ["word " * 300]}, 400,
     "documents[0] has"),
    ({"query": "q", "documents": ["a"]}, 400, "this server's rerankers: `rerank`, `cross`"),
    ({"model": "embed", "query": "q", "documents": ["a"]}, 400, "is an embedding model: it makes vectors"),
    ({"model": MODEL_NAME, "query": "q", "documents": ["a"]}, 400, "is a chat model"),
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "This server's rerankers: `rerank`, `cross`."),
])
def test_bad_requests_say_why(daemon, body, status, words):
    code, answer = _post(daemon, body)
    assert code == status and words in answer["error"]["message"], answer
    assert _post(daemon, {"model": "rerank", "query": "q", "documents": ["still serving"]})[0] == 200


def test_an_over_long_pair_says_by_how_much(daemon):
    code, answer = _post(daemon, {"model": "rerank", "query": "q", "documents": ["fine", "word " * 300]})
    assert code == 400 and answer["error"]["param"] == "documents"
    assert answer["error"]["code"] == "context_length_exceeded"
    message = answer["error"]["message"]
    assert "documents[1] has" in message and "with the query and the model's prompt around it" in message
    assert "over the 256 an input may hold here" in message


def test_a_query_too_long_for_any_document_names_the_query(daemon):
    code, answer = _post(daemon, {"model": "rerank", "query": "word " * 300, "documents": ["a", "b"]})
    assert code == 400 and answer["error"]["param"] == "query", answer
    assert "shorten the query" in answer["error"]["message"]


@pytest.mark.parametrize("body, where", [
    ('{"model": "rerank", "query": "\\ud800", "documents": ["a"]}', "query"),
    ('{"model": "rerank", "query": "q", "documents": ["a", "x\\udfff"]}', "documents[1]"),
])
def test_text_that_is_not_unicode_is_refused_and_the_worker_lives(daemon, body, where):
    """A lone surrogate (JSON's \\ud800) is no text: a 400 naming the field, and the worker goes on (its pid)."""
    import urllib.error
    import urllib.request

    pid = daemon.status()["embedding_models"][0]["worker"]["pid"]
    request = urllib.request.Request(f"{daemon.url}/v1/rerank", body.encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and f"Invalid '{where}'" in caught.value.read().decode()
    assert _post(daemon, {"model": "rerank", "query": "q", "documents": ["a"]})[0] == 200
    assert daemon.status()["embedding_models"][0]["worker"]["pid"] == pid


def test_other_apis_sent_to_a_reranker_say_where_to_go(daemon):
    code, answer = http_json(f"{daemon.base_url}/embeddings", {"model": "rerank", "input": "a"})
    assert code == 400 and "is a reranker: it scores documents against a query (POST /v1/rerank)" in \
        answer["error"]["message"], answer
    code, answer = http_json(f"{daemon.base_url}/chat/completions",
                             {"model": "rerank", "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and "is a reranker" in answer["error"]["message"] and MODEL_NAME in answer["error"]["message"]
    code, cards = http_json(f"{daemon.base_url}/models")
    card = next(m for m in cards["data"] if m["id"] == "rerank")
    assert card["syshax"]["pooling"] == "rank" and card["syshax"]["state"] == "ready"
    assert "dimensions" not in card["syshax"]  # scores, not vectors
    shown = subprocess.run([sys.executable, "-m", "syshaxd.cli", "status", "--socket", str(daemon.socket)],
                           capture_output=True, text=True, timeout=60)
    assert "reranker rerank (" in shown.stdout and "rank pooling): ready" in shown.stdout, shown.stdout
    assert "embedding model embed (" in shown.stdout and "256 dimensions, mean pooling" in shown.stdout
