"""The llama.cpp engine's whole-state checkpoints (checkpoints.py), by themselves: the longest state a prompt starts
with, on the grid its chunks allow, never the whole prompt; the least recently used goes first when the budget is
full; a state over the budget is not kept. tests/plugins/test_families.py serves prompts from them on real models."""

from __future__ import annotations

import numpy as np
from syshax_llamacpp.checkpoints import Checkpoints


def _state(nbytes: int, fill: int = 1) -> np.ndarray:
    return np.full(nbytes, fill, np.uint8)


def test_the_longest_state_a_prompt_starts_with_leaving_a_token_to_compute():
    cps = Checkpoints(budget=1000)
    assert cps.keep([1, 2, 3], _state(10, 3)) and cps.keep([1, 2, 3, 4, 5], _state(10, 5))
    found = cps.find([1, 2, 3, 4, 5, 6], grid=1)
    assert found.n_tokens == 5 and found.state[0] == 5
    assert cps.find([1, 2, 3, 4, 5], grid=1).n_tokens == 3  # the whole prompt's state leaves nothing to compute
    assert cps.find([1, 2, 9, 4, 5, 6], grid=1) is None  # another token inside the prefix
    assert cps.find([1, 2, 3, 4, 5, 6], grid=3).n_tokens == 3  # chunks of 3: only a state after whole chunks
    assert cps.hits == 3
    assert not cps.find([1, 2, 3, 4, 5, 6], grid=3).state.flags.writeable  # a kept state is not changed by a reader


def test_the_least_recently_used_state_goes_first_and_one_over_the_budget_is_not_kept():
    cps = Checkpoints(budget=30)
    for n in (1, 2, 3):
        assert cps.keep(list(range(n)), _state(10))
    assert cps.find([0, 1, 9], grid=1).n_tokens == 2  # used: now the most recent
    assert cps.keep([7, 7, 7, 7], _state(10))
    assert cps.evicted == 1 and len(cps) == 3 and cps.used == 30
    assert cps.find([0, 5], grid=1) is None  # [0] went first
    assert cps.find([0, 1, 5], grid=1).n_tokens == 2
    assert not cps.keep([1, 1, 1, 1, 1], _state(31))
    assert len(cps) == 3
    assert cps.keep([0, 1], _state(10, 9))  # the same tokens again: replaced, not doubled
    assert cps.used == 30 and cps.find([0, 1, 2], grid=1).state[0] == 9
