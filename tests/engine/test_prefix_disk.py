"""The prefix cache's disk tier: blocks in files that survive shared memory's evictions and the daemon's restarts.

The tier is tested alone on a real block store (records written as engines write them), then with real daemons on
the default model: a restart, a corrupted file, another build's folder, and eviction to disk and back, each
checked against the text a miss gives.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import MODEL_NAME, start_daemon
from syshaxd.engine.prefix_cache import PrefixCache
from syshaxd.engine.prefix_disk import DiskTier, identity_of
from syshaxd.sdk.kv.block_keys import block_keys
from syshaxd.sdk.kv.block_store import BlockStore
from syshaxd.sdk.kv.record import ModelFingerprint, decode, encode_into
from syshaxd.sdk.types import Cached
from test_prefix_cache import BLOCK, PROMPTS, SYSTEM, complete, connect

FP = ModelFingerprint("llama", 2, 2, 8, "norm", 8, 10000.0, 1.0, 1234)
ENGINE = {"backend": "llamacpp", "build": "b1", "kernels": "repack", "repack": "auto", "attention": "tiled",
          "weight_types": ["q4_0"], "prefix_cache": True}


def _write_record(store: BlockStore, slot: int, tokens: list[int], start: int) -> int:
    rng = np.random.default_rng(start)
    n = len(tokens)
    kv = [rng.standard_normal((n, 2, 8)).astype(np.float16) for _ in range(2)]
    encode_into(store.slot(slot), FP, tokens, np.arange(start, start + n), kv, kv)
    return decode(store.slot(slot)).checksum


@pytest.fixture
def store(tmp_path):
    s = BlockStore.create("disktest", 8, 4096, directory=tmp_path)
    yield s
    s.close()
    s.unlink()


def _settled(disk: DiskTier, written: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while disk.written + disk.missed < written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.written + disk.missed >= written


def test_blocks_written_through_come_back_after_shared_memory_evicts_them(tmp_path, store):
    cache = PrefixCache(store.n_slots, 4, store.slot_bytes)
    disk = cache.disk = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    disk.open_for(ENGINE)
    try:
        prompts = [[p * 100 + i for i in range(17)] for p in range(4)]  # four blocks each, then a last token
        for n, prompt in enumerate(prompts):
            plan = cache.plan(f"r{n}", prompt)
            stored = tuple((slot, _write_record(store, slot, prompt[i * 4:i * 4 + 4], i * 4)) for i, slot in plan.stores)
            cache.cached(Cached(f"r{n}", stored))
            _settled(disk, 4 * (n + 1))
        assert disk.written == 16
        status = cache.status()
        assert status.evictions > 0 and status.disk.blocks == disk.written
        # the first prompt's blocks left shared memory; the disk gives them back, in order
        wanted = cache.from_disk(prompts[0]).taken
        assert [key for key, _ in wanted] == block_keys(prompts[0], 4)[:len(wanted)] and wanted
        # a prompt sharing those blocks, planned meanwhile, waits for this read instead of reading them again
        assert cache.from_disk(prompts[0][:12] + [7, 7, 7, 7, 7]).waits == [key for key, _ in wanted[:3]]
        assert cache.loaded([(key, slot, disk.read_into(key, slot)) for key, slot in wanted]) == len(wanted)
        plan = cache.plan("again", prompts[0])
        assert len(plan.hits) == 4 and all(checksum for _, checksum in plan.hits)
        for i, (slot, checksum) in enumerate(plan.hits):
            record = decode(store.slot(slot), expect=FP)
            assert record.checksum == checksum and record.tokens.tolist() == prompts[0][i * 4:i * 4 + 4]
    finally:
        disk.close()


def test_a_file_that_fails_its_checks_is_deleted_and_never_served(tmp_path, store):
    disk = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    disk.open_for(ENGINE)
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, 4)[0]
    disk.keep(key, 0, _write_record(store, 0, tokens, 0))
    disk.close()  # written before it stops
    path = next((tmp_path / "disk").glob("*/*"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the K and V rows, under the record's checksum
    path.write_bytes(data)
    assert disk.read_into(key, 1) is None and disk.corrupt == 1 and not path.exists() and not disk.has(key)


def test_another_build_or_model_discards_the_old_blocks_and_says_how_many(tmp_path, store):
    first = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    first.open_for(ENGINE)
    for slot in range(3):
        tokens = [slot * 10 + i for i in range(4)]
        first.keep(block_keys(tokens, 4)[0], slot, _write_record(store, slot, tokens, 0))
    first.close()
    same = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    same.open_for(ENGINE)
    assert same.status().blocks == 3 and same.discarded == 0
    same.close()
    # what is not a folder of block files is never touched: prefix_cache_dir may be a folder of other things
    (tmp_path / "disk" / "notes").mkdir()
    (tmp_path / "disk" / "notes" / "keep.txt").write_text("mine")
    (tmp_path / "disk" / "0123456789abcdef").mkdir()
    (tmp_path / "disk" / "0123456789abcdef" / "report.pdf").write_text("mine too")
    (tmp_path / "disk" / "readme").write_text("and this")
    rebuilt = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    rebuilt.open_for(ENGINE | {"build": "b2"})
    assert rebuilt.discarded == 3 and rebuilt.status().blocks == 0
    rebuilt.close()
    assert (tmp_path / "disk" / "notes" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "disk" / "0123456789abcdef" / "report.pdf").exists() and (tmp_path / "disk" / "readme").exists()
    assert len([p for p in (tmp_path / "disk").iterdir() if p.is_dir()]) == 3  # the old identity's folder went
    assert identity_of("model", 4, 4, ENGINE) != identity_of("other model", 4, 4, ENGINE)
    assert identity_of("model", 4, 4, ENGINE) != identity_of("model", 4, 8, ENGINE)


def test_the_budget_evicts_the_least_recently_used_files(tmp_path, store):
    disk = DiskTier(tmp_path / "disk", 1 << 30, store, "model", 4, 4)
    disk.open_for(ENGINE)
    keys = []
    for slot in range(4):
        tokens = [slot * 10 + i for i in range(4)]
        keys.append(block_keys(tokens, 4)[0])
        disk.keep(keys[-1], slot, _write_record(store, slot, tokens, 0))
    _settled(disk, 4)
    size = disk.used() // 4
    disk.budget = 3 * size
    assert disk.read_into(keys[0], 5)  # the first becomes the most recently used
    tokens = [99, 98, 97, 96]
    disk.keep(block_keys(tokens, 4)[0], 4, _write_record(store, 4, tokens, 0))
    _settled(disk, 5)
    disk.close()
    assert disk.evictions == 2 and disk.has(keys[0]) and not disk.has(keys[1]) and not disk.has(keys[2])
    assert len(list((tmp_path / "disk").glob("*/*"))) == 3


# --- real daemons -----------------------------------------------------------------------------------


def _serve(tmp: Path, disk: Path, **config):
    return start_daemon(tmp, {"model": config.pop("model"), "model_name": MODEL_NAME, "prefill_chunk_size": BLOCK,
                              "n_ctx": 512, "prefix_cache_dir": str(disk)} | config)


def _disk(d) -> dict:
    return d.status()["prefix_cache"]["disk"]


def _written(d, timeout: float = 30.0) -> dict:
    """The disk tier's status once its writer has caught up with the blocks shared memory stored."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = d.status()["prefix_cache"]
        if status["disk"]["written"] + status["disk"]["missed"] >= status["stored"] - status["prompts"]:
            return status["disk"]
        time.sleep(0.1)
    raise AssertionError(f"the disk tier did not catch up: {d.status()['prefix_cache']}")


