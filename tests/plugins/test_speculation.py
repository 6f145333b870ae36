"""Speculative decoding (plugins/llamacpp/syshax_llamacpp/drafting.py): a guess never changes a text.

A daemon that checks every guess it has (SYSHAX_GUESS=always: on any machine, paying or not) against one that
guesses nothing, on long answers, several at once:
* greedy chats (tests/greedy.py's) and copy-heavy requests (a quote, an edit of code) give the same texts, and
  the guesses were really checked, most kept on the copies and some refused;
* seeded sampled requests give the same texts (the sampler draws each token with the very random numbers it
  would draw without a guess), with penalties in the chain too, and the same logprobs;
* a warm-up whose proof of the guessed rows fails (SYSHAX_FAULT=guesses) turns speculation off and says so.
The guesses themselves and the choice of those that pay are checked on their own below.
"""

from __future__ import annotations

import concurrent.futures
import json
import platform
import subprocess
import sys

import pytest

from conftest import MODEL_NAME, start_daemon
from syshaxd.benchmark.copying import copy_chats
from greedy import CHATS, answer_all, assert_same, client_of, worker

from syshax_llamacpp import drafting

pytestmark = pytest.mark.slow

BASE = {"model_name": MODEL_NAME, "n_ctx": 2048}

COPIES = copy_chats()[:4]  # repeat a text, quote one, fix code and give it whole, summarise quoting


@pytest.fixture(scope="module")
def guessing(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("guessing"), {"model": str(default_model), **BASE,
                                                            "speculative_tokens": 8},
                     env={"SYSHAX_GUESS": "always"})
    off_here = worker(d, "cpu0")["speculative_tokens"] == 0 and platform.machine() not in ("x86_64", "AMD64")
    if off_here:  # ARM (make test-arm): the patch series proves decode steps exact on x86 only; on x86 this fails
        why = "; ".join(d.status()["exact"]["why"]) or "its decode steps were not proved to give a prompt chunk's bits"
        d.stop()
        pytest.skip(f"speculation is off on this {platform.machine()} CPU, as its status says: {why}")
    yield d
    assert d.stop() == 0, d.log()


def guesses(daemon) -> tuple[int, int]:
    stats = worker(daemon, "cpu0")["stats"]
    return stats["guessed_tokens"], stats["kept_guesses"]


def test_the_warm_up_proves_the_guessed_rows(guessing, plain):  # guessing first: where it skips, plain never starts
    assert worker(guessing, "cpu0")["speculative_tokens"] == 8
    assert worker(plain, "cpu0")["speculative_tokens"] == 0
    assert "guessed tokens a step, checked in rows that give a lone row's bits" in guessing.log()


def test_greedy_chats_keep_their_text(guessing, plain):
    before = guesses(guessing)
    assert_same(answer_all(guessing), answer_all(plain), "guessing against not")
    guessed, kept = (a - b for a, b in zip(guesses(guessing), before))
    assert guessed > 0 and kept < guessed, (guessed, kept)  # checked, and some refused: their KV dropped


def test_copies_keep_their_text_and_most_guesses(plain, guessing):
    before = guesses(guessing)
    got, want = answer_all(guessing, chats=COPIES), answer_all(plain, chats=COPIES)
    assert_same(got, want, "copies, guessing against not")
    guessed, kept = (a - b for a, b in zip(guesses(guessing), before))
    assert kept > guessed / 3 and kept > 100, (guessed, kept)


def sampled(daemon, messages, seed: int, extra: dict) -> tuple[str, list]:
    out = client_of(daemon).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=96, temperature=0.8, top_p=0.95, seed=seed, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True} | extra)
    lps = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in out.choices[0].logprobs.content]
    return out.choices[0].message.content, lps


