"""Prefix-aware placement: a request goes to the engine of its pool that already holds its prompt's prefix.

An engine that keeps a prefix cache of its own (vLLM's automatic prefix caching: Capabilities.own_prefix_cache) hits
only on prompts it ran itself, so with a pool of them the placement decides the hits: a chat's next turn hits on the
engine that ran the turn before and misses on any other. (The daemon's llama.cpp workers share one block store, in
which every worker hits every block: placement changes nothing for them, and they are placed least loaded.)

The scheduler remembers which blocks of prompts (chained keys of 16 tokens, sdk/kv/block_keys.py: a block matches
only with everything before it) it sent to each such engine, most recent first, up to a bound, and places a request
on the engine holding the longest run of its leading blocks, unless that engine is busier than the least loaded by
more than SLACK requests -- then load wins, as in Dynamo's KV-aware router and llm-d's prefix-cache scorer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from syshaxd.sdk.kv.block_keys import block_keys

if TYPE_CHECKING:
    from syshaxd.engine.engine_handle import EngineHandle

BLOCK_TOKENS = 16  # vLLM's block: what its prefix cache matches in
REMEMBERED = 65_536  # blocks remembered per engine (about a million prompt tokens), least recently sent first out
SLACK = 2  # requests in flight by which the engine holding the prefix may exceed the least loaded


@dataclass
class PrefixRouting:
    """Which blocks each engine was sent, and what placing by them did (the status)."""

    seen: dict[str, OrderedDict] = field(default_factory=dict)  # engine name -> block key -> None, oldest first
    placed: int = 0  # requests placed on the engine holding their prefix, over a less loaded one
    matched_blocks: int = 0  # leading blocks those requests found on their engine
    by_load: int = 0  # requests placed least loaded (no engine held more of them, or it was too busy)

    def choose(self, workers: list[EngineHandle], tokens) -> EngineHandle:
        """The worker of `workers` (ready, keeping their own prefix caches) to send a prompt of `tokens` to."""
        least = min(workers, key=lambda w: w.in_flight)
        keys = block_keys(tokens, BLOCK_TOKENS) if tokens else []
        best, best_run = least, self._run(least.name, keys)
        for w in workers:
            run = self._run(w.name, keys)
            if run > best_run and w.in_flight <= least.in_flight + SLACK:
                best, best_run = w, run
        if best is not least:
            self.placed += 1
            self.matched_blocks += best_run
        else:
            self.by_load += 1
        self._remember(best.name, keys)
        return best

    def _run(self, name: str, keys: list[int]) -> int:
        """How many of keys' leading blocks the engine was sent."""
        seen = self.seen.get(name)
        if not seen:
            return 0
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        return n

    def _remember(self, name: str, keys: list[int]) -> None:
        seen = self.seen.setdefault(name, OrderedDict())
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > REMEMBERED:
            seen.popitem(last=False)

    def forget(self, name: str) -> None:
        """The engine restarted: its prefix cache went with it."""
        self.seen.pop(name, None)

    def to_json(self) -> dict:
        return {"placed_by_prefix": self.placed, "matched_blocks": self.matched_blocks,
                "placed_by_load": self.by_load}
