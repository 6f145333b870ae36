"""A prompt's first token leaves before its blocks are written into the prefix cache, and nothing is lost by it.

On a miss the llama.cpp engine writes the prompt's new blocks at the step after the one that gives its first token
(stepping.py, _keep_unkept), so that the writes (5 to 10 ms on 2 cores: bench/bench_ttft_prefix.py) are not in
its time to the first token. The daemon must still hear of the blocks (Cached) before the request can end, a
cancelled request must write none (the daemon gives their slots away with it), and the next prompt must find the
prompt context empty. One engine in this process, with a real block store and the daemon's own index; the test
plays the daemon's part.
"""

from __future__ import annotations

import uuid

import pytest

from syshaxd.bench.prompts import GGUFTokenizer
from syshaxd.engine.prefix_cache import PrefixCache
from syshaxd.sdk.kv.block_store import BlockStore
from syshaxd.sdk.types import Cached, Delta, EngineSpec, GenerateRequest, Handling, SamplingParams

CHUNK = 64
BLOCK = 16
# 52 words: some 70 tokens, two chunks; its first blocks are stored on a miss
PROMPT = ("The harbour master kept a ledger of every ship that came in, the cargo it carried, the name of its "
          "captain and the weather on the day it docked. Years later his daughter read it from the first page "
          "to the last and found that one ship had come in twice on the same day under two names")


@pytest.fixture(scope="module")
def served(default_model):
    """An engine with a block store, and the daemon's index of it."""
    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.engine.plan import _page_round
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf, n_vocab_from_gguf
    from syshaxd.sdk.kv.record import DType, record_size

    fingerprint, n_vocab = fingerprint_from_gguf(default_model), n_vocab_from_gguf(default_model)
    slot = _page_round(record_size(fingerprint, BLOCK, DType.F16))
    wide = _page_round(record_size(fingerprint, CHUNK, DType.F16) + 4 * n_vocab)
    instance = f"t{uuid.uuid4().hex[:8]}"
    store = BlockStore.create(instance, 64, slot, 8, wide)
    engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(default_model),
                                       model_name="m", n_ctx=512, max_batch_size=4, threads=2,
                                       prefill_chunk_size=CHUNK, tiled_attention=True, prefix_store=instance))
    engine.warm_up()
    engine.tokenizer = GGUFTokenizer(default_model)
    yield engine, PrefixCache(64, BLOCK, slot, chunk_tokens=CHUNK, n_wide=8, wide_bytes=wide)
    engine.close()
    store.unlink()
    store.close()


def tokens_of(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text))


def submit(engine, cache: PrefixCache, prompt: tuple[int, ...], max_tokens: int, plan: bool = True) -> str:
    rid = uuid.uuid4().hex
    handling = Handling(prefix=cache.plan(rid, prompt) if plan else None)
    engine.submit(GenerateRequest(request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0)), handling)
    return rid


def steps(engine, cache: PrefixCache, rid: str) -> list[list]:
    """Every step's events for rid until it ends, told to the index as the daemon's worker handle tells it."""
    out = []
    while engine.has_work():
        events = [e for e in engine.step() if e.request_id == rid]
        for event in events:
            if isinstance(event, Cached):
                cache.cached(event)
        out.append(events)
        if any(isinstance(e, Delta) and e.finish_reason for e in events):
            cache.release(rid)
            break
    return out


def tokens(per_step: list[list]) -> list[int]:
    return [t for events in per_step for e in events if isinstance(e, Delta) for t in e.tokens]


def test_the_first_token_leaves_before_the_blocks_and_the_daemon_hears_of_them_before_the_end(served):
    engine, cache = served
    prompt = tokens_of(engine, PROMPT + " (a)")
    rid = submit(engine, cache, prompt, 24)
    per_step = steps(engine, cache, rid)
    first = next(i for i, events in enumerate(per_step) if any(isinstance(e, Delta) for e in events))
    assert not any(isinstance(e, Cached) for e in per_step[first]), per_step[first]
    after = per_step[first + 1]
    assert isinstance(after[0], Cached) and after[0].stored, after  # before that step's token
    assert [type(e) for e in after[1:]] == [Delta]
    assert sum(isinstance(e, Cached) for events in per_step for e in events) == 1
    # what it wrote is read back: the same prompt again hits its blocks and gives the same tokens
    again = steps(engine, cache, submit(engine, cache, prompt, 24))
    hit = next(e for events in again for e in events if isinstance(e, Cached))
    assert hit.hit_tokens >= BLOCK * 3, hit
    assert tokens(again) == tokens(per_step) and len(tokens(per_step)) == 24


def test_a_request_that_ends_at_its_first_token_reports_its_blocks_before_that_token(served):
    engine, cache = served
    per_step = steps(engine, cache, submit(engine, cache, tokens_of(engine, PROMPT + " (b)"), 1))
    events = [e for step in per_step for e in step]
    assert [type(e) for e in events] == [Cached, Delta] and events[0].stored, events
    assert events[1].finish_reason == "length"


def test_a_request_cancelled_before_its_blocks_are_written_writes_none_and_the_next_prompt_is_untouched(served):
    engine, cache = served
    fresh = tokens_of(engine, PROMPT + " (d)")
    alone = tokens(steps(engine, cache, submit(engine, cache, fresh, 16, plan=False)))
    rid = submit(engine, cache, tokens_of(engine, PROMPT + " (c)"), 24)
    while not any(isinstance(e, Delta) for e in engine.step()):
        pass
    assert engine._unkept is not None  # what this test is about: the blocks not written yet
    assert engine.cancel(rid) == []
    cache.release(rid)
    assert engine._unkept is None
    # the prompt context was cleared: the next prompt runs from nothing, and gives what it gives alone
    after = steps(engine, cache, submit(engine, cache, fresh, 16, plan=False))
    assert not any(isinstance(e, Cached) for events in after for e in events)
    assert tokens(after) == alone