def test_a_step_of_several_tokens_streams_as_one_chunk_with_every_token_counted(guessing):
    """The real path of a multi-token Delta (tests/api/test_multi_token_delta.py feeds one by hand): streamed chunks carry
    several tokens' text and logprob entries, and usage counts every token once."""
    chunks = list(client_of(guessing).chat.completions.create(
        model=MODEL_NAME, messages=COPIES[0], max_tokens=96, temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    entries = [len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(entries) == chunks[-1].usage.completion_tokens == 96
    assert max(entries) > 1, entries  # guesses kept: a step gave several tokens
    whole = client_of(guessing).chat.completions.create(model=MODEL_NAME, messages=COPIES[0], max_tokens=96,
                                                        temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.3}


def test_seeded_samples_keep_their_text_and_logprobs(plain, guessing):
    """With and without penalties (the chain's own state, which must see exactly the tokens kept)."""
    cases = [(COPIES[0], 1, {}), (COPIES[2], 2, {}), (CHATS[1], 1, {}),
             (COPIES[0], 3, PENALTIES), (COPIES[2], 4, PENALTIES), (CHATS[1], 2, PENALTIES)]
    before = guesses(guessing)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: sampled(guessing, *c), cases))
        want = list(pool.map(lambda c: sampled(plain, *c), cases))
    for (messages, seed, extra), g, w in zip(cases, got, want):
        assert g[0] == w[0], (f"seed {seed} {extra}, {messages[-1]['content'][:40]!r}:\ngot      {g[0]!r}\n"
                              f"expected {w[0]!r}")
        assert g[1] == w[1]
    guessed, kept = (a - b for a, b in zip(guesses(guessing), before))
    assert kept > 0, (guessed, kept)
    assert len({g[0] for g in got}) == len(got)  # sampled: each seed and prompt its own text


def test_a_failed_proof_turns_speculation_off(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), **BASE, "speculative_tokens": 8},
                     env={"SYSHAX_FAULT": "guesses", "SYSHAX_GUESS": "always"})
    try:
        assert worker(d, "cpu0")["speculative_tokens"] == 0
        assert "speculative decoding off" in d.log()
        answer_all(d, chats=COPIES[:1])
        assert guesses(d) == (0, 0)
    finally:
        assert d.stop() == 0, d.log()


# --- the guesses, and which pay ------------------------------------------------------------------------------------

def test_a_guess_is_what_followed_the_latest_earlier_occurrence():
    lookup = drafting.PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert lookup.guess(2) == [4, 5]  # [1 2 3] occurred at the start (the longest match, before the later [2 3])
    lookup.extend([7])
    assert lookup.guess(5) == [8, 1, 2, 3, 7]  # [2 3 7] at 6..8, then on to the end (it may run into the present)
    lookup.extend([6, 6])
    assert lookup.guess(4) == []  # [7 6 6], [6 6]: never seen before
    assert drafting.PromptLookup([5, 5, 5, 5]).guess(3) == [5]  # [5 5 5] ended at 3: only one token after it


def test_a_longer_match_wins_over_a_later_shorter_one():
    # [1 2 3] occurred at the start, followed by 4; [2 3] later, followed by 9
    lookup = drafting.PromptLookup([1, 2, 3, 4, 0, 2, 3, 9, 0, 1, 2, 3])
    assert lookup.guess(1) == [4]


def test_a_guess_knows_how_far_back_its_match_goes():
    # [0 1 2 3] ends the context and occurred at the start, before 4: the 4-gram looked up, and no token before it
    lookup = drafting.PromptLookup([0, 1, 2, 3, 4, 8, 0, 1, 2, 3])
    assert lookup.guess(1) == [4] and lookup.match == 4
    lookup = drafting.PromptLookup([5, 2, 3, 4, 8, 6, 2, 3])
    assert lookup.guess(1) == [4] and lookup.match == 2  # [5 2 3] against [6 2 3]: two
    long = list(range(40))
    lookup = drafting.PromptLookup(long + [99] + long[:30])
    assert lookup.guess(2) == [30, 31] and lookup.match == drafting.MATCH_CAP  # followed back no further
    assert lookup.guess(0) == [] and lookup.match == 0


def test_a_longer_match_makes_a_surer_guess():
    rates = drafting.MatchRates()
    assert rates.chances(2, 3, 0.5) == [0.5, 0.5, 0.5]  # nothing learnt: 1 of 2 everywhere
    for _ in range(50):
        rates.add(2, 4, 0)  # after a 2-token match, the first guessed token wrong: 3 tokens say nothing
        rates.add(12, 8, 8)  # after 12, every one kept (the 8th after a match of 16 and more)
    short, long = rates.chances(2, 2, 0.5), rates.chances(12, 2, 0.5)
    assert short[0] < 0.3 and long[0] > 0.7 and long[1] > 0.7
    assert short[1] == 0.5  # after a match of 3: never checked
    assert rates.chances(12, 1, 0.1)[0] < long[0]  # the sequence's own rate weighs as much
    cheap = drafting.StepCost()
    for rows, seconds in ((1, 0.010), (9, 0.016)):
        cheap.add(rows, seconds)
    assert drafting.best_guess(rates.chances(12, 8, 0.9), 8, cheap)[0] == 8
    assert drafting.best_guess(rates.chances(2, 8, 0.3), 8, cheap)[0] < 8
    # a chance per token: the j-th guessed token is kept with the product of the chances up to it
    assert drafting.best_guess([0.9] * 8, 8, cheap) == drafting.best_guess(0.9, 8, cheap)
    assert drafting.best_guess(1, 8, cheap) == drafting.best_guess([1.0] * 8, 8, cheap)  # a sure copy, as an int
    assert drafting.best_guess([0.9, 0.0, 0.9, 0.9], 4, cheap)[0] == 1


