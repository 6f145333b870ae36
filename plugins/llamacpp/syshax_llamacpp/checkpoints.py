"""Whole-state checkpoints: a prompt's reuse for a model whose KV the prefix cache's blocks do not carry.

The prefix cache (prefix.py) keeps a prompt's KV as blocks of K and V rows per head, which any prompt sharing the
blocks' tokens can take. A model with a recurrent state (Qwen 3.5, LFM2, Mamba), sliding-window layers (gemma,
gpt-oss) or MLA's compressed KV (DeepSeek V3) has no such rows to cut: its recurrent state stands for every token
before it, its window cache for the last window. What can be kept is llama.cpp's whole sequence state after a prompt,
as llama-server's context checkpoints keep it: a later prompt that starts with those very tokens sets the state
into the prompt context and computes only the rest.

One per worker, in its own memory, bounded by bytes; the least recently used goes first. A state is taken only
where the rest of the prompt then runs in chunks that give the bits a whole run gives (`grid`: 1 where the warm-up
proved chunks of any size do, else the prompt chunk: the state after whole chunks only).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np


def _key(tokens: list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class Checkpoint:
    """The prompt context's state (one stream, as llama_state_seq_get_data writes it) after n_tokens tokens."""

    n_tokens: int
    state: np.ndarray  # uint8, read-only


class Checkpoints:
    """Whole sequence states by the tokens they hold, up to budget bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._by_key: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self._lengths: Counter[int] = Counter()  # the token counts held, to look a prompt's prefixes up by
        self.hits = 0
        self.kept = 0
        self.evicted = 0

    def find(self, tokens: list[int], grid: int) -> Checkpoint | None:
        """The longest state that holds the first tokens of `tokens`, leaving at least one to compute (its logits
        give the first generated token), at a multiple of grid; None when none does.

        One pass over the prompt: the key of each held length is the running hash's digest at that length."""
        lengths = sorted(n for n in self._lengths if n < len(tokens) and n % grid == 0)
        if not lengths:
            return None
        ids = np.asarray(tokens[:lengths[-1]], np.int32)
        running, at, keys = hashlib.blake2b(digest_size=16), 0, []
        for n in lengths:
            running.update(ids[at:n].tobytes())
            at = n
            keys.append(running.copy().digest())
        for key in reversed(keys):
            found = self._by_key.get(key)
            if found is not None:
                self._by_key.move_to_end(key)
                self.hits += 1
                return found
        return None

    def keep(self, tokens: list[int], state: np.ndarray) -> bool:
        """Keep a copy of the state after `tokens`; False where it alone is over the budget."""
        if not tokens or state.nbytes > self.budget:
            return False
        key = _key(tokens)
        old = self._by_key.pop(key, None)
        if old is not None:
            self._forget(old)
        while self._by_key and self.used + state.nbytes > self.budget:
            self._forget(self._by_key.popitem(last=False)[1])
            self.evicted += 1
        kept = state.copy()
        kept.flags.writeable = False
        self._by_key[key] = Checkpoint(len(tokens), kept)
        self._lengths[len(tokens)] += 1
        self.used += kept.nbytes
        self.kept += 1
        return True

    def _forget(self, checkpoint: Checkpoint) -> None:
        self.used -= checkpoint.state.nbytes
        self._lengths[checkpoint.n_tokens] -= 1
        if not self._lengths[checkpoint.n_tokens]:
            del self._lengths[checkpoint.n_tokens]

    def __len__(self) -> int:
        return len(self._by_key)
