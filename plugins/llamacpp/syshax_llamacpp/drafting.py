"""Speculative decoding's guesses and whether they pay: prompt lookup, and a lone sequence's step cost by its rows.

A decoding sequence's next tokens are often in its own context already: a summary quotes its source, an edit
repeats the code around it, an answer names the question's words. PromptLookup guesses them (llama-server's
`--spec-type ngram-simple`, vLLM's `[ngram]`): the tokens that followed the latest earlier occurrence of the
sequence's last few tokens. The step then checks the guess in the same llama_decode (stepping.py): a row per
guessed token, each sampled in order with the sequence's own sampler chain, and kept while the sampled token is
the guessed one. The sampler draws each token from the very distribution, with the very random numbers, it would
have without the guess, so a request's text is the one it gets without speculation (greedy or seeded), where the
rows give a token the bits a lone decode row gives it (the warm-up proves it: proofs.WarmUp._proves_guessed_rows).

A guessed row costs time whether it is kept or not, and that cost depends on the machine and the model (on 2
cores, with llama.cpp patches 0008 to 0011, a second row 0.29 of a step with the 135M model, 0.48 with a
1.5B shape before 0010; bench/bench_verify_rows.py [--model]). So a lone sequence takes as many guessed tokens as
are expected to pay (best_guess): what they return, by their chances (each the mean of the sequence's share of
guesses kept so far, Acceptance, and the engine's share kept after a context match as long, MatchRates), against
what its steps are measured to cost by their rows (StepCost). A draft model (draft_model.py) is weighed the same
way, its own step counted, against the lookup's guess.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

# guesses follow a match of the sequence's last NGRAM_MAX down to NGRAM_MIN tokens, longest first: a one-token
# match is too often a common word whose next token differs
NGRAM_MAX = 4
NGRAM_MIN = 2
# a match is followed back this far (MatchRates): past 16 tokens of agreement a copy is as sure as it gets
MATCH_CAP = 16


class PromptLookup:
    """One sequence's tokens (prompt and generated) indexed by the n-grams that end at each position."""

    def __init__(self, tokens: Tokens[int]) -> None:
        self.tokens: list[int] = list(tokens)
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self._indexed = 0  # n-grams ending at positions up to this one are in _after
        # the last guess's match: how many tokens before it agree with those before its source, up to MATCH_CAP
        self.match = 0

    def extend(self, tokens: Tokens[int]) -> None:
        self.tokens += tokens

    def guess(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last NGRAM_MAX..NGRAM_MIN tokens
        (the longest that occurred before); [] when none did."""
        end = len(self.tokens)
        self.match = 0
        if limit <= 0 or end < NGRAM_MIN + 1:
            return []
        self._index(end - 1)  # every earlier end, not the current one: a match must start before it
        tokens = self.tokens
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            after = self._after.get(tuple(tokens[end - n:end]))
            if after is not None:
                match = n  # followed back past the n-gram: a longer agreement is a surer copy
                while match < MATCH_CAP and match < after and tokens[after - 1 - match] == tokens[end - 1 - match]:
                    match += 1
                self.match = match
                return tokens[after:min(after + limit, end)]
        return []

    def _index(self, upto: int) -> None:
        tokens, after = self.tokens, self._after
        for e in range(max(self._indexed + 1, NGRAM_MIN), upto + 1):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, e) + 1):
                after[tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, upto)


@dataclass
class Acceptance:
    """How often a sequence's guessed tokens were kept, recent guesses weighing more (a quote ends, a list
    begins): kept / checked, both decayed at every guess counted. A guess not worth its rows is still counted:
    watched against the tokens that come, free, so that a sequence that starts to copy is seen to."""

    kept: float = 1.0
    checked: float = 2.0
    watching: list[int] = field(default_factory=list)  # a guess not checked, compared with the tokens as they come
    came: int = 0  # ... of it, those that came as guessed so far
    DECAY = 0.7

    @property
    def rate(self) -> float:
        return self.kept / self.checked

    def add(self, guessed: int, kept: int) -> None:
        """A guess of `guessed` tokens whose first `kept` were right: kept successes and, if one was wrong, a
        failure (the tokens after a wrong one say nothing)."""
        self.kept = self.kept * self.DECAY + kept
        self.checked = self.checked * self.DECAY + kept + (1 if kept < guessed else 0)

    def drift(self, share: float = 0.02) -> None:
        """A step without a guess of this kind checked: move `share` of the way back to the prior rate (1 of 2),
        so that a kind of guess refused early is tried again once the prior says it may pay."""
        self.kept += (1.0 - self.kept) * share
        self.checked += (2.0 - self.checked) * share

    def watch(self, guess: list[int]) -> None:
        """A guess this step did not check: count it as the tokens come (unless one is being watched)."""
        if not self.watching and guess:
            self.watching, self.came = list(guess), 0

    def token(self, token: int) -> None:
        """A token sampled without a guess's row: the watched guess's next, or its end."""
        if not self.watching:
            return
        if token == self.watching[self.came]:
            self.came += 1
            if self.came < len(self.watching):
                return
        self.add(len(self.watching), self.came)
        self.watching = []


class MatchRates:
    """How often a guessed token was kept, by the length of the match it followed (the lookup's n-gram followed
    back, PromptLookup.match, and the guessed tokens before it), over every sequence of the engine: after 2 tokens
    of agreement about half are kept, after 16 nearly all (bench_speculation.py's loads). Each count starts at 1 of
    2."""

    def __init__(self) -> None:
        self.kept = [1.0] * (MATCH_CAP + 1)
        self.checked = [2.0] * (MATCH_CAP + 1)

    def add(self, match: int, guessed: int, kept: int) -> None:
        """A guess of `guessed` tokens after a match of `match` tokens whose first `kept` were right (the tokens
        after a wrong one say nothing)."""
        for j in range(min(guessed, kept + 1)):
            m = min(match + j, MATCH_CAP)
            self.checked[m] += 1
            self.kept[m] += j < kept

    def chances(self, match: int, n: int, rate: float) -> list[float]:
        """The chance of each of n guessed tokens after a match of `match` tokens to be kept, the ones before it
        kept: the mean of the engine's rate after its match and the sequence's own `rate` (Acceptance: whether it
        is copying now)."""
        return [(self.kept[m] / self.checked[m] + rate) / 2
                for m in (min(match + j, MATCH_CAP) for j in range(n))]


class StepCost:
    """A lone sequence's decode step time by its rows, learnt from the steps that run (a moving average per row
    count; the warm-up times every count from 1 row to 1 + speculative_tokens; a count not timed is read off a line
    through its nearest timed neighbours)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def add(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows; None outside the row counts timed."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None or above is None:
            return None
        t0, t1 = self.seconds[below], self.seconds[above]
        return t0 + (t1 - t0) * (rows - below) / (above - below)


def best_guess(rate: float | Tokens[float], most: int, cost: StepCost,
               draft_seconds: float = 0.0) -> tuple[int, float]:
    """The count of a lone sequence's `most` guessed tokens to check this step that gives the most expected tokens
    per second, and that rate. `rate`: the chance of a guessed token to be kept where every one before it was, the
    same for all (the j-th then returns rate**j tokens on average) or one per token (MatchRates.chances). Each
    costs a row, whose time StepCost says, and, from a draft model, `draft_seconds` of the draft's own step; 0 where
    no guess pays, and 0 tokens per second where nothing was timed."""
    base = cost(1)
    if base is None:
        return 0, 0.0
    tokens, best, best_n, kept = 1.0, 1 / base, 0, 1.0
    for n in range(1, most + 1):
        kept *= rate if isinstance(rate, (int, float)) else rate[n - 1]
        tokens += kept
        seconds = cost(1 + n)
        if seconds is not None:
            seconds += n * draft_seconds
        if seconds is not None and tokens / seconds > best:
            best, best_n = tokens / seconds, n
    return best_n, best
