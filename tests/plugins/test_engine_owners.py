"""The llama.cpp engine's owners over llama.cpp, each by itself, apart from the whole engine (engine.py builds them and
the Stepper asks them): the prompt context, the decode batch, the sampler, the prefix side (checkpoints and deferred
blocks), the handoff, the warm-up, and the Stepper's accounting of slots and streams. Real llama.cpp on the default
model, a real KV ring. test_slots.py has the owners that need no model (the slot table, the sequence's states, the
guesser); the engine's own tests (test_ubatch, test_handoff_engine, test_speculation and the exact-text suites) run
them all together."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest

from syshax_llamacpp.sequence import Sequence, SlotState
from test_handoff_engine import _instance, ring  # noqa: F401  (the fixture: a real KV ring of 64 MiB)
from syshaxd.sdk.types import (EngineSpec, Fallback, GenerateRequest, Handling, Imported, KVHandle, Prefilled,
                               Proofs, Rejected, SamplingParams)

N_CTX, CHUNK, SEQS = 512, 64, 4


def seq_of(prompt: list[int], rid: str = "", decodes_here: bool = True, **handling) -> Sequence:
    request = GenerateRequest(request_id=rid or uuid.uuid4().hex[:8], max_tokens=8,
                              sampling=SamplingParams(temperature=0), prompt_tokens=tuple(prompt))
    return Sequence(request=request, prompt=list(prompt), max_tokens=8, decodes_here=decodes_here,
                    handling=Handling(**handling))


# --- the owners over llama.cpp ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(default_model):
    from syshax_llamacpp.contexts import load_model

    # attention as llama.cpp does it (tiled_attention off): this process's other engines (test_ubatch's,
    # test_handoff_engine's) read the same once-per-process setting
    spec = EngineSpec(backend="llamacpp", role="generate", model_path=str(default_model), model_name="m",
                      n_ctx=N_CTX, max_batch_size=SEQS, threads=1, prefill_chunk_size=CHUNK)
    loaded = load_model(spec)
    yield spec, loaded
    import llama_cpp

    llama_cpp.llama_model_free(loaded.model)


@pytest.fixture
def prompt_ctx(model):
    from syshax_llamacpp.contexts import prompt_params
    from syshax_llamacpp.prompt_context import PromptContext
    from syshaxd.sdk.gguf.vocab import Vocab

    spec, loaded = model
    ctx = PromptContext(loaded.model, prompt_params(spec, N_CTX, CHUNK, 1), CHUNK, Vocab(model=loaded.model).n_vocab)
    yield ctx
    ctx.close()


@pytest.fixture
def decode(model, prompt_ctx):
    from syshax_llamacpp.contexts import batch_params
    from syshax_llamacpp.decode_batch import DecodeBatch

    spec, loaded = model
    batch = DecodeBatch(loaded.model, batch_params(spec, N_CTX, SEQS, SEQS), SEQS, SEQS, prompt_ctx.n_vocab)
    yield batch
    batch.close()


def tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return [(7 + 31 * i + seed) % n_vocab for i in range(n)]


def test_the_prompt_context_takes_back_a_state_it_gave_and_clears_a_bad_one(prompt_ctx):
    prompt = tokens(CHUNK + 10, prompt_ctx.n_vocab)
    assert prompt_ctx.decode(prompt[:CHUNK], 0, "none") == 0
    assert prompt_ctx.decode(prompt[CHUNK:], CHUNK, "last") == 0
    logits = prompt_ctx.logits(len(prompt) - CHUNK - 1).copy()
    state = prompt_ctx.export().copy()
    prompt_ctx.clear()
    empty = prompt_ctx.export().nbytes
    assert empty < state.nbytes
    assert prompt_ctx.set_state(state)
    assert np.array_equal(prompt_ctx.export(), state)
    # the next token from the state set back gets the bits it gets after the prompt's own chunks
    assert prompt_ctx.decode([prompt[0]], len(prompt)) == 0
    after_set = prompt_ctx.logits(0).copy()
    prompt_ctx.clear()
    assert prompt_ctx.decode(prompt[:CHUNK], 0, "none") == 0 and prompt_ctx.decode(prompt[CHUNK:], CHUNK) == 0
    assert np.array_equal(prompt_ctx.logits(len(prompt) - CHUNK - 1), logits)
    assert prompt_ctx.decode([prompt[0]], len(prompt)) == 0
    assert np.array_equal(prompt_ctx.logits(0), after_set)
    assert not prompt_ctx.set_state(np.zeros(64, np.uint8))  # not a state: refused, and the context left empty
    assert prompt_ctx.export().nbytes == empty


def test_the_decode_batch_keeps_its_streams_one_run_and_a_moved_sequence_its_bytes(prompt_ctx, decode):
    import llama_cpp

    from syshax_llamacpp.decode_batch import SPLIT_KV_FROM

    prompt = tokens(40, prompt_ctx.n_vocab, seed=3)
    assert prompt_ctx.decode(prompt, 0) == 0
    state = prompt_ctx.widen(prompt_ctx.export(room=8 * SEQS), SEQS, model_shape(decode))
    seqs = [seq_of(prompt, f"s{i}") for i in range(3)]
    for seq in seqs:
        seq.enter(SlotState.PROMPT)
        assert decode.enter(seq, state)
        seq.n_past, seq.next_token = len(prompt), prompt[0]
    prompt_ctx.clear()
    assert [s.seq_id for s in seqs] == [0, 1, 2] and all(s.state is SlotState.DECODING for s in seqs)
    decode.leave(seqs[1])
    assert decode.streams.holes() == [1]
    live = [seqs[0], seqs[2]]
    seqs[2].n_past -= 1  # the end of the run that holds fewer tokens is the one moved
    decode.compact(live)
    seqs[2].n_past += 1
    assert seqs[2].seq_id == 1 and decode.streams.consecutive() and decode.counters["stream_moves"] == 1
    rows = decode.feed(live, [[], []], pad=-1)
    rc, n_rows, _ = decode.decode(pad=-1)
    assert rc == 0 and n_rows == 2 and [s.next_token for s in live] == [None, None]
    # the same KV and the same token: the moved sequence's row gives the stayed one's bits
    assert np.array_equal(decode.logits(rows[0][1]), decode.logits(rows[1][1]))
    # a lone sequence past SPLIT_KV_FROM tokens gets a padding row in the free stream beside it, while pad_lone holds
    decode.leave(seqs[2])
    lone = seqs[0]
    held = lone.n_past  # 41: the prompt's 40 and the token just fed
    lone.n_past = SPLIT_KV_FROM - 1
    assert decode.pad_stream([lone]) == -1  # its attention is not split yet: no padding row
    lone.n_past = SPLIT_KV_FROM
    assert decode.pad_stream([lone]) == lone.seq_id + 1
    assert decode.pad_stream([lone, seqs[2]]) == -1  # beside another sequence it is not alone
    lone.n_past = held
    # its step: its row, then the padding row (one token at position 0 of stream 1), whose KV goes after the step
    lone.next_token = prompt[1]
    rows = decode.feed([lone], [[]], pad=1)
    assert rows == [(lone, 0)] and decode.batch.n_tokens == 2
    assert (decode.batch.seq_id[1][0], decode.batch.pos[1], decode.batch.logits[1]) == (1, 0, False)
    assert decode.decode(pad=1)[0] == 0 and empty_stream(decode, 1) and decode.counters["padded_steps"] == 1
    assert lone.n_past == held + 1 and lone.fed[-1] == prompt[1] and lone.next_token is None
    decode.proved(pad_lone=False)  # the warm-up proved that this llama.cpp sums a lone row as in a batch
    lone.n_past = SPLIT_KV_FROM
    assert decode.pad_stream([lone]) == -1
    lone.n_past = held + 1
    # a guess: a row per guessed token after the sequence's own; the refused ones' KV is dropped after the step
    lone.next_token = prompt[2]
    decode.feed([lone], [[prompt[3], prompt[4]]], pad=-1)
    assert decode.batch.n_tokens == 3 and [decode.batch.pos[i] for i in range(3)] == [held + 1, held + 2, held + 3]
    assert decode.decode(pad=-1)[:2] == (0, 3)
    assert llama_cpp.llama_memory_seq_pos_max(decode.memory, lone.seq_id) == held + 3
    decode.drop_after(lone)  # the sampler kept none of the guess: the sequence holds its own tokens only
    assert llama_cpp.llama_memory_seq_pos_max(decode.memory, lone.seq_id) == lone.n_past - 1 == held + 1
    decode.leave(lone)
    assert not decode.streams.busy and all(empty_stream(decode, s) for s in range(SEQS))


def empty_stream(decode, stream: int) -> bool:
    import llama_cpp

    return llama_cpp.llama_memory_seq_pos_max(decode.memory, stream) == -1


def model_shape(decode):
    import llama_cpp

    from syshax_llamacpp.codec import shape_of

    return shape_of(llama_cpp.llama_get_model(decode.ctx))


def test_the_sampler_owns_each_chain_and_names_a_dead_end(prompt_ctx):
    from syshax_llamacpp.sampling import RowSampler, dead_end
    from syshaxd.sdk.output import SequenceOutput

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(prompt_ctx.ctx))
    sampler = RowSampler(prompt_ctx.n_vocab, vocab)
    seq = seq_of(tokens(20, prompt_ctx.n_vocab))
    sampler.start(seq)
    assert seq.sampler is not None
    assert prompt_ctx.decode(seq.prompt, 0) == 0
    logits = prompt_ctx.logits(19).copy()
    token, lp = sampler.sample(seq, prompt_ctx.ctx, 19)
    assert token == int(np.argmax(logits)) and lp is None  # greedy; no logprobs asked for
    again = seq_of(seq.prompt)
    sampler.start(again)
    assert sampler.sample_saved(again, logits)[0] == token  # the same token from saved logits
    for s in (seq, again):
        sampler.free(s)
        assert s.sampler is None
    prompt_ctx.clear()
    grammar = seq_of([1, 2])
    grammar.request = GenerateRequest(request_id="g", max_tokens=8, prompt_tokens=(1, 2), grammar='root ::= "x"',
                                      grammar_field="response_format")
    refused = dead_end(grammar)
    assert isinstance(refused, Rejected) and refused.param == "response_format" and "no first token" in refused.message
    grammar.out = SequenceOutput(stop=(), ignore_eos=True, max_tokens=8, is_eog=lambda t: False,
                                 piece_bytes=lambda t: b"x")
    grammar.out.token(5)
    assert "after 1 tokens" in dead_end(grammar)


def test_the_prefix_side_starts_a_prompt_from_its_checkpoint_and_drops_blocks_it_deferred(model, prompt_ctx):
    from syshax_llamacpp.prefix_side import PrefixSide
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf

    spec, loaded = model
    spec = dataclasses.replace(spec, state_checkpoints_mb=64)
    side = PrefixSide(spec, prompt_ctx, fingerprint_from_gguf(loaded.path), arch=loaded.arch, shape=loaded.state,
                      sliding_window=loaded.sliding_window, decodes=True)
    assert side.store is None and side.checkpoints is not None
    empty = prompt_ctx.export().nbytes
    first = seq_of(tokens(2 * CHUNK, prompt_ctx.n_vocab, seed=5))
    assert prompt_ctx.decode(first.prompt[:CHUNK], 0, "none") == 0
    assert prompt_ctx.decode(first.prompt[CHUNK:], CHUNK) == 0
    side.keep_checkpoint(first, prompt_ctx.export())
    prompt_ctx.clear()
    longer = seq_of(first.prompt + [42, 43])
    side.look_up(longer)
    assert longer.checkpoint is not None and longer.hit_tokens == 2 * CHUNK  # on the chunk grid: not yet proved
    longer.pending.extend(longer.prompt)
    assert side.start(longer) is None
    assert longer.n_past == 2 * CHUNK and list(longer.pending) == [42, 43] and longer.checkpoint is None
    assert side.counters["cached_tokens"] == 2 * CHUNK
    assert side.start(longer) is None and longer.n_past == 2 * CHUNK  # its start is taken once
    assert prompt_ctx.export().nbytes > empty
    side.defer(longer, prompt_ctx.export(), None)
    side.forget(first)  # another sequence's end leaves the deferred blocks, and the prompt context holding them
    assert side.unkept is not None and prompt_ctx.export().nbytes > empty
    side.forget(longer)  # its own end drops them, and empties the prompt context
    assert side.unkept is None and prompt_ctx.export().nbytes == empty
    assert prompt_ctx.decode(first.prompt[:CHUNK], 0) == 0
    side.defer(first, prompt_ctx.export(), None)
    assert side.keep_deferred() == [] and side.unkept is None  # no plan to write (no store): the context is freed
    assert prompt_ctx.export().nbytes == empty
    broken = seq_of(first.prompt + [44])
    side.look_up(broken)
    broken.checkpoint = dataclasses.replace(broken.checkpoint, state=np.zeros(64, np.uint8))  # not a state
    broken.pending.extend(broken.prompt)
    assert side.start(broken) is None and broken.n_past == 0 and broken.hit_tokens == 0  # the whole prompt runs
    assert len(broken.pending) == len(broken.prompt) and prompt_ctx.export().nbytes == empty


def test_the_handoff_writes_a_record_reads_it_back_and_recomputes_what_it_cannot_read(model, prompt_ctx, decode,
                                                                                    ring):
    from syshax_llamacpp.handoff import Handoff, KVPort

    spec, loaded = model
    port = KVPort(_instance(ring), str(loaded.path), n_stream=SEQS, timeout=1.0, whole_state=loaded.whole_state,
                  shape=loaded.state)
    handoff = Handoff(port, prompt_ctx, decode)
    prompt = tokens(30, prompt_ctx.n_vocab, seed=9)
    producer = seq_of(prompt, decodes_here=False, handoff=True)
    assert prompt_ctx.decode(prompt, 0) == 0
    event = handoff.hand_on(producer, 77, None)
    assert isinstance(event, Prefilled) and event.handle is not None and event.handle.first_token == 77
    assert prompt_ctx.export().nbytes < 100  # the prompt context is cleared for the next prompt
    consumer = seq_of(prompt, kv=event.handle)
    consumer.enter(SlotState.PROMPT)
    imported, took = handoff.take_kv(consumer)
    assert took and imported.ok and consumer.state is SlotState.DECODING and consumer.n_past == len(prompt)
    assert consumer.seq_id in decode.streams.busy
    decode.leave(consumer)
    other = seq_of(prompt[:-1] + [prompt[-1] + 1], kv=event.handle)  # another prompt: the record is not its own
    other.enter(SlotState.PROMPT)
    imported, took = handoff.take_kv(other)
    assert not took and imported.reason == Fallback.TOKEN_MISMATCH and list(other.pending) == other.prompt
    assert not decode.streams.busy and other.seq_id == -1  # the stream it tried is given back
    imported, took = Handoff(None, prompt_ctx, decode).take_kv(seq_of(prompt, kv=event.handle))
    assert not took and imported.reason == Fallback.NO_RING and not decode.streams.busy
    assert prompt_ctx.decode(prompt, 0) == 0
    unwritten = Handoff(None, prompt_ctx, decode).hand_on(seq_of(prompt, decodes_here=False, handoff=True), 77, None)
    assert unwritten.handle is None and unwritten.reason == Fallback.EXPORT_FAILED  # the decoder recomputes
    assert prompt_ctx.export().nbytes < 100
    handoff.close()


def test_a_cancelled_sequence_s_record_is_reported_not_read(prompt_ctx):
    from syshax_llamacpp.handoff import Handoff

    handle = KVHandle(0, 0, 0, 0, 3, 1, 0.0)
    handoff = Handoff(None, prompt_ctx, None)
    waiting = seq_of([1, 2, 3], "w", kv=handle)
    assert handoff.not_read(waiting) == [Imported("w", False, reason=Fallback.CANCELLED)]
    assert handoff.not_read(seq_of([1, 2, 3], "x")) == []


def test_the_warm_up_proves_and_leaves_both_contexts_empty(model, decode, caplog):
    from syshax_llamacpp.contexts import prompt_params
    from syshax_llamacpp.proofs import WarmUp
    from syshax_llamacpp.prompt_context import PromptContext

    spec, loaded = model
    chunk = 128  # room for the chunking proof: a prompt chunk of at least twice its 64 tokens
    spec = dataclasses.replace(spec, prefill_chunk_size=chunk, keep_generated=True)
    prompt = PromptContext(loaded.model, prompt_params(spec, N_CTX, chunk, 1), chunk, decode.n_vocab)
    empty = prompt.export().nbytes

    def warm(spec: EngineSpec, prefix_cache: bool = True):
        return WarmUp(spec, prompt, decode, seq_ctx=N_CTX, shape=loaded.state, weight_types=("Q4_0",),
                      tiled_attention=False, prefix_cache=prefix_cache, speculative_tokens=0).run()

    try:
        with caplog.at_level("INFO", logger="syshax_llamacpp.engine"):
            proved = warm(spec)
        # llama.cpp's own attention: a decode step is not proved to give a prompt chunk's bits, so nothing generated
        # is kept; whether a hit may resume inside a chunk is proved on this CPU, and the log says which way
        assert (proved.exact_decode, proved.keeps_generated, proved.step_cost) == (False, False, None)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefix cache: a 128-token")]
        assert len(said) == 1 and ("same bits" in said[0]) == (proved.exact_resume == 64), said
        assert proved.pad_lone  # a 128-token warm-up cannot prove that a lone row past 256 tokens needs no padding row
        assert len(proved.warm_tokens) == chunk
        assert prompt.export().nbytes == empty and all(empty_stream(decode, s) for s in range(SEQS))
        # kernels whose chunk's bits depend on where it starts: hits resume only at whole chunks
        assert warm(dataclasses.replace(spec, fault="chunking")).exact_resume == 0
        # a restart's warm-up keeps what the worker's first one proved and runs no proof again: the fault would fail it
        proven = dataclasses.replace(spec, fault="chunking",
                                     proven=Proofs(exact_decode=True, exact_resume=1, pad_lone=False))
        again = warm(proven, prefix_cache=False)
        assert (again.exact_decode, again.exact_resume, again.pad_lone, again.keeps_generated) == (True, 1, False,
                                                                                                   False)
        assert prompt.export().nbytes == empty and all(empty_stream(decode, s) for s in range(SEQS))
    finally:
        prompt.close()


def test_the_stepper_gives_back_every_slot_and_stream_it_took(default_model):
    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.sdk.types import Delta

    eng = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(default_model),
                                    model_name="m", n_ctx=N_CTX, max_batch_size=2, threads=1,
                                    prefill_chunk_size=CHUNK))
    try:
        eng.warm_up()
        events: list = []
        for rid, n in (("a", 6), ("b", 1), ("c", 6), ("d", 6)):
            events += eng.submit(GenerateRequest(request_id=rid, max_tokens=n, sampling=SamplingParams(temperature=0),
                                                 prompt=f"Count from one to ten, request {rid}:"))
        assert eng.slots.free_slots == 2 and len(eng.slots.waiting) == 4  # seated at the next step
        assert eng.cancel("d") == [] and len(eng.slots.waiting) == 3  # a queued one leaves the queue
        events += eng.step()  # a and b seated; a's prompt runs: a decodes
        assert eng.slots.free_slots == 0 and eng.slots.active["a"].state is SlotState.DECODING
        assert eng.cancel("a") == [] and eng.cancel("a") == []  # an active one is released, once
        assert eng.slots.free_slots == 1 and not eng.decode.streams.busy
        while eng.has_work():
            events += eng.step()
        finished = {e.request_id: e.finish_reason for e in events if isinstance(e, Delta) and e.finish_reason}
        assert finished == {"b": "length", "c": "length"}  # b's first token its last, c seated in a's slot
        assert eng.slots.free_slots == 2 and not eng.slots.active and not eng.slots.waiting
        assert not eng.decode.streams.busy and all(empty_stream(eng.decode, s) for s in range(2))
        stats = eng.stats()
        assert (stats.finished, stats.running, stats.waiting, stats.free_slots) == (2, 0, 0, 2)
        assert stats.generated_tokens == sum(e.n_tokens for e in events if isinstance(e, Delta)) == 1 + 1 + 6
    finally:
        eng.close()
