"""The llama.cpp engine's two ends of the ring, in one process: good, corrupt and foreign records.

The test plays the daemon's part: its KV ledger hears of each record written and read, and frees it.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from conftest import MODEL_DIR
from syshaxd.engine.kv_ledger import Dropped, KVLedger, Lent, Written
from syshaxd.sdk.types import (Delta, EngineSpec, Fallback, GenerateRequest, Handling, Imported, Prefilled,
                               SamplingParams)
from syshaxd.sdk.kv.ring import KVRing

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture
def ring():
    r = KVRing.create(f"test-{uuid.uuid4().hex[:8]}", 64 << 20)
    yield r
    r.unlink()
    r.close()


def engine(model, ring, role):
    from syshax_llamacpp.engine import LlamaCppEngine

    spec = EngineSpec(backend="llamacpp", role=role, model_path=str(model), model_name="m", n_ctx=512,
                      max_batch_size=4, threads=1, prefill_chunk_size=128, ring=_instance(ring))
    return LlamaCppEngine(spec)


def _instance(ring) -> str:
    # /dev/shm/syshax-<instance>-kv
    return ring.path.name[len("syshax-"):-len("-kv")]


def run(eng, request, ledger=None, handling=Handling()):
    events = list(eng.submit(request, handling))
    while eng.has_work():
        events += eng.step()
    for event in events if ledger is not None else ():  # what the worker's handle reports in the daemon
        if isinstance(event, Prefilled) and event.handle is not None:
            ledger.tell(Written(event.request_id, event.handle, os.getpid()))
        elif isinstance(event, Imported):
            ledger.tell(event)
    return events


def request(**kw):
    return GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=12, sampling=SamplingParams(temperature=0),
                           prompt=PROMPT, **kw)


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.fixture(scope="module")
def reference(default_model):
    from syshax_llamacpp.engine import LlamaCppEngine

    eng = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(default_model),
                                    model_name="m", n_ctx=512, max_batch_size=4, threads=1, prefill_chunk_size=128))
    text = text_of(run(eng, request()))
    eng.close()
    return text


def prefill(eng, ledger=None, req=None) -> Prefilled:
    (event,) = [e for e in run(eng, req or request(), ledger) if isinstance(e, Prefilled)]
    return event


def test_record_moves_through_the_ring_and_decodes_the_same_text(default_model, ring, reference):
    pre, dec = engine(default_model, ring, "prefill"), engine(default_model, ring, "generate")
    ledger = KVLedger(ring)
    first = request()
    handed = prefill(pre, ledger, first)
    assert handed.handle is not None and ring.stats().used_bytes > 0
    events = run(dec, first, ledger, Handling(kv=handed.handle))
    imported = [e for e in events if isinstance(e, Imported)]
    assert imported[0].ok and imported[0].nbytes == handed.handle.length
    assert text_of(events) == reference
    assert ring.stats().used_bytes == 0 and ledger.held() == 0
    kv = ledger.status()
    assert (kv.records_written, kv.records_read, kv.fallbacks) == (1, 1, {})


def test_corrupted_byte_is_caught_and_the_prompt_recomputed(default_model, ring, reference):
    pre, dec = engine(default_model, ring, "prefill"), engine(default_model, ring, "generate")
    ledger = KVLedger(ring)
    first = request()
    handed = prefill(pre, ledger, first)
    view = ring._view  # the owner's writable map of the segment
    spot = 4096 + handed.handle.offset + handed.handle.length // 2
    view[spot] ^= 0xFF
    events = run(dec, first, ledger, Handling(kv=handed.handle))
    imported = [e for e in events if isinstance(e, Imported)][0]
    assert not imported.ok and imported.reason == Fallback.CHECKSUM
    assert text_of(events) == reference  # slower, never wrong
    assert ledger.status().fallbacks == {"checksum": 1} and ledger.status().records_failed == 1
    assert ring.stats().used_bytes == 0  # the bad record did not wedge the ring


def test_a_queued_request_cancelled_before_its_import_gives_its_record_back(default_model, ring):
    pre = engine(default_model, ring, "prefill")
    dec = one_slot_engine(default_model, ring)
    ledger = KVLedger(ring)
    try:
        busy = dataclasses.replace(request(), max_tokens=50, ignore_eos=True)
        dec.submit(busy)
        dec.step()  # the decoder's one slot is taken
        waiting = request()
        handed = prefill(pre, ledger, waiting)
        dec.submit(waiting, Handling(kv=handed.handle))
        ledger.tell(Lent(waiting.request_id, "decode0"))
        ledger.tell(Dropped(waiting.request_id))  # the client left; the decoder may still read the record
        assert ring.stats().used_bytes > 0
        (returned,) = dec.cancel(waiting.request_id)
        assert isinstance(returned, Imported) and returned.reason == Fallback.CANCELLED
        ledger.tell(returned)
        assert ring.stats().used_bytes == 0 and ledger.status().fallbacks == {}
    finally:
        dec.close()
        pre.close()


def one_slot_engine(model, ring):
    from syshax_llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(model), model_name="m",
                                     n_ctx=512, max_batch_size=1, threads=1, prefill_chunk_size=128,
                                     ring=_instance(ring)))


def test_record_from_another_model_is_refused(default_model, ring, reference):
    q4_1 = MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"  # same architecture, other weights
    pre, dec = engine(q4_1, ring, "prefill"), engine(default_model, ring, "generate")
    handed = prefill(pre)
    events = run(dec, request(), handling=Handling(kv=handed.handle))
    imported = [e for e in events if isinstance(e, Imported)][0]
    assert not imported.ok and imported.reason == Fallback.FINGERPRINT
    assert text_of(events) == reference


def test_record_for_other_tokens_is_refused(default_model, ring, reference):
    pre, dec = engine(default_model, ring, "prefill"), engine(default_model, ring, "generate")
    handed = prefill(pre)
    other = dataclasses.replace(request(), prompt=PROMPT + " and")
    events = run(dec, other, handling=Handling(kv=handed.handle))
    assert [e for e in events if isinstance(e, Imported)][0].reason == Fallback.TOKEN_MISMATCH


def test_a_generating_engine_hands_a_prompt_on_without_waiting_for_a_batch_slot(default_model, ring, reference):
    # auto mode's GPU engine with every batch slot busy generating: an offloaded request's prompt still runs
    # at once (it needs the prompt context, not a slot) and its KV decodes elsewhere to the same text
    gpu = one_slot_engine(default_model, ring)
    dec = engine(default_model, ring, "generate")
    try:
        long = dataclasses.replace(request(), max_tokens=200, ignore_eos=True)
        gpu.submit(long)
        gpu.step()  # the long one holds the only slot
        offloaded = request()
        gpu.submit(offloaded, Handling(handoff=True))
        steps, handed = 0, None
        while handed is None:
            steps += 1
            handed = next((e for e in gpu.step() if isinstance(e, Prefilled)), None)
        assert steps <= 3, f"the offloaded prompt waited {steps} steps"
        assert gpu.stats().running == 1 and handed.handle is not None
        taken = run(dec, dataclasses.replace(request(), request_id=handed.request_id),
                    handling=Handling(kv=handed.handle))
        assert [e.ok for e in taken if isinstance(e, Imported)] == [True]
        assert text_of(taken) == reference
    finally:
        gpu.close()
        dec.close()
