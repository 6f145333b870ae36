"""The prompt context: one sequence's prompt at a time, a chunk of tokens per llama_decode, as if it were alone.

contexts.prompt_params says why prompts run in a context of their own. What a prompt leaves here (its KV) goes on
whole, as llama.cpp's state of sequence 0: into a stream of the decode batch, into the KV ring, into the prefix
cache's blocks or a checkpoint. The context holds one prompt's KV at a time; whoever ran a prompt clears it.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from syshax_llamacpp.codec import StateBuffer, StateShape, export_seq, widen_streams
from syshax_llamacpp.contexts import add_row, free_context


class PromptContext:
    """The context, its batch of `chunk` rows, and the scratch buffer its states are exported into."""

    def __init__(self, model, params, chunk: int, n_vocab: int) -> None:
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if self.ctx is None:
            raise RuntimeError("llama.cpp could not create the prompt context (out of memory?)")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(chunk, 0, 1)
        self.chunk = chunk
        self.n_vocab = n_vocab
        # its states, exported; the prefix cache's blocks are written into it on their way in. One prompt's bytes
        # at a time: a view of it is good until the next export or import here
        self.scratch = StateBuffer()

    def decode(self, tokens, start: int, logits: str = "last") -> int:
        """Run `tokens` at positions start, start + 1, ...; logits for the "last" row, "all" rows or "none".
        llama_decode's return code (0: done)."""
        b = self.batch
        b.n_tokens = 0
        n = len(tokens)
        for j, token in enumerate(tokens):
            add_row(b, token, start + j, 0, logits == "all" or (logits == "last" and j == n - 1))
        return llama_cpp.llama_decode(self.ctx, b)

    def logits(self, i: int) -> np.ndarray:
        """A view of row i's logits from the last decode (valid until the next)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))

    def clear(self) -> None:
        """Drop the prompt's KV: the context is free for the next prompt."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, -1, -1)

    def export(self, room: int = 0) -> np.ndarray:
        """The prompt's state (a view of the scratch buffer), with `room` bytes after it for widen()."""
        self.scratch.ensure(llama_cpp.llama_state_seq_get_size(self.ctx, 0) + room)
        return export_seq(self.ctx, 0, self.scratch)

    def widen(self, state: np.ndarray, n_stream: int, shape: StateShape) -> np.ndarray:
        """The state just exported with export(room=8 * n_stream) or more, re-addressed in place for a context of
        n_stream KV streams (codec.widen_streams)."""
        if self.scratch.capacity < state.nbytes + 8 * n_stream:  # ensure() would map a new, empty buffer
            raise ValueError(f"widen: export(room={8 * n_stream}) first, so that the state can grow in place")
        buf = self.scratch.ensure(state.nbytes + 8 * n_stream)
        return buf[:widen_streams(buf, state.nbytes, n_stream, shape)]

    def set_state(self, state: np.ndarray) -> bool:
        """Start from a whole state of sequence 0 (a checkpoint); False, and the context cleared, when llama.cpp
        takes less than all of it."""
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(state), state.nbytes, 0)
        if got != state.nbytes:
            self.clear()
            return False
        return True

    def close(self) -> None:
        free_context(self.ctx, self.batch)
        self.ctx = self.batch = None
