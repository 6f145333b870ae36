"""A streamed text chunk is written from a template made once per choice (api/openai/answers.py, Exchange.text_chunk):
its bytes must be, for every text, the very bytes json.dumps writes of the chunk's dict, in chat and in
completions, for every choice of a request."""

from __future__ import annotations

import json

import pytest

from syshaxd.api.core.sse import data, json_bytes
from syshaxd.api.core.validate import parse_chat, parse_completion
from syshaxd.api.openai.chat_shapes import ChatExchange
from syshaxd.api.openai.completion_shapes import CompletionExchange

TEXTS = ["", " Paris", "a \"quoted\" word", "back\\slash", "line\nbreak\ttab\r", "\x00 and \x1f", "café", "日本語",
         "🙂 emoji", "\u2028\u2029", "\x00text\x00", "}]}, {\"index\": 1"]


def exchanges():
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 3},
                      "m")
    completion = parse_completion({"model": "m", "prompt": ["one", "two"], "stream": True, "n": 2}, "m")
    return [ChatExchange(chat, "m \"model\" é", None, [], None),
            CompletionExchange(completion, "m", None, [], None)]


@pytest.mark.parametrize("ex", exchanges(), ids=["chat", "completions"])
def test_a_text_chunk_is_byte_for_byte_the_chunk_json_dumps_writes(ex):
    for index in range(len(ex.choices)):
        for text in TEXTS:
            assert ex.text_chunk(index, text) == json_bytes(ex.chunk(index, text, None))
            framed = data(ex.text_chunk(index, text))
            assert framed == data(ex.chunk(index, text, None))
            assert json.loads(framed[len(b"data: "):])["choices"][0]["index"] == index
