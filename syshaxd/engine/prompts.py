"""The daemon's copy of the model's vocabulary, and prompts tokenized in the daemon exactly as the engines do.

Loaded vocab-only from the GGUF the engines read (gguf/vocab.py), on first use and off the event
loop, so token ids and chat rendering are the engines' own. The prefix cache is planned from a
prompt's token ids before the request goes to a worker (PromptTokenizer); /tokenize, /detokenize
and the token texts of logprobs read the same copy. A prompt that cannot run is refused here,
before any engine work, with the Rejected an engine would have answered.

Here too, and only here, a request that names no max_tokens gets its default: the config's
default_max_tokens, within the room its prompt leaves in the context.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import lru_cache

from syshaxd.sdk.types import GenerateRequest, Rejected
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.gguf.vocab import Vocab


class DaemonVocab:
    def __init__(self, gguf: str) -> None:
        self.gguf = gguf
        self._vocab: Vocab | None = None
        self._pieces: Pieces | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Vocab:
        if self._vocab is None:
            async with self._lock:
                if self._vocab is None:
                    vocab = await asyncio.to_thread(Vocab, self.gguf)
                    self._pieces = Pieces(vocab)
                    self._vocab = vocab
        return self._vocab

    @property
    def pieces(self) -> Pieces:
        """Token id -> its bytes and text; read after get() loaded the vocabulary."""
        if self._pieces is None:
            raise RuntimeError("the vocabulary is read before it was loaded (DaemonVocab.get first)")
        return self._pieces


class Pieces:
    """Token id -> its bytes and text, as a reply shows them (special tokens as their text), cached."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.bytes = lru_cache(maxsize=65536)(lambda t: vocab.piece_bytes(t, special=True))

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


class PromptTokenizer:
    def __init__(self, vocab: DaemonVocab, n_ctx: int) -> None:
        self.vocab = vocab
        self.n_ctx = n_ctx  # capped by the model's training context, as the engines cap it

    async def tokenize(self, request: GenerateRequest, default_max_tokens: int) -> GenerateRequest | Rejected:
        """The request with its prompt as token ids and its max_tokens (default_max_tokens within the prompt's room
        where it names none), or why it cannot run."""
        vocab = await self.vocab.get()
        n_ctx = min(self.n_ctx, vocab.n_ctx_train or self.n_ctx)
        fitted = await asyncio.to_thread(fit_prompt, vocab, request, n_ctx)
        if isinstance(fitted, Rejected):
            return fitted
        tokens, room = fitted
        chosen = request.max_tokens is None  # the daemon's default, within the room the prompt leaves
        max_tokens = min(default_max_tokens, room) if chosen else request.max_tokens
        return replace(request, prompt_tokens=tuple(tokens), max_tokens=max_tokens, max_tokens_default=chosen,
                       prompt=None, messages=None, chat_template_kwargs=None)
