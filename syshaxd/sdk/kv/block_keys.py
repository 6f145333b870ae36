"""The prefix cache's names for blocks of tokens, which the daemon and the engines must compute alike.

A prompt is cut into blocks of `block_tokens`; block j is known by a hash chained over blocks 0..j, so a block
matches only when everything before it matches too. The daemon plans a prompt's blocks by these keys
(engine/prefix_cache.py), and an engine names by them the blocks of generated tokens it keeps (which only it
knows when it keeps them).
"""

from __future__ import annotations

import numpy as np
import xxhash


def block_keys(tokens, block_tokens: int) -> list[int]:
    """The chained key of each whole block of `tokens`."""
    ids = np.asarray(tokens, dtype=np.int32)
    keys, parent = [], 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + ids[start:start + block_tokens].tobytes())
        keys.append(parent)
    return keys
