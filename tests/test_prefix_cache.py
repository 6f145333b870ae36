"""Automatic prefix caching: the daemon's block index, the shared block store, and hits that change nothing.

The index and the store are tested alone; the rest runs a real daemon on the default model with small
blocks (prefill_chunk_size 16), so that prompts of a few dozen words share several blocks.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import urllib.request

import openai
import pytest

from conftest import MODEL_NAME, http_json, start_daemon
from syshaxd.engine.prefix_cache import PrefixCache, block_keys
from syshaxd.sdk.types import Cached
from syshaxd.sdk.kv import block_store
from syshaxd.sdk.kv.block_store import BlockStore, StoreError, store_path

BLOCK = 16


# --- the index ------------------------------------------------------------------------------------


def written(cache: PrefixCache, rid: str, plan, hit_tokens: int = 0) -> None:
    """What an engine reports after running the planned prompt: every planned block written."""
    slots = [slot for _, slot in plan.stores] + ([plan.final_store] if plan.final_store >= 0 else [])
    cache.cached(Cached(rid, tuple((slot, 1000 + slot) for slot in slots), hit_tokens=hit_tokens))


def hit_tokens(plan) -> int:
    """Tokens of the plan's blocks that were written when it was made."""
    return sum(1 for _, checksum in plan.hits if checksum) * plan.block_tokens


def test_a_prompt_reuses_its_longest_cached_run_of_blocks_and_leaves_its_last_token_to_evaluate():
    cache = PrefixCache(n_slots=8, block_tokens=4, slot_bytes=64)
    prompt = list(range(100, 110))  # blocks [100..103], [104..107], and 2 tokens more
    first = cache.plan("a", prompt)
    assert first.hits == () and [index for index, _ in first.stores] == [0, 1]
    assert first.final is None and first.final_store >= 0  # the whole prompt is kept too
    # a request planned while the blocks are being written may read them (checksum 0: check when you run),
    # and does not write them again
    meanwhile = cache.plan("b", prompt)
    assert meanwhile.hits == tuple((slot, 0) for _, slot in first.stores) and meanwhile.stores == ()
    assert meanwhile.final == (first.final_store, 0) and meanwhile.final_store == -1
    written(cache, "a", first)
    written(cache, "b", meanwhile, hit_tokens=8)
    again = cache.plan("c", prompt)
    assert [slot for slot, _ in again.hits] == [slot for _, slot in first.stores]
    assert hit_tokens(again) == 8 and again.stores == ()
    assert again.hits[0][1] == 1000 + again.hits[0][0]  # the checksum the writer reported
    assert again.final == (first.final_store, 1000 + first.final_store)  # this very prompt: nothing to run
    # a prompt that is exactly two blocks reuses only the first: its last token must be evaluated
    exact = cache.plan("d", prompt[:8])
    assert hit_tokens(exact) == 4 and exact.final is None and exact.final_store >= 0
    # another first block: nothing matches, even where later tokens are the same
    other = cache.plan("e", [99] + prompt[1:])
    assert other.hits == ()
    status = cache.status()
    assert status.queries == 10 + 10 + 10 + 8 + 10 and status.hits == 8 and status.stored == 3


def test_blocks_in_use_are_never_evicted_and_idle_ones_go_least_recently_used_first():
    cache = PrefixCache(n_slots=4, block_tokens=2, slot_bytes=64)
    a = cache.plan("a", [1, 2, 0])  # a block and the whole prompt: two slots
    b = cache.plan("b", [3, 4, 0])
    full = cache.plan("c", [5, 6, 0])
    assert full.stores == () and full.final_store == -1  # every slot is held by requests still running
    written(cache, "a", a)
    written(cache, "b", b)
    cache.release("c")
    reader = cache.plan("d", [1, 2, 9])  # holds block [1, 2]; its own whole prompt takes a's (least recent)
    assert hit_tokens(reader) == 2 and reader.final_store == a.final_store
    assert cache.status().evictions == 1
    evicting = cache.plan("e", [5, 6, 0])
    assert evicting.stores == ((0, b.stores[0][1]),)  # [3, 4]'s slot, not the one being read
    assert evicting.final_store == b.final_store
    assert cache.status().evictions == 3
    assert cache.plan("f", [3, 4, 0]).hits == ()  # evicted
    assert hit_tokens(cache.plan("g", [1, 2, 0])) == 2  # never evicted while in use


def test_a_block_an_engine_refuses_is_dropped_and_its_slot_reused():
    cache = PrefixCache(n_slots=1, block_tokens=2, slot_bytes=64)
    plan = cache.plan("a", [1, 2, 3])
    written(cache, "a", plan)
    hit = cache.plan("b", [1, 2, 3])
    cache.cached(Cached("b", refused=(hit.hits[0][0],)))
    assert cache.plan("c", [1, 2, 3]).hits == ()
    assert cache.status().refused == 1 and cache.status().blocks == 0  # c's own is not written yet


