"""The daemon's own copy of the model's vocabulary: /tokenize, /detokenize, and the token texts of logprobs.

Loaded vocab-only from the same GGUF the engines read (syshaxd.gguf.vocab), so token ids and
chat rendering are the engines' own; loaded on first use, off the event loop.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache

from syshaxd.gguf.vocab import Vocab


class DaemonVocab:
    def __init__(self, gguf: str) -> None:
        self.gguf = gguf
        self._vocab: Vocab | None = None
        self.pieces: Pieces | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Vocab:
        if self._vocab is None:
            async with self._lock:
                if self._vocab is None:
                    vocab = await asyncio.to_thread(Vocab, self.gguf)
                    self.pieces = Pieces(vocab)
                    self._vocab = vocab
        return self._vocab


class Pieces:
    """Token id -> its bytes and text, as a reply shows them (special tokens as their text), cached."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.bytes = lru_cache(maxsize=65536)(lambda t: vocab.piece_bytes(t, special=True))

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")
