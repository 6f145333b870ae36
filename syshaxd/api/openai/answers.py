"""One chat or completions request's answer as it is shown: what a Delta shows of a choice (echo's prompt, logprobs),
the JSON body folded from the Steps (api/core/outputs.py), and the stream's chunks. The parts both endpoints share are
here; chat_shapes.py and completion_shapes.py give each its own bodies, chunks and logprobs."""

from __future__ import annotations

import time
from json.encoder import encode_basestring

from syshaxd import __version__
from syshaxd.api.core.outputs import Step
from syshaxd.api.core.sse import json_bytes
from syshaxd.api.core.validate import ParsedRequest
from syshaxd.engine.prompts import Pieces
from syshaxd.sdk.types import Accepted, Delta

SYSTEM_FINGERPRINT = f"syshax-{__version__}"
_TEXT = "\x00text\x00"  # a text chunk's text while its template is made (no id or model name holds a NUL)


class Choice:
    """What one choice has shown so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.thoughts: list[str] = []  # the thinking shown so far; parts: the rest
        self.parts: list[str] = []
        self.n = 0  # tokens generated, once it finished
        self.reasoning_tokens = 0  # of them, those up to the end of the thinking
        self.finish: str | None = None
        self.logprobs: dict | None = None
        self.chars = 0  # characters shown: where the next token's text_offset begins
        self.started = False


class Exchange:
    """The shapes of one endpoint's bodies and stream chunks, for every choice of the request."""

    OBJECT = ""  # the JSON body's object
    CHUNK_OBJECT = ""  # a stream chunk's object
    FINAL_TEXT: str | None = None  # the text of the chunk that carries a choice's finish reason

    def __init__(self, parsed: ParsedRequest, model: str, pieces: Pieces, echo_texts: list[str],
                 prompt_ids: list[list[int]] | None) -> None:
        self.parsed = parsed
        self.id = parsed.generate.request_id
        self.created = int(time.time())
        self.model = model
        self.pieces = pieces
        self.echo_texts = echo_texts  # per prompt: what echo puts before the completion
        self.prompt_ids = prompt_ids  # per prompt: its tokens, for echo's prompt logprobs
        # a reasoning model's output, read apart into thinking and answer (chat)
        self.reading = parsed.thinking is not None and parsed.thinking.split
        self.choices = [Choice(i) for i in range(len(parsed.generates))]
        self.tools = parsed.tools  # chat with tools: the output is read back into tool calls
        self._around_text: dict[int, tuple[bytes, bytes]] = {}  # per choice: a text chunk's JSON before and after

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    # --- what each endpoint shapes its own way ---------------------------------------------------------

    def logprobs_of(self, ch: Choice, event: Delta, entries: list, shown_before: int) -> dict:
        """The logprobs of a Delta's tokens, shown after `shown_before` characters of the choice."""
        raise NotImplementedError

    def merge_logprobs(self, into: dict, more: dict) -> None:
        raise NotImplementedError

    def choice_body(self, ch: Choice, text: str) -> dict:
        raise NotImplementedError

    def chunk(self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None) -> dict:
        raise NotImplementedError

    def thought_chunk(self, index: int, thought: str, logprobs: dict | None = None) -> dict:
        """A stream chunk of a choice's thinking (chat's, where a reasoning model's output is read apart)."""
        raise NotImplementedError

    def opening_chunks(self) -> list[dict]:
        """What a stream sends before the first token."""
        return []

    def text_chunk(self, index: int, text: str) -> bytes:
        """chunk(index, text, None) as JSON, byte for byte json_bytes' own, with only the text encoded per chunk: a
        stream sends one per token, and the rest of it (id, model, choice) is the same every time."""
        around = self._around_text.get(index)
        if around is None:
            whole = json_bytes(self.chunk(index, _TEXT, None))
            before, _, after = whole.partition(json_bytes(_TEXT))
            around = self._around_text[index] = (before, after)
        return around[0] + encode_basestring(text).encode() + around[1]

    def streamed_logprobs(self, lp: dict | None) -> dict | None:
        """A Delta's logprobs as its chunk carries them (None: the chunk carries none)."""
        return lp

    # --- shared ----------------------------------------------------------------------------------------

    def shown(self, ch: Choice, event: Delta) -> tuple[str, dict | None]:
        """The text and logprobs one Delta of a choice adds to the answer (echo's prompt comes with the first)."""
        parsed = self.parsed
        text, entries = event.text, list(event.logprobs)
        if parsed.max_tokens_zero:  # the one token the engine had to generate is not shown
            text, entries = "", []
        prefix = ""
        if not ch.started and parsed.echo:
            prefix = self.echo_texts[parsed.prompt_index(ch.index)]
        lp = self.logprobs_of(ch, event, entries, ch.chars + len(prefix)) if parsed.logprobs else None
        ch.started = True
        text = prefix + text
        ch.chars += len(text)
        return text, lp

    def show(self, index: int, event: Delta) -> tuple[str, dict | None]:
        """shown() for choice `index`: how the Steps read a Delta (api/core/outputs.Show)."""
        return self.shown(self.choices[index], event)

    def fold(self, step: Step) -> None:
        """Fold a Step into the whole body: the same Steps, shown the same way, as a stream sends."""
        ch = self.choices[step.index]
        if step.thought:
            ch.thoughts.append(step.thought)
        ch.parts.append(step.text)
        lp = step.logprobs
        if lp is not None:
            if ch.logprobs is None:
                ch.logprobs = lp
            else:
                self.merge_logprobs(ch.logprobs, lp)
        self.ended(step)

    def ended(self, step: Step) -> None:
        """Keep how a choice ended, from its last Step."""
        if step.finish is not None:
            ch = self.choices[step.index]
            ch.finish = step.finish.reason
            ch.n = step.finish.completion_tokens
            ch.reasoning_tokens = step.finish.reasoning_tokens

    def usage(self, accepted: list[Accepted]) -> dict:
        """Each prompt counted once (its n choices share it), every choice's completion counted."""
        firsts = accepted[:: self.parsed.n]
        prompt = sum(a.prompt_tokens for a in firsts)
        completion = 0 if self.parsed.max_tokens_zero else sum(ch.n for ch in self.choices)
        return usage_of(prompt, completion, sum(a.cached_tokens for a in firsts))

    def body(self, usage: dict, route: dict) -> dict:
        choices = [self.choice_body(ch, "".join(ch.parts)) for ch in self.choices]
        return self.head(self.OBJECT) | {"choices": choices, "usage": usage, "syshax": route}

    def final_chunk(self, index: int, finish: str, route: dict) -> dict:
        """The chunk with a choice's finish reason, and syshax's note of the route the request took."""
        return self.chunk(index, self.FINAL_TEXT, finish) | {"syshax": route}

    def usage_chunk(self, usage: dict) -> dict:
        return self.head(self.CHUNK_OBJECT) | {"choices": [], "usage": usage}


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # prompt tokens whose KV came from the prefix cache
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