LONG = 48  # tokens generated per prompt: long enough that a wrong KV shows in the text


def test_a_prompt_seen_before_a_restart_is_a_hit_from_disk_with_the_text_a_miss_gives(default_model, tmp_path):
    disk = tmp_path / "disk"
    d = _serve(tmp_path, disk, model=str(default_model))
    try:
        client = connect(d)
        misses = [complete(client, p, cache_prompt=False, max_tokens=LONG) for p in PROMPTS]
        for p in PROMPTS:
            complete(client, p, max_tokens=LONG)
        before = _written(d)
        assert before["state"] == "open" and before["written"] > 0 and before["blocks"] == before["written"]
    finally:
        assert d.stop() == 0, d.log()
    d = _serve(tmp_path, disk, model=str(default_model))
    try:
        assert _disk(d)["blocks"] == before["blocks"]
        client = connect(d)
        # the bakery prompts share their first blocks and arrive together: one reads them back, the others wait for
        # that read rather than computing them
        bakery = [i for i, p in enumerate(PROMPTS) if p.startswith(SYSTEM)]
        with concurrent.futures.ThreadPoolExecutor(len(bakery)) as pool:
            together = dict(zip(bakery, pool.map(lambda i: complete(client, PROMPTS[i], max_tokens=LONG), bakery)))
        assert all(hit[2] >= BLOCK for hit in together.values()), together
        after = [together.get(i) or complete(client, p, max_tokens=LONG) for i, p in enumerate(PROMPTS)]
        for prompt, miss, hit in zip(PROMPTS, misses, after):
            assert hit[:2] == miss[:2], prompt
        assert sum(hit[2] for hit in after) >= BLOCK * 4  # cached tokens, from disk: shared memory began empty
        status = _disk(d)
        assert status["loaded"] > 0 and status["corrupt"] == 0 and status["bytes_read"] > 0
        assert d.status()["prefix_cache"]["refused"] == 0  # every block read back checked out in the engine too
    finally:
        assert d.stop() == 0, d.log()
    # every block file corrupted: the texts stay a miss's, the files are dropped and counted
    for path in disk.glob("*/*"):
        data = bytearray(path.read_bytes())
        data[-64] ^= 0xFF
        path.write_bytes(data)
    d = _serve(tmp_path, disk, model=str(default_model))
    try:
        client = connect(d)
        again = [complete(client, p, max_tokens=LONG) for p in PROMPTS]
        assert [a[:2] for a in again] == [m[:2] for m in misses]
        status = _disk(d)
        assert status["corrupt"] > 0 and status["loaded"] == 0
        assert "cannot be used" in d.log()
    finally:
        assert d.stop() == 0, d.log()
    # another block size is another identity: the old blocks go at start, counted
    n = len(list(disk.glob("*/*")))
    d = _serve(tmp_path, disk, model=str(default_model), prefix_block_tokens=8)
    try:
        connect(d)
        deadline = time.monotonic() + 30
        while _disk(d)["state"] != "open" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _disk(d)["discarded"] == n > 0 and "removed %d blocks of another" % n in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_a_small_shared_memory_evicts_to_disk_and_reads_back_exactly(default_model, tmp_path):
    # 2 MiB of shared memory holds four blocks: every prompt evicts the others', which the disk keeps
    d = _serve(tmp_path, tmp_path / "disk", model=str(default_model), prefix_cache_mb=2)
    try:
        client = connect(d)
        prompts = PROMPTS[6:]
        expected = [complete(client, p, cache_prompt=False, max_tokens=LONG)[:2] for p in prompts]
        for _ in range(3):
            assert [complete(client, p, max_tokens=LONG)[:2] for p in prompts] == expected
        status = d.status()["prefix_cache"]
        assert status["evictions"] > 0 and status["disk"]["loaded"] > 0 and status["refused"] == 0
    finally:
        assert d.stop() == 0, d.log()


