"""The request streams' rescue paths, driven at the exact moment with real engine workers.

A request whose worker (in hetero mode: whose decoder) dies before its first token goes on on
another; an offloaded decode whose move back to the GPU engine fails stays on the CPU, or, when the
GPU engine dies after the move, ends with a clear error. Each test runs real llama.cpp worker
processes under their supervisor handles, a real ring and the daemon's KV ledger, and kills a worker
with a signal at the moment the path needs (a SIGSTOPped worker takes nothing from its pipe until it
is killed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from dataclasses import replace

import pytest

from syshaxd.engine.decider import Decision, Verdict
from syshaxd.engine.handoff import HandoffStream
from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.engine.offload import OffloadCounts, OffloadStream
from syshaxd.engine.retry import RetryStream
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.engine.types import Accepted, Delta, EngineSpec, GenerateRequest, Pool, Rejected, SamplingParams
from syshaxd.kv.ring import KVRing

PROMPT = "The quick brown fox jumps over the lazy dog because"


def request(max_tokens: int = 24) -> GenerateRequest:
    return GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=max_tokens, ignore_eos=True,
                           sampling=SamplingParams(temperature=0), prompt=PROMPT)


async def drain(stream) -> tuple[str, str, int]:
    """The stream's text, its finish reason (or the Rejected code) and its token count."""
    text, n = "", 0
    while True:
        event = await asyncio.wait_for(stream.next_event(), 60)
        if isinstance(event, Rejected):
            return text, f"rejected:{event.code}", n
        if isinstance(event, Delta):
            text += event.text
            n += event.n_tokens
            if event.finish_reason:
                return text, event.finish_reason + (f":{event.error}" if event.error else ""), n
        else:
            assert isinstance(event, Accepted), event


class Workers:
    """Real engine workers on one ring and one ledger, started and stopped around a test."""

    def __init__(self, model, instance: str) -> None:
        self.ring = KVRing.create(instance, 64 << 20)
        self.ledger = KVLedger(self.ring, orphan_grace=0.1)
        self.spec = EngineSpec(backend="llamacpp", role="generate", model_path=str(model), model_name="m", n_ctx=512,
                               max_batch_size=2, threads=1, prefill_chunk_size=128, ring=instance)
        self.handles: list[WorkerHandle] = []

    async def start(self, name: str, **changes) -> WorkerHandle:
        # no restart within the test, and never declared hung: the test decides what dies
        handle = WorkerHandle(name, replace(self.spec, **changes), "warning", 600.0, 0.0, self.ledger)
        self.handles.append(handle)
        handle.start()
        await asyncio.wait_for(handle.ready.wait(), 120)
        return handle

    async def close(self) -> None:
        for handle in self.handles:
            await handle.stop()
        self.ring.unlink()
        self.ring.close()


def run(model, scenario):
    async def main():
        workers = Workers(model, f"test-{uuid.uuid4().hex[:8]}")
        try:
            return await scenario(workers)
        finally:
            await workers.close()

    return asyncio.run(main())


async def until(check, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_decoder_that_dies_before_its_first_token_hands_the_request_to_another(default_model):
    async def scenario(w: Workers):
        prefill = await w.start("prefill0", role="prefill", pool=Pool.PREFILL, max_batch_size=1)
        first, second = await w.start("decode0"), await w.start("decode1")
        alone = await drain(second.submit(request()))
        os.kill(first.pid, signal.SIGSTOP)  # it will take the record and never read it
        picked: list[str] = []

        def pick_decoder():
            picked.append((first if not picked else second).name)
            return first if len(picked) == 1 else second

        stream = HandoffStream(request(), prefill, w.ledger, pick_decoder)
        reading = asyncio.create_task(drain(stream))
        await until(lambda: picked)
        assert w.ledger.held() == 1  # the record, lent to decode0
        os.kill(first.pid, signal.SIGKILL)
        got = await reading
        await until(lambda: w.ring.stats().used_bytes == 0)
        return alone, got, picked, w.ledger.status()

    alone, got, picked, kv = run(default_model, scenario)
    assert picked == ["decode0", "decode1"]
    assert got == alone  # same text, same finish, same count: the client never saw the death
    assert kv.records_written == 1 and kv.fallbacks == {"decoder_died": 1} and kv.records_held == 0


def test_an_offloaded_decode_stays_on_the_cpu_when_the_gpu_engine_cannot_take_it(default_model):
    async def scenario(w: Workers):
        cpu = await w.start("decode0")
        gpu = WorkerHandle("gpu0", replace(w.spec, pool=Pool.GPU), "warning", 600.0, 0.0, w.ledger)  # never started
        alone = await drain(cpu.submit(request()))
        counts = OffloadCounts()
        req = request()
        stream = OffloadStream(req, cpu.submit(req), 4, lambda: Decision(Verdict.GPU, "the GPU has room"),
                               lambda: gpu, counts)
        got = await drain(stream)
        return alone, got, counts, stream.moved_to, cpu.in_flight

    alone, got, counts, moved_to, in_flight = run(default_model, scenario)
    assert got == alone and moved_to == "" and in_flight == 0
    assert counts.reconsidered >= 5 and counts.move_failed == counts.reconsidered and counts.moved_to_gpu == 0


def test_an_offloaded_decode_whose_gpu_engine_dies_after_the_move_ends_with_a_clear_error(default_model):
    async def scenario(w: Workers):
        cpu = await w.start("decode0")
        gpu = await w.start("gpu0", pool=Pool.GPU)
        os.kill(gpu.pid, signal.SIGSTOP)
        counts = OffloadCounts()
        req = request()
        stream = OffloadStream(req, cpu.submit(req), 4, lambda: Decision(Verdict.GPU, "the GPU has room"),
                               lambda: gpu, counts)
        reading = asyncio.create_task(drain(stream))
        await until(lambda: stream.moved_to)
        os.kill(gpu.pid, signal.SIGKILL)
        got = await reading
        return got, counts, cpu.in_flight

    (text, finish, n), counts, in_flight = run(default_model, scenario)
    assert counts.moved_to_gpu == 1 and in_flight == 0  # the CPU sequence was freed at the move
    assert 4 <= n < 24 and text  # what the CPU generated reached the client...
    assert finish.startswith("error:moving the decode to the GPU failed"), finish  # ...then a clear end


def test_a_cpu_request_whose_worker_dies_before_its_first_token_goes_on_on_another(default_model):
    async def scenario(w: Workers):
        first, second = await w.start("cpu0"), await w.start("cpu1")
        alone = await drain(second.submit(request()))
        os.kill(first.pid, signal.SIGSTOP)  # it takes the request and never answers
        req = request()
        stream = RetryStream(req, first.submit(req), lambda: second)
        reading = asyncio.create_task(drain(stream))
        await asyncio.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        return alone, await reading

    alone, got = run(default_model, scenario)
    assert got == alone
