"""Completions' shapes: text per choice (echo puts the prompt before it), text chunks, and logprobs as the legacy
parallel lists with text offsets (echo's prompt logprobs first)."""

from __future__ import annotations

from syshaxd.api.openai import logprob_shapes
from syshaxd.api.openai.answers import Choice, Exchange
from syshaxd.sdk.types import Delta


class CompletionExchange(Exchange):
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    FINAL_TEXT = ""

    def logprobs_of(self, ch: Choice, event: Delta, entries: list, shown_before: int) -> dict:
        lp = logprob_shapes.completion(entries, [e.token for e in entries], self.pieces, shown_before)
        if not ch.started and self.parsed.echo and event.prompt_logprobs is not None:
            p = self.parsed.prompt_index(ch.index)
            assert self.prompt_ids is not None  # echo with logprobs: openai/routes._prompt_views gave them
            prompt_part = logprob_shapes.completion(list(event.prompt_logprobs), self.prompt_ids[p], self.pieces, 0)
            lp = logprob_shapes.extend(prompt_part, lp)
        return lp

    def merge_logprobs(self, into: dict, more: dict) -> None:
        logprob_shapes.extend(into, more)

    def choice_body(self, ch: Choice, text: str) -> dict:
        return {"index": ch.index, "text": text, "logprobs": ch.logprobs, "finish_reason": ch.finish}

    def chunk(self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self.head(self.CHUNK_OBJECT) | {"choices": [choice]}
