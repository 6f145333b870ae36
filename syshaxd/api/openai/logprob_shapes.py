"""OpenAI's two logprobs shapes, from the engines' TokenLogprob entries.

Completions (legacy): {tokens, token_logprobs, top_logprobs, text_offset}; as vLLM, each top_logprobs
dict holds the k most likely tokens and the chosen one, and a prompt's first token (echo) has None
for both. Chat: {content: [{token, logprob, bytes, top_logprobs: [k entries]}], refusal}.
"""

from __future__ import annotations

from syshaxd.engine.prompts import Pieces
from syshaxd.sdk.types import TokenLogprob


def completion(entries: list[TokenLogprob | None], tokens: list[int], pieces: Pieces, offset: int) -> dict:
    """The legacy shape for `tokens` (entries[i] belongs to tokens[i]; None: no context before it);
    text_offset counts characters from `offset`, where the first token's text begins."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = pieces.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {pieces.text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out["top_logprobs"].append(top)
    return out


def extend(into: dict, more: dict) -> dict:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        into[key] += more[key]
    return into


def _chat_entry(token: int, logprob: float, pieces: Pieces) -> dict:
    data = pieces.bytes(token)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


def chat(entries: list[TokenLogprob], pieces: Pieces) -> dict:
    return {"content": [_chat_entry(e.token, e.logprob, pieces)
                        | {"top_logprobs": [_chat_entry(t, lp, pieces) for t, lp in e.top]} for e in entries],
            "refusal": None}
