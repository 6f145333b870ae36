"""Prompt tokens, chat rendering and text pieces exactly as the llama.cpp decoder makes them (vocab-only GGUF).

A KV record is only taken when its token ids are the decoder's own tokenization of the
prompt, so every engine that hands KV to llama.cpp tokenizes with llama.cpp's vocabulary and
renders chat with the same template code; and an engine that answers by itself (vLLM in gpu
mode) then counts usage and cuts stop strings exactly as cpu mode does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

from syshaxd.sdk.gguf.chat import ChatTemplate

if TYPE_CHECKING:  # a prompt is read from a request; the request's type lives above this format module
    from syshaxd.sdk.types import GenerateRequest

_PIECE_BUF = 256


class Vocab:
    """The GGUF's vocabulary and chat template: loaded without its weights, or read from a loaded model."""

    def __init__(self, gguf: str | Path | None = None, *, model=None) -> None:
        import llama_cpp

        self._llama = llama_cpp
        self._owned = model is None  # a model handed in belongs to its engine, which frees it
        if model is None:
            llama_cpp.llama_backend_init()
            params = llama_cpp.llama_model_default_params()
            params.vocab_only = True
            model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
            if model is None:
                raise RuntimeError(f"llama.cpp could not read the vocabulary of {gguf}")
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        # a vocab-only load leaves the hyperparameters at 0: read the training context from the metadata
        arch = self.meta("general.architecture") or ""
        self.n_ctx_train = int(self.meta(f"{arch}.context_length") or 0) or llama_cpp.llama_model_n_ctx_train(self.model)
        self.template = ChatTemplate(self.meta("tokenizer.chat_template"),
                                     self.piece_text(llama_cpp.llama_vocab_bos(self.vocab)),
                                     self.piece_text(llama_cpp.llama_vocab_eos(self.vocab)))
        # the longest piece one token stands for, in bytes: fit_prompt's floor on a prompt's token
        # count. Worked out at load (0.25 s for 49k tokens here), not on some request's time
        self.max_token_bytes = max(max(len(self.piece_bytes(t)), len(self.piece_bytes(t, special=True)))
                                   for t in range(self.n_vocab))

    def meta(self, key: str) -> str | None:
        size = self._llama.llama_model_meta_val_str(self.model, key.encode(), None, 0)
        if size < 0:
            return None
        buf = ctypes.create_string_buffer(size + 1)
        self._llama.llama_model_meta_val_str(self.model, key.encode(), buf, size + 1)
        return buf.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        tokens = (self._llama.llama_token * cap)()
        n = self._llama.llama_tokenize(self.vocab, data, len(data), tokens, cap, add_special, True)
        if n < 0:
            cap = -n
            tokens = (self._llama.llama_token * cap)()
            n = self._llama.llama_tokenize(self.vocab, data, len(data), tokens, cap, add_special, True)
        return list(tokens[:n])

    def piece_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(_PIECE_BUF)
        n = self._llama.llama_token_to_piece(self.vocab, token, buf, _PIECE_BUF, 0, special)
        return buf.raw[: max(n, 0)]

    def piece_text(self, token: int) -> str:
        return self.piece_bytes(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def is_eog(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self.vocab, token))

    def fewest_tokens(self, request: GenerateRequest) -> int:
        """A floor under the prompt's token count, from its size alone: no token covers more than
        max_token_bytes bytes, so a prompt of N bytes has at least N / max_token_bytes tokens."""
        if request.prompt_tokens is not None:
            return len(request.prompt_tokens)
        if request.messages is not None:
            size = sum(len(str(m.get("content") or "").encode()) for m in request.messages)
        else:
            size = len((request.prompt or "").encode())
        return size // self.max_token_bytes

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        """The request's prompt as the llama.cpp engine tokenizes it; ValueError when it cannot be."""
        if request.prompt_tokens is not None:
            return list(request.prompt_tokens)
        if request.messages is not None:
            # the template writes its own special tokens (BOS and the role markers)
            return self.tokenize(self.template.render(list(request.messages), list(request.tools) or None,
                                                      request.chat_template_kwargs), add_special=False)
        return self.tokenize(request.prompt or "", add_special=True)

    def close(self) -> None:
        if self.model is not None and self._owned:
            self._llama.llama_model_free(self.model)
        self.model = None
