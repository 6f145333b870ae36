"""Chat completions' shapes: a message per choice (tool calls read back from its text, a reasoning model's thinking
apart as `reasoning_content`), delta chunks, and logprobs as `content` entries."""

from __future__ import annotations

from typing import Any

from syshaxd.api.core.tools import finish_reason, parse_output
from syshaxd.api.openai import logprob_shapes
from syshaxd.api.openai.answers import Choice, Exchange
from syshaxd.sdk.types import Accepted, Delta


class ChatExchange(Exchange):
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    FINAL_TEXT = None  # the finishing chunk's delta is empty

    def logprobs_of(self, ch: Choice, event: Delta, entries: list, shown_before: int) -> dict:
        return logprob_shapes.chat(entries, self.pieces)

    def merge_logprobs(self, into: dict, more: dict) -> None:
        into["content"] += more["content"]

    def choice_body(self, ch: Choice, text: str) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = ch.finish
        if self.tools is not None:
            content, calls = parse_output(text, self.tools, cut=ch.finish == "length")
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_json() for c in calls]
            finish = finish_reason(ch.finish, calls) if ch.finish is not None else None
        if self.reading:
            thought = "".join(ch.thoughts) or None
            if thought is not None and not message["content"]:
                message["content"] = None  # all thinking (max_tokens ended it there): no answer, as vLLM gives it
            message |= _thought_fields(thought)
        return {"index": ch.index, "message": message, "logprobs": ch.logprobs, "finish_reason": finish}

    def usage(self, accepted: list[Accepted]) -> dict:
        usage = super().usage(accepted)
        if self.reading:  # OpenAI's count of the completion's reasoning tokens
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(ch.reasoning_tokens for ch in self.choices)}
        return usage

    def thought_chunk(self, index: int, thought: str, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": _thought_fields(thought), "logprobs": logprobs, "finish_reason": None}
        return self.head(self.CHUNK_OBJECT) | {"choices": [choice]}

    def chunk(self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
              role: bool = False) -> dict:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.head(self.CHUNK_OBJECT) | {"choices": [choice]}

    def opening_chunks(self) -> list[dict]:
        """Each choice's role first, as OpenAI streams it."""
        return [self.chunk(ch.index, "", None, role=True) for ch in self.choices]

    def streamed_logprobs(self, lp: dict | None) -> dict | None:
        return None if lp is not None and not lp["content"] else lp

    def tool_call_chunks(self, index: int, calls: list) -> list[dict]:
        """A choice's calls as OpenAI streams them: id, type and name first, then the arguments (a call cut before
        them has none)."""
        chunks = []
        for i, call in enumerate(calls):
            parts = [call.to_json(i) | {"function": {"name": call.name, "arguments": ""}}]
            if call.arguments:
                parts.append({"index": i, "function": {"arguments": call.arguments}})
            for part in parts:
                choice = {"index": index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
                chunks.append(self.head(self.CHUNK_OBJECT) | {"choices": [choice]})
        return chunks


def _thought_fields(thought: str | None) -> dict:
    """A message's or delta's thinking: `reasoning_content` (DeepSeek's and llama-server's name, which most clients
    read) and `reasoning` (vLLM's since 0.11, and OpenRouter's)."""
    return {"reasoning_content": thought, "reasoning": thought}
