"""Speculative decoding's guesses and whether they pay: prompt lookup, and a step's cost by its rows.

A decoding sequence's next tokens are often in its own context already: a summary quotes its source, an edit
repeats the code around it, an answer names the question's words. PromptLookup guesses them (llama-server's
`--spec-type ngram-simple`, vLLM's `[ngram]`): the tokens that followed the latest earlier occurrence of the
sequence's last few tokens. The step then checks the guess in the same llama_decode (stepping.py): a row per
guessed token, each sampled in order with the sequence's own sampler chain, and kept while the sampled token is
the guessed one. The sampler draws each token from the very distribution, with the very random numbers, it would
have without the guess, so a request's text is the one it gets without speculation (greedy or seeded), where the
rows give a token the bits a lone decode row gives it (the warm-up's exact_decode).

A guessed row costs a step's time whether it is kept or not, and on a CPU that cost depends on the model and the
machine: on 2 cores with a 135M model a second row costs 0.7 of a step (compute-bound), at 7B on a server almost
nothing (memory-bound). So the guesses a step takes are chosen by what they are expected to return against what
the rows are measured to cost here (Speculation.plan): a step's time for every row count, learnt as steps run,
and each sequence's share of guessed tokens kept so far.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

# guesses follow a match of the sequence's last NGRAM_MAX down to NGRAM_MIN tokens, longest first: a one-token
# match is too often a common word whose next token differs
NGRAM_MAX = 4
NGRAM_MIN = 2


class PromptLookup:
    """One sequence's tokens (prompt and generated) indexed by the n-grams that end at each position."""

    def __init__(self, tokens: Tokens[int]) -> None:
        self.tokens: list[int] = list(tokens)
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self._indexed = 0  # n-grams ending at positions up to this one are in _after

    def extend(self, tokens: Tokens[int]) -> None:
        self.tokens += tokens

    def guess(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last NGRAM_MAX..NGRAM_MIN tokens
        (the longest that occurred before); [] when none did."""
        end = len(self.tokens)
        if limit <= 0 or end < NGRAM_MIN + 1:
            return []
        self._index(end - 1)  # every earlier end, not the current one: a match must start before it
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            after = self._after.get(tuple(self.tokens[end - n:end]))
            if after is not None:
                return self.tokens[after:min(after + limit, end)]
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


class StepCost:
    """A decode step's time by its rows, learnt from the steps that run (a moving average per row count);
    row counts not seen yet are read off a line through their nearest seen neighbours."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def add(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows; None before any step ran."""
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return None
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None:  # fewer rows than any seen: no cheaper than a row less costs... take the least seen
            return self.seconds[above] * rows / above
        if above is None:  # more rows than any seen: each row beyond costs what a row costs on average so far
            first = min(self.seconds)
            per_row = ((self.seconds[below] - self.seconds[first]) / (below - first) if below > first
                       else self.seconds[below] / below)
            return self.seconds[below] + per_row * (rows - below)
        t0, t1 = self.seconds[below], self.seconds[above]
        return t0 + (t1 - t0) * (rows - below) / (above - below)


class StepCosts:
    """A StepCost per number of sequences decoding together. llama.cpp takes a step's rows in ubatches of equally
    many rows of every sequence, so a guess beside sequences that guess less splits the step, and a row costs
    other times alone than beside others (measured: guesses that paid 1.3x for a lone sequence lost 3 to 7 % at
    4 sequences on 2 cores). Where only steps without guesses were timed for a number of sequences, a guessed row
    is taken to cost what a sequence's row costs there, so none is taken: the warm-up times a lone sequence's."""

    def __init__(self) -> None:
        self.by_sequences: dict[int, StepCost] = {}

    def __getitem__(self, sequences: int) -> StepCost:
        return self.by_sequences.setdefault(sequences, StepCost())


def plan(rows: int, candidates: list[tuple[float, int]], cost: StepCost) -> list[int]:
    """How many guessed tokens each sequence takes this step: those that raise the expected tokens per second.

    rows: the step's rows without guesses (one per decoding sequence). candidates: per sequence, its acceptance
    rate and how many tokens it could guess. A sequence's j-th guessed token returns rate**j tokens on average (it
    is kept only if every one before it was); tokens are taken best first while the step's expected tokens per
    second grows -- each taken token is a row, whose cost StepCost says."""
    base = cost(rows)
    taken = [0] * len(candidates)
    if base is None:
        return taken
    offers = sorted(((rate ** j, s) for s, (rate, most) in enumerate(candidates) for j in range(1, most + 1)),
                    reverse=True)
    tokens, best, best_n = float(rows), rows / base, 0
    for n, (value, _) in enumerate(offers, 1):
        tokens += value
        seconds = cost(rows + n)
        if seconds is not None and tokens / seconds > best:
            best, best_n = tokens / seconds, n
    for _, s in offers[:best_n]:
        taken[s] += 1
    return taken