def test_block_keys_chain_over_everything_before():
    assert block_keys([1, 2, 3, 4, 5], 2) == block_keys([1, 2, 3, 4], 2)
    assert block_keys([1, 2, 3, 4], 2)[1] != block_keys([9, 9, 3, 4], 2)[1]
    assert len(block_keys(list(range(31)), BLOCK)) == 1


# --- the block store ------------------------------------------------------------------------------


def test_the_block_store_is_private_shared_and_swept_when_its_daemon_is_gone(tmp_path):
    store = BlockStore.create("t1", n_slots=3, slot_bytes=4096, directory=tmp_path)
    try:
        assert store_path("t1", tmp_path).stat().st_mode & 0o777 == 0o600
        other = BlockStore.attach("t1", directory=tmp_path)
        store.slot(2)[:5] = b"hello"
        assert bytes(other.slot(2)[:5]) == b"hello"
        with pytest.raises(IndexError):
            other.slot(3)
        other.close()
        assert block_store.sweep_stale(tmp_path) == []  # its owner (this process) lives
    finally:
        store.close()
    # a store whose owner died (a daemon killed with -9) goes at the next start
    code = ("import sys; from syshaxd.sdk.kv.block_store import BlockStore; "
            f"BlockStore.create('t2', 1, 4096, directory={str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert block_store.sweep_stale(tmp_path) == [store_path("t2", tmp_path)]
    with pytest.raises(StoreError, match="daemon creates it"):
        BlockStore.attach("t2", directory=tmp_path)


# --- a daemon --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached(default_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "prefill_chunk_size": BLOCK,
                           "n_ctx": 512, "admin_socket": str(tmp / "admin.sock")})
    d.socket = tmp / "admin.sock"
    yield d
    assert d.stop() == 0, d.log()
    assert not store_path(str(d.proc.pid)).exists()  # unlinked on a clean exit


def connect(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=300)


def complete(client, prompt, cache_prompt=True, max_tokens=20):
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"cache_prompt": cache_prompt})
    return r.choices[0].text, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, opening hours and "
          "prices, and you never invent facts. ")
# prompts sharing prefixes of many lengths: with each other, with the system text, and not at all
PROMPTS = [
    SYSTEM + "What time do you open?",
    SYSTEM + "What time do you open on Sundays?",
    SYSTEM + "How much is a rye loaf?",
    SYSTEM,  # only the shared part
    SYSTEM + "How much is a rye loaf? And a baguette?",
    SYSTEM[:50],  # shorter than the cached run
    SYSTEM + "What time do you open? " * 3,
    "List the prime numbers below thirty: 2, 3, 5,",
    "List the prime numbers below thirty: 2, 3, 5, 7, 11,",
    " ".join(f"w{i}" for i in range(48)),  # many short tokens: whole blocks and a remainder
    " ".join(f"w{i}" for i in range(40)) + " stop here.",
]


def test_a_hit_returns_the_tokens_a_miss_returns(cached):
    client = connect(cached)
    misses = [complete(client, p, cache_prompt=False) for p in PROMPTS]
    assert all(m[2] == 0 for m in misses)
    first = [complete(client, p) for p in PROMPTS]  # fills the cache, and hits what earlier prompts left
    again = [complete(client, p) for p in PROMPTS]  # every whole block but the last token's is cached now
    for prompt, miss, one, two in zip(PROMPTS, misses, first, again):
        assert one[:2] == miss[:2] and two[:2] == miss[:2], prompt
        assert two[2] == two[3], prompt  # the whole prompt, and its last token's logits
    assert sum(one[2] for one in first) > 0  # the bakery prompts shared the system text on first sight
    status = cached.status()["prefix_cache"]
    assert status["hits"] > 0 and status["queries"] > status["hits"] and status["refused"] == 0
    assert status["block_tokens"] == BLOCK and status["blocks"] > 0


def test_concurrent_hits_return_what_each_prompt_returns_alone(cached):
    client = connect(cached)
    alone = [complete(client, p, cache_prompt=False)[:2] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(client, p), PROMPTS * 2))
    assert [t[:2] for t in together] == alone * 2
    assert sum(t[2] for t in together) > 0


def test_requests_that_arrive_together_share_the_blocks_the_first_one_writes(cached):
    client = connect(cached)
    prompt = "A list of rivers, longest first: " + ", ".join(f"river {i}" for i in range(30))
    text, n, _, prompt_tokens = complete(client, prompt, cache_prompt=False)
    before = cached.status()["prefix_cache"]["hits"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda _: complete(client, prompt), range(4)))
    assert [t[:2] for t in together] == [(text, n)] * 4
    # prompts run one at a time in the engine: three of the four found the first one's prompt kept whole
    assert cached.status()["prefix_cache"]["hits"] - before == 3 * prompt_tokens


