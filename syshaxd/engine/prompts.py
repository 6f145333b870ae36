"""Prompts tokenized in the daemon, exactly as the llama.cpp engines tokenize them.

The prefix cache is planned from a prompt's token ids before the request goes to a worker, so the
daemon tokenizes (and renders chat) with the GGUF's own vocabulary and template (gguf/vocab.py), off
the event loop, and sends the ids on. A prompt that cannot run is refused here, before any engine
work, with the Rejected an engine would have answered.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from syshaxd.engine.types import GenerateRequest, Rejected
from syshaxd.gguf.vocab import Vocab, admit


class PromptTokenizer:
    def __init__(self, gguf: str | Path, n_ctx: int) -> None:
        self.vocab = Vocab(gguf)
        self.n_ctx = min(n_ctx, self.vocab.n_ctx_train or n_ctx)  # what the engines allow one sequence

    async def tokenize(self, request: GenerateRequest) -> GenerateRequest | Rejected:
        """The request with its prompt as token ids, or why it cannot run."""
        if request.prompt_tokens is not None:
            return request
        admitted = await asyncio.to_thread(admit, self.vocab, request, self.n_ctx)
        if isinstance(admitted, Rejected):
            return admitted
        tokens, _ = admitted
        return replace(request, prompt_tokens=tuple(tokens), prompt=None, messages=None)

    def close(self) -> None:
        self.vocab.close()
