"""tests/engine/test_prefix_first_token.py's scenarios, in a process of their own: a llama.cpp engine with a real block
store and the daemon's own index (this script plays the daemon's part). Prints one JSON line of what each saw.

    python tests/first_token_scenarios.py MODEL.gguf
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp")]

from syshax_llamacpp.engine import LlamaCppEngine  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer  # noqa: E402
from syshaxd.engine.plan import _page_round  # noqa: E402
from syshaxd.engine.prefix_cache import PrefixCache  # noqa: E402
from syshaxd.sdk.gguf.header import fingerprint_from_gguf, n_vocab_from_gguf  # noqa: E402
from syshaxd.sdk.kv.block_store import BlockStore  # noqa: E402
from syshaxd.sdk.kv.record import DType, record_size  # noqa: E402
from syshaxd.sdk.types import Cached, Delta, EngineSpec, GenerateRequest, Handling, SamplingParams  # noqa: E402

CHUNK = 64
BLOCK = 16
# 52 words: some 70 tokens, two chunks; its first blocks are stored on a miss
PROMPT = ("The harbour master kept a ledger of every ship that came in, the cargo it carried, the name of its "
          "captain and the weather on the day it docked. Years later his daughter read it from the first page "
          "to the last and found that one ship had come in twice on the same day under two names")


class Scenarios:
    def __init__(self, model: str) -> None:
        fingerprint, n_vocab = fingerprint_from_gguf(model), n_vocab_from_gguf(model)
        slot = _page_round(record_size(fingerprint, BLOCK, DType.F16))
        wide = _page_round(record_size(fingerprint, CHUNK, DType.F16) + 4 * n_vocab)
        instance = f"t{uuid.uuid4().hex[:8]}"
        self.store = BlockStore.create(instance, 64, slot, 8, wide)
        self.engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=model,
                                                model_name="m", n_ctx=512, max_batch_size=4, threads=2,
                                                prefill_chunk_size=CHUNK, tiled_attention=True,
                                                prefix_store=instance))
        self.engine.warm_up()
        self.cache = PrefixCache(64, BLOCK, slot, chunk_tokens=CHUNK, n_wide=8, wide_bytes=wide)
        self.tokenizer = GGUFTokenizer(model)
        self.plans = {}

    def close(self) -> None:
        self.engine.close()
        self.store.unlink()
        self.store.close()

    def submit(self, text: str, max_tokens: int, plan: bool = True) -> str:
        rid = uuid.uuid4().hex
        prompt = tuple(self.tokenizer.encode(text))
        self.plans[rid] = self.cache.plan(rid, prompt) if plan else None
        self.engine.submit(GenerateRequest(request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens,
                                           ignore_eos=True, sampling=SamplingParams(temperature=0)),
                           Handling(prefix=self.plans[rid]))
        return rid

    def steps(self, rid: str) -> list[list]:
        """Every step's events for rid until it ends, told to the index as the daemon's worker handle tells it."""
        out = []
        while self.engine.has_work():
            events = [e for e in self.engine.step() if e.request_id == rid]
            for event in events:
                if isinstance(event, Cached):
                    self.cache.cached(event)
            out.append(events)
            if any(isinstance(e, Delta) and e.finish_reason for e in events):
                self.cache.release(rid)
                break
        return out


def tokens(per_step: list[list]) -> list[int]:
    return [t for events in per_step for e in events if isinstance(e, Delta) for t in e.tokens]


def cached(per_step: list[list]) -> list[Cached]:
    return [e for events in per_step for e in events if isinstance(e, Cached)]


def miss(s: Scenarios) -> dict:
    per_step = s.steps(s.submit(PROMPT + " (a)", 24))
    again = s.steps(s.submit(PROMPT + " (a)", 24))
    return {"steps": [[type(e).__name__ for e in events] for events in per_step],
            "stored": sum(len(c.stored) for c in cached(per_step)), "tokens": tokens(per_step),
            "hit_tokens": sum(c.hit_tokens for c in cached(again)), "again_tokens": tokens(again)}


def ends_at_first(s: Scenarios) -> dict:
    events = [e for step in s.steps(s.submit(PROMPT + " (b)", 1)) for e in step]
    return {"types": [type(e).__name__ for e in events], "stored": sum(len(c.stored) for c in cached([events])),
            "finish_reason": events[-1].finish_reason}


def cancel(s: Scenarios) -> dict:
    alone = tokens(s.steps(s.submit(PROMPT + " (d)", 16, plan=False)))
    rid = s.submit(PROMPT + " (c)", 24)
    plan = s.plans[rid]
    while not any(isinstance(e, Delta) for e in s.engine.step()):
        pass
    pending = s.engine.prefix.unkept is not None  # what this scenario is about: the blocks not written yet
    events = s.engine.cancel(rid)
    s.cache.release(rid)
    slots = [slot for _, slot in plan.stores] + ([plan.final_store] if plan.final_store >= 0 else [])
    after = s.steps(s.submit(PROMPT + " (d)", 16, plan=False))
    return {"pending_before_cancel": pending, "pending_after_cancel": s.engine.prefix.unkept is not None,
            "cancel_events": [type(e).__name__ for e in events], "planned_slots": len(slots),
            # a slot never written holds zeros (the store is sparse): a record starts with its magic
            "written_slots": sum(any(bytes(s.store.slot(slot)[:64])) for slot in slots),
            "cached_after": len(cached(after)), "after_tokens": tokens(after), "alone_tokens": alone}


def main() -> int:
    s = Scenarios(sys.argv[1])
    try:
        seen = {"miss": miss(s), "ends_at_first": ends_at_first(s), "cancel": cancel(s)}
    finally:
        s.close()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
