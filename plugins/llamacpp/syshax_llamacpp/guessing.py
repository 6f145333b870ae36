"""Speculative decoding in the engine: which guessed tokens a decode step checks, and what came of them.

drafting.py says how a guess is made and weighed (prompt lookup, a draft model, a step's cost by its rows); the
Guesser owns what the engine learns as it serves (the step costs, the match rates, the draft model) and decides,
each step, how many guessed tokens a lone sequence's rows carry. The decode batch feeds them, the sampler checks
them, and the Guesser hears how many were kept.
"""

from __future__ import annotations

import logging

from syshax_llamacpp import drafting
from syshax_llamacpp.draft_model import DraftModel
from syshax_llamacpp.sequence import Sequence

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")


class Guesser:
    """speculative_tokens: the most guessed tokens a step checks for a sequence (0: speculation off). guess_always:
    the tests' every guess of every sequence, checked (SYSHAX_GUESS=always)."""

    def __init__(self, speculative_tokens: int, draft: DraftModel | None, *, n_vocab: int, n_ctx: int,
                 guess_always: bool) -> None:
        self.speculative_tokens = speculative_tokens
        self.draft = draft  # guesses from a draft model rather than the sequence's own context (config draft_model)
        self.n_vocab, self.n_ctx = n_vocab, n_ctx
        self.guess_always = guess_always
        # a lone sequence's decode step time by its rows, learnt as steps run: whether a guess pays; None while
        # speculation is off (set at the warm-up, once it proved that rows give a lone row's bits)
        self.step_cost: drafting.StepCost | None = None
        self.match_rates = drafting.MatchRates()  # ... and how sure a guess is by the match it follows
        self.counters = {"guessed_tokens": 0, "kept_guesses": 0, "drafted_tokens": 0, "kept_drafts": 0}

    @property
    def speculating(self) -> bool:
        return self.step_cost is not None

    def proved(self, step_cost: drafting.StepCost | None, warm_tokens: list[int]) -> None:
        """The warm-up's proof of guessed rows (None: speculation off) and first costs. The draft model takes its own
        first costs from the warm-up's tokens, or is unloaded where no guess will be checked."""
        self.step_cost = step_cost
        if self.draft is None:
            return
        if step_cost is not None:
            self.draft.guess([t for t in warm_tokens if t < self.draft.n_vocab], 4, self.n_vocab)
            log.info("draft model %s: a drafted token takes %.1f ms here", self.draft.name,
                     1000 * (self.draft.seconds or 0.0))
        else:  # no guesses here: its weights and KV would only take memory
            log.info("draft model %s unloaded: speculative decoding is off", self.draft.name)
            self.close()

    def timed(self, n_sequences: int, rows: int, seconds: float) -> None:
        """A decode step ran: a lone sequence's step says what a guess costs."""
        if self.step_cost is not None and n_sequences == 1:
            self.step_cost.add(rows, seconds)

    def guesses(self, decoding: list[Sequence]) -> list[list[int]]:
        """The decoding sequences' guessed next tokens (drafting.py): a lone sequence's, as many as are expected to
        pay this step, from its own context (prompt lookup) or from the draft model, whichever is expected to give
        more tokens a second; none where speculation is off (speculative_tokens = 0, or a build whose rows may not
        give a lone row's bits) or the request has a grammar. Beside other sequences none: llama.cpp takes a step's
        rows in ubatches of equally many rows of every sequence, so a guess splits the step (the tests'
        SYSHAX_GUESS=always checks every guess of every sequence all the same, the draft's where its lookup has none;
        bench_speculation.py --always says the cost)."""
        none: list[list[int]] = [[] for _ in decoding]
        if self.step_cost is None or not decoding or (len(decoding) > 1 and not self.guess_always):
            return none
        guesses: list[list[int]] = []
        for seq in decoding:
            seq.drafted = False
            if seq.request.grammar:
                guesses.append([])
                continue
            assert seq.next_token is not None and seq.out is not None
            if seq.lookup is None:
                seq.lookup = drafting.PromptLookup(seq.prompt + seq.fed)
            seq.lookup.extend(seq.fed[len(seq.lookup.tokens) - len(seq.prompt):] + [seq.next_token])
            room = min(self.speculative_tokens, seq.max_tokens - seq.out.n_generated - 1, self.n_ctx - seq.n_past - 2)
            looked = seq.lookup.guess(room)
            draft = self.draft if len(decoding) == 1 else None  # its context holds one sequence
            if self.guess_always:
                n, drafts = len(looked), (room if draft is not None and not looked else 0)
            else:
                chances = self.match_rates.chances(seq.lookup.match, len(looked), seq.acceptance.rate)
                n, rate = drafting.best_guess(chances, len(looked), self.step_cost)
                drafts, drafted_rate = (drafting.best_guess(seq.drafts.rate, room, self.step_cost, draft.seconds)
                                        if draft is not None and draft.seconds is not None else (0, 0.0))
                if drafts and drafted_rate > rate:
                    n = 0
                else:
                    drafts = 0
                    if draft is not None:  # its rate drifts back to its prior, so that a draft refused early is tried
                        seq.drafts.drift()  # again later
            if n:
                seq.acceptance.watching = []  # counted as checked instead
            else:
                seq.acceptance.watch(looked)  # a lookup not checked (the draft's taken instead, or none paid)
            if drafts and draft is not None:
                seq.drafted = True
                guesses.append(draft.guess(seq.prompt + seq.fed + [seq.next_token], drafts, self.n_vocab))
            else:
                guesses.append(looked[:n])
        return guesses

    def sampled(self, seq: Sequence, guess: list[int], token: int) -> None:
        """A token of seq was sampled from its rows: a lookup not checked this step watches it come."""
        if not guess or seq.drafted:
            seq.acceptance.token(token)

    def checked(self, seq: Sequence, guess: list[int], kept: int) -> None:
        """seq's guess was checked: `kept` of its tokens, from the first on, were sampled as guessed."""
        (seq.drafts if seq.drafted else seq.acceptance).add(len(guess), kept)
        if seq.drafted:
            self.counters["drafted_tokens"] += len(guess)
            self.counters["kept_drafts"] += kept
        elif seq.lookup is not None:
            self.match_rates.add(seq.lookup.match, len(guess), kept)
        self.counters["guessed_tokens"] += len(guess)
        self.counters["kept_guesses"] += kept

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None