def test_prefix_cache_disk_gb_0_turns_the_tier_off(default_model, tmp_path):
    d = _serve(tmp_path, tmp_path / "disk", model=str(default_model), prefix_cache_disk_gb=0)
    try:
        complete(connect(d), PROMPTS[0])
        assert d.status()["prefix_cache"]["disk"] is None and not (tmp_path / "disk").exists()
    finally:
        assert d.stop() == 0, d.log()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args], capture_output=True, text=True, timeout=300)


def test_syshax_cache_warms_shows_and_clears_both_tiers(default_model, tmp_path):
    socket = tmp_path / "admin.sock"
    d = _serve(tmp_path, tmp_path / "disk", model=str(default_model), admin_socket=str(socket))
    try:
        client = connect(d)
        system = PROMPTS[3]
        warm = tmp_path / "warm.jsonl"
        warm.write_text(json.dumps({"prompt": PROMPTS[9]}) + "\n\n"
                        + json.dumps({"messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Hello"}]}) + "\n")
        out = _cli("cache", "warm", str(warm), "--socket", str(socket))
        assert out.returncode == 0, out.stderr
        assert re.search(r"^1: \d+ prompt tokens, 0 of them cached already$", out.stdout, re.M), out.stdout
        # the warmed prompt is a hit on first sight, with a miss's text
        miss = complete(client, PROMPTS[9], cache_prompt=False, max_tokens=LONG)
        hit = complete(client, PROMPTS[9], max_tokens=LONG)
        assert hit[:2] == miss[:2] and hit[2] > 0
        chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "What do you bake?"}])
        assert chat.usage.prompt_tokens_details.cached_tokens > 0
        _written(d)
        stats = _cli("cache", "stats", "--socket", str(socket), "--json")
        assert stats.returncode == 0 and json.loads(stats.stdout)["disk"]["blocks"] > 0, stats
        text = _cli("cache", "stats", "--socket", str(socket))
        assert re.search(r"^prefix cache on disk \(open\): \d+ blocks", text.stdout, re.M), text.stdout
        cleared = _cli("cache", "clear", "--socket", str(socket))
        assert re.match(r"cleared \d+ blocks from shared memory and [1-9]\d* files from disk", cleared.stdout), cleared
        assert not list((tmp_path / "disk").glob("*/*"))
        assert complete(client, PROMPTS[9])[2] == 0  # a miss again (and kept again)
        # a file that is not prompts: refused with its line, exit status 2
        warm.write_text("just some text\n")
        bad = _cli("cache", "warm", str(warm), "--socket", str(socket))
        assert bad.returncode == 2 and "warm.jsonl:1: not JSON" in bad.stderr
        warm.write_text(json.dumps({"messages": "hello"}) + "\n")
        bad = _cli("cache", "warm", str(warm), "--socket", str(socket))
        assert bad.returncode == 2 and '"messages" must be a non-empty list' in bad.stderr
    finally:
        assert d.stop() == 0, d.log()
