"""A request's journey (engine/journey.py) through its rescue paths, driven at the exact moment with real workers.

A request whose worker (in hetero mode: whose decoder) dies before its first token goes on on
another; one whose worker dies after tokens went out resumes on another with the tokens so far,
and its text is the text of an undisturbed run; an offloaded decode whose move back to the GPU
engine fails stays on the CPU, and one whose GPU engine dies after the move goes on on the CPU.
Each test runs real llama.cpp worker processes under their supervisor handles, a real ring and the
daemon's KV ledger, and kills a worker with a signal at the moment the path needs (a SIGSTOPped
worker takes nothing from its pipe until it is killed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from dataclasses import replace

import pytest

from syshaxd.engine.decider import Decision
from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.journey import Journey, SchedulerCalls, Stage
from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.sdk.kv.ring import KVRing
from syshaxd.sdk.types import Accepted, Delta, EngineSpec, GenerateRequest, Pool, Rejected, Route, SamplingParams

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


def engines(cpu, gpu=None, decide=None) -> SchedulerCalls:
    """The scheduler's side for a journey: cpu() and gpu() pick a worker; none comes back within the test."""
    async def never_ready(pool):
        return False

    def pick(pool, request=None):  # the request: for placement by prefix, which these pools do not use
        worker = cpu() if pool == Pool.CPU else gpu() if gpu is not None else None
        if worker is None or worker.state != "ready":
            raise EngineUnavailable(f"no {pool} worker is ready")
        return worker

    return SchedulerCalls(pick=pick, wait_ready=never_ready, decide=decide)


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

        journey = Journey(request(), Route.HETERO, engines(pick_decoder), w.ledger, prefill=prefill)
        reading = asyncio.create_task(drain(journey))
        await until(lambda: picked)
        assert w.ledger.held() == 1 and journey.stage == Stage.HANDOFF  # the record, lent to decode0
        os.kill(first.pid, signal.SIGKILL)
        got = await reading
        await until(lambda: w.ring.stats().used_bytes == 0)
        return alone, got, picked, w.ledger.status(), journey

    alone, got, picked, kv, journey = run(default_model, scenario)
    assert picked == ["decode0", "decode1"]
    assert got == alone  # same text, same finish, same count: the client never saw the death
    assert kv.records_written == 1 and kv.fallbacks == {"decoder_died": 1} and kv.records_held == 0
    assert journey.stage == Stage.DONE and journey._scheduler.counts.resent == 1


def test_an_offloaded_decode_stays_on_the_cpu_when_the_gpu_engine_cannot_take_it(default_model):
    async def scenario(w: Workers):
        cpu = await w.start("decode0")
        gpu = WorkerHandle("gpu0", replace(w.spec, pool=Pool.GPU), "warning", 600.0, 0.0, w.ledger)  # never started
        alone = await drain(cpu.submit(request()))
        gpu_has_room = engines(lambda: cpu, lambda: gpu, lambda: Decision(Route.GPU, "the GPU has room"))
        journey = Journey(request(), Route.HETERO, gpu_has_room, w.ledger, token_limit=4)
        got = await drain(journey)
        return alone, got, gpu_has_room.counts, journey.moved_to, cpu.in_flight

    alone, got, counts, moved_to, in_flight = run(default_model, scenario)
    assert got == alone and moved_to == "" and in_flight == 0
    assert counts.reconsidered >= 5 and counts.move_failed == counts.reconsidered and counts.moved_to_gpu == 0


def test_an_offloaded_decode_whose_gpu_engine_dies_after_the_move_goes_on_on_the_cpu(default_model):
    async def scenario(w: Workers):
        cpu = await w.start("decode0")
        gpu = await w.start("gpu0", pool=Pool.GPU)
        alone = await drain(cpu.submit(request()))
        os.kill(gpu.pid, signal.SIGSTOP)
        moves = iter([Route.GPU])  # the decider says "gpu" once, then "hetero" (stay)
        decide = engines(lambda: cpu, lambda: gpu, lambda: Decision(next(moves, Route.HETERO), "decided"))
        journey = Journey(request(), Route.HETERO, decide, w.ledger, token_limit=4)
        reading = asyncio.create_task(drain(journey))
        await until(lambda: journey.moved_to)
        assert journey.stage == Stage.MOVED and cpu.in_flight == 0  # the CPU sequence was freed at the move
        os.kill(gpu.pid, signal.SIGKILL)
        got = await reading
        return alone, got, decide.counts, cpu.in_flight

    alone, got, counts, in_flight = run(default_model, scenario)
    assert counts.moved_to_gpu == 1 and counts.resumed == 1 and in_flight == 0
    assert got == alone  # the text the CPU generated, then the rest on the CPU again: as if nothing happened


def test_a_cpu_request_whose_worker_dies_before_its_first_token_goes_on_on_another(default_model):
    async def scenario(w: Workers):
        first, second = await w.start("cpu0"), await w.start("cpu1")
        alone = await drain(second.submit(request()))
        os.kill(first.pid, signal.SIGSTOP)  # it takes the request and never answers
        picked = iter([first, second])
        journey = Journey(request(), Route.CPU, engines(lambda: next(picked)), w.ledger)
        reading = asyncio.create_task(drain(journey))
        await asyncio.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        return alone, await reading

    alone, got = run(default_model, scenario)
    assert got == alone


# a stop string that never comes holds text back whenever the text ends in its start (" t", " the", ...)
@pytest.mark.parametrize("stop", [(), (" the end of it all",)])
def test_a_request_whose_worker_dies_mid_stream_resumes_on_another_with_the_same_text(default_model, stop):
    async def scenario(w: Workers):
        first, second = await w.start("cpu0"), await w.start("cpu1")
        req = replace(request(160), stop=stop)
        alone = await drain(second.submit(replace(req, request_id=uuid.uuid4().hex)))
        picked = iter([first, second])
        journey = Journey(req, Route.CPU, engines(lambda: next(picked)), w.ledger)
        text, n = "", 0
        while n < 8:  # the first tokens, from cpu0
            event = await asyncio.wait_for(journey.next_event(), 60)
            if isinstance(event, Delta):
                text, n = text + event.text, n + event.n_tokens
        os.kill(first.pid, signal.SIGKILL)
        rest_text, finish, rest_n = await drain(journey)
        return alone, (text + rest_text, finish, n + rest_n), journey

    alone, got, journey = run(default_model, scenario)
    assert got == alone, (got, alone)  # greedy: the same text, finish and count as an undisturbed run
    assert journey._scheduler.counts.resumed == 1 and journey._scheduler.counts.lost == 0


def test_a_request_whose_worker_dies_mid_stream_with_nowhere_to_go_ends_with_the_error(default_model):
    async def scenario(w: Workers):
        only = await w.start("cpu0")
        journey = Journey(request(160), Route.CPU, engines(lambda: only), w.ledger)
        n = 0
        while n < 4:
            event = await asyncio.wait_for(journey.next_event(), 60)
            n += event.n_tokens if isinstance(event, Delta) else 0
        os.kill(only.pid, signal.SIGKILL)  # restarted in 600 s: not within request_timeout
        return await drain(journey), journey

    (text, finish, n), journey = run(default_model, scenario)
    assert finish.startswith("error:the engine worker died mid-stream, and no cpu worker is ready"), finish
    assert journey._scheduler.counts.lost == 1 and journey.stage == Stage.DONE