def test_guesses_are_taken_only_where_they_pay():
    cheap, dear = drafting.StepCost(), drafting.StepCost()
    for rows, seconds in ((1, 0.010), (9, 0.012)):  # memory-bound: a row costs little
        cheap.add(rows, seconds)
    for rows, seconds in ((1, 0.010), (9, 0.045)):  # compute-bound: a row costs almost a step
        dear.add(rows, seconds)
    assert drafting.best_guess(0.9, 8, cheap)[0] == 8
    assert drafting.best_guess(0.3, 8, cheap)[0] >= 1  # even a poor guess: its first token is nearly free
    assert drafting.best_guess(0.3, 8, dear)[0] == 0
    assert 1 <= drafting.best_guess(0.95, 8, dear)[0]  # a copy pays even there
    assert drafting.best_guess(0.1, 4, cheap)[0] < drafting.best_guess(0.95, 4, cheap)[0]  # the likelier, the longer
    assert drafting.best_guess(0.9, 8, drafting.StepCost())[0] == 0  # no step timed yet: nothing to go on
    # a draft model's own step counts too: a draft as dear as the model's step never pays, a cheap one does
    assert drafting.best_guess(0.9, 8, cheap, draft_seconds=0.010)[0] == 0
    assert drafting.best_guess(0.9, 8, cheap, draft_seconds=0.0005)[0] == 8
    # the lookup's guess and the draft's are weighed by the tokens a second each is expected to give
    lookup, draft = drafting.best_guess(0.3, 3, cheap), drafting.best_guess(0.9, 8, cheap, 0.0005)
    assert draft[1] > lookup[1] > 1 / 0.010


def test_a_guess_not_checked_is_still_counted_as_the_tokens_come():
    acceptance = drafting.Acceptance()
    before = acceptance.rate
    acceptance.watch([4, 5, 6])
    acceptance.watch([9, 9])  # one at a time: the first is still being watched
    for token in (4, 5, 6):
        acceptance.token(token)
    assert acceptance.rate > before and not acceptance.watching
    high = acceptance.rate
    acceptance.watch([7, 8])
    acceptance.token(7)
    acceptance.token(1)  # wrong: one kept, one refused
    assert acceptance.rate < high and not acceptance.watching


LONE_OR_NOT = """
import json, sys
from syshax_llamacpp.engine import LlamaCppEngine
from syshaxd.sdk.types import Delta, EngineSpec, GenerateRequest, SamplingParams
engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=sys.argv[1], model_name="m",
                                   n_ctx=1024, max_batch_size=4, threads=2, tiled_attention=True,
                                   speculative_tokens=8))
engine.warm_up()
for i, messages in enumerate(json.loads(sys.argv[2])):
    engine.submit(GenerateRequest(request_id=str(i), max_tokens=96, messages=tuple(messages), ignore_eos=True,
                                  sampling=SamplingParams(temperature=0)))
steps = {"alone": 0, "together": 0, "guessed_together": 0, "guessed_alone": 0}
while engine.slots.active or engine.slots.waiting:
    decoding = sum(1 for s in engine.slots.active.values() if s.next_token is not None)
    before = engine.stats().guessed_tokens
    engine.step()
    kind = "alone" if decoding == 1 else "together" if decoding > 1 else None
    if kind:
        steps[kind] += 1
        steps["guessed_" + kind] += engine.stats().guessed_tokens - before
print(json.dumps(steps | {"speculating": engine.guesser.speculating}))
"""


def test_a_guess_is_checked_only_for_a_sequence_decoding_alone(default_model):
    """Beside other sequences a guessed row would split llama.cpp's step: the engine guesses for a lone sequence
    only (two copy-heavy requests, the second's prompt running while the first decodes, then both decoding)."""
    run = subprocess.run([sys.executable, "-c", LONE_OR_NOT, str(default_model), json.dumps(COPIES[:2])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    steps = json.loads(run.stdout.splitlines()[-1])
    assert steps["speculating"] and steps["together"] >= 20 and steps["alone"] >= 1, steps
    assert steps["guessed_together"] == 0, steps
