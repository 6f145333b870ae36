"""The llama.cpp engine's owners that need no model: a sequence's states and their transitions, the slot table, and
the guesser's choice of guesses and its bookkeeping (test_engine_owners.py has the owners over llama.cpp)."""

from __future__ import annotations

import uuid

import pytest

from syshax_llamacpp.sequence import Sequence, SlotState
from syshax_llamacpp.slots import SlotTable
from syshaxd.sdk.types import GenerateRequest, Handling, SamplingParams


def seq_of(prompt: list[int], rid: str = "", decodes_here: bool = True) -> Sequence:
    request = GenerateRequest(request_id=rid or uuid.uuid4().hex[:8], max_tokens=8,
                              sampling=SamplingParams(temperature=0), prompt_tokens=tuple(prompt))
    return Sequence(request=request, prompt=list(prompt), max_tokens=8, decodes_here=decodes_here,
                    handling=Handling())


def test_a_sequence_moves_only_as_its_transitions_allow():
    seq = seq_of([1, 2, 3])
    assert seq.state is SlotState.QUEUED
    with pytest.raises(RuntimeError, match="from queued to decoding"):
        seq.enter(SlotState.DECODING)  # a sequence decodes only after its prompt (or its KV record)
    seq.enter(SlotState.PROMPT)
    seq.enter(SlotState.DECODING)
    with pytest.raises(RuntimeError, match="from decoding to prompt"):
        seq.enter(SlotState.PROMPT)
    seq.enter(SlotState.DONE)
    with pytest.raises(RuntimeError, match="from done to"):
        seq.enter(SlotState.DONE)


def test_the_slot_table_seats_the_oldest_first_and_frees_a_slot_once():
    slots = SlotTable(2)
    a, b, c = seq_of([1], "a"), seq_of([2], "b"), seq_of([3], "c")
    for seq in (a, b, c):
        slots.queue(seq)
    assert slots.has_work() and slots.free_slots == 2
    assert slots.seat_next() is a and slots.seat_next() is b and slots.free_slots == 0
    assert a.state is b.state is SlotState.PROMPT and c.state is SlotState.QUEUED
    handed_on = slots.start_unseated(seq_of([4], "d", decodes_here=False))  # a prompt only handed on takes no slot
    assert slots.free_slots == 0 and set(slots.active) == {"a", "b", "d"}
    assert slots.seat_next() is None  # c waits: no slot is free
    assert slots.leave(a) and not slots.leave(a)  # its slot is freed once, however often it is released
    assert slots.free_slots == 1 and a.state is SlotState.DONE
    assert slots.leave(handed_on) and slots.free_slots == 1
    assert slots.seat_next() is c and slots.free_slots == 0 and slots.seat_next() is None
    e = seq_of([5], "e")
    slots.queue(e)
    assert slots.unqueue("e") is e and e.state is SlotState.DONE and not slots.waiting
    assert slots.unqueue("e") is None
    with pytest.raises(RuntimeError, match="waits for a slot"):
        slots.start_unseated(seq_of([6], "f"))  # one that decodes here never starts without a slot
    b.pending.extend([7, 8])
    c.next_token, c.seq_id = 9, 0
    assert slots.next_prompt() is b and slots.decoding() == [c]



def test_the_guesser_guesses_for_a_lone_sequence_once_its_rows_are_proved():
    from syshax_llamacpp.drafting import StepCost
    from syshax_llamacpp.guessing import Guesser
    from syshaxd.sdk.output import SequenceOutput

    guesser = Guesser(4, None, n_vocab=1000, n_ctx=512, guess_always=False)
    repeated = [10, 11, 12, 13, 14, 15] * 3

    def decoding(rid: str) -> Sequence:
        seq = seq_of(repeated, rid)
        seq.out = SequenceOutput(stop=(), ignore_eos=True, max_tokens=64, is_eog=lambda t: False,
                                 piece_bytes=lambda t: b"x")
        seq.next_token, seq.n_past = 10, len(repeated)
        return seq

    lone = decoding("lone")
    assert guesser.guesses([lone]) == [[]] and not guesser.speculating  # not proved: no guess
    cost = StepCost()
    for rows in range(1, 6):
        cost.add(rows, 0.010 + 0.001 * rows)  # a guessed row costs a tenth of a step: guesses pay
    guesser.proved(cost, [])
    assert guesser.speculating
    guess = guesser.guesses([lone])[0]
    assert guess and guess == [11, 12, 13, 14][:len(guess)]  # what followed the same tokens before
    assert guesser.guesses([decoding("a"), decoding("b")]) == [[], []]  # beside another sequence, none
    guesser.checked(lone, guess, 1)
    assert guesser.counters["guessed_tokens"] == len(guess) and guesser.counters["kept_guesses"] == 1
    guesser.timed(1, 3, 0.5)
    assert cost.seconds[3] == pytest.approx(0.8 * 0.013 + 0.2 * 0.5)
    guesser.timed(2, 3, 5.0)  # two sequences' step says nothing of a lone one's cost
    assert cost.seconds[3] == pytest.approx(0.8 * 0.013 + 0.2 * 0.5)
    # a lookup not checked (none paid) is watched as the tokens come, and counted when it ends
    lone.drafted, lone.acceptance.watching, lone.acceptance.came = False, [20, 21], 0
    checked = lone.acceptance.checked
    guesser.sampled(lone, guess, 20)  # a step that checked a guess: its rows count, not the watched lookup
    assert lone.acceptance.came == 0
    guesser.sampled(lone, [], 20)
    assert lone.acceptance.came == 1
    guesser.sampled(lone, [], 99)  # not the watched guess's next: it ends, 1 of 2 kept
    assert lone.acceptance.watching == [] and lone.acceptance.checked > checked