def test_a_chat_reuses_its_earlier_turns(cached):
    client = connect(cached)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What bread do you bake?"}]
    reused = []
    for turn in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
        fresh = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                               extra_body={"cache_prompt": False})
        assert r.choices[0].message.content == fresh.choices[0].message.content
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        reused.append(r.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And what else, number {turn}?"}]
    assert reused[1] > 0 and reused[2] > reused[1]  # each turn reuses the history before it


def test_status_and_metrics_count_the_cache(cached):
    before = cached.status()["prefix_cache"]
    client = connect(cached)
    prompt = SYSTEM + "Do you sell cakes?"
    complete(client, prompt)
    _, _, hit, _ = complete(client, prompt)
    after = cached.status()["prefix_cache"]
    assert after["queries"] > before["queries"] and after["hits"] - before["hits"] >= hit > 0
    with urllib.request.urlopen(cached.url + "/metrics") as resp:
        metrics = resp.read().decode()
    hits = float(re.search(r"^syshax_prefix_cache_hits_total (\S+)$", metrics, re.M).group(1))
    queries = float(re.search(r"^syshax_prefix_cache_queries_total (\S+)$", metrics, re.M).group(1))
    assert hits == after["hits"] and queries == after["queries"]
    assert "syshax_prefix_cache_used_bytes" in metrics
    out = subprocess.run([sys.executable, "-m", "syshaxd.cli", "status", "--socket", str(cached.socket)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^prefix cache: \d+ of \d+ blocks of 16 tokens .* prompt tokens hit", out.stdout, re.M), out.stdout


def test_a_small_cache_evicts_and_stays_exact(default_model, tmp_path):
    # 2 MiB holds three slots of 16 tokens and a token's logits: every new prompt evicts
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "prefill_chunk_size": BLOCK,
                                "n_ctx": 512, "prefix_cache_mb": 2})
    try:
        client = connect(d)
        prompts = PROMPTS[7:]
        expected = [complete(client, p, cache_prompt=False)[:2] for p in prompts]
        for _ in range(2):
            assert [complete(client, p)[:2] for p in prompts] == expected
        status = d.status()["prefix_cache"]
        assert status["capacity_blocks"] == 3 and status["evictions"] > 0 and status["blocks"] <= 3
    finally:
        assert d.stop() == 0


def test_prefix_cache_mb_0_turns_it_off(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "prefix_cache_mb": 0})
    try:
        client = connect(d)
        assert complete(client, SYSTEM)[2] == 0 and complete(client, SYSTEM)[2] == 0
        assert d.status()["prefix_cache"] is None
        assert not store_path(str(d.proc.pid)).exists()
    finally:
        assert d.stop() == 0


def test_a_bad_request_is_refused_before_the_cache_sees_it(cached):
    before = cached.status()["prefix_cache"]["queries"]
    code, body = http_json(cached.url + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "word " * 600, "max_tokens": 4})
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"
    code, body = http_json(cached.url + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "cache_prompt": "yes"})
    assert code == 400 and body["error"]["param"] == "cache_prompt"
    assert cached.status()["prefix_cache"]["queries"] == before
    assert os.path.exists(store_path(str(cached.proc.pid)))


def test_a_seeded_sample_from_the_cached_logits_is_the_sample_a_miss_draws(cached):
    client = connect(cached)
    prompt = SYSTEM + "Tell me about your sourdough."

    def sampled(cache_prompt):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0.9, seed=11,
                                      top_p=0.95, extra_body={"cache_prompt": cache_prompt})
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    miss = sampled(False)
    sampled(True)  # keeps the whole prompt
    hit = sampled(True)
    assert hit[0] == miss[0] and hit[1] == hit[2]


def test_a_cached_block_whose_bytes_changed_is_refused_and_the_prompt_recomputed(default_model, tmp_path):
    """The engine checks every record it is planned to read: a flipped byte makes it evaluate instead."""
    from syshaxd.sdk.kv.block_store import HEADER_SIZE
    from syshaxd.sdk.kv.record import MAGIC

    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "prefill_chunk_size": BLOCK,
                                "n_ctx": 512, "prefix_cache_mb": 16})
    try:
        client = connect(d)
        prompt = PROMPTS[6]
        expected = complete(client, prompt, cache_prompt=False)[:2]
        complete(client, prompt)  # kept
        cache = d.status()["prefix_cache"]
        slot_bytes = cache["capacity_bytes"] // cache["capacity_blocks"]
        with open(store_path(str(d.proc.pid)), "r+b") as f:
            flipped = 0
            for slot in range(cache["capacity_blocks"]):
                at = HEADER_SIZE + slot * slot_bytes
                f.seek(at)
                if f.read(len(MAGIC)) == MAGIC:
                    f.seek(at + 4096)  # inside the K and V rows, under the record's checksum
                    byte = f.read(1)
                    f.seek(at + 4096)
                    f.write(bytes([byte[0] ^ 0xFF]))
                    flipped += 1
        assert flipped > 0
        text, n, cached_tokens, _ = complete(client, prompt)
        assert (text, n) == expected and cached_tokens == 0
        status = d.status()["prefix_cache"]
        assert status["refused"] >= 1
        assert "cannot be used" in d.log()
        assert complete(client, prompt)[:2] == expected  # kept anew, and right
    finally:
        assert d.stop() == 0
