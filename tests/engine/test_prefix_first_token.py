"""A prompt's first token leaves before its blocks are written into the prefix cache, and nothing is lost by it.

On a miss the llama.cpp engine writes the prompt's new blocks at the step after the one that gives its first token
(prefix_side.py, PrefixSide.defer and keep_deferred), so that the writes (5 to 10 ms on 2 cores:
bench/bench_ttft_prefix.py) are not in its time to the first token. The daemon must still hear of the blocks
(Cached) before the request can end, a cancelled request must write none (the daemon gives their slots away with
it), and the next prompt must find the prompt context empty. One engine in this process, with a real block store
and the daemon's own index; the test plays the daemon's part. The engine runs in a child process
(first_token_scenarios.py): it tiles its attention, which llama.cpp reads once per process, and this process's own
llama.cpp references (test_lm_eval.py's) must not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BLOCK = 16  # first_token_scenarios.py's block


@pytest.fixture(scope="module")
def seen(default_model) -> dict:
    """What each scenario saw, as first_token_scenarios.py reports it."""
    run = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "first_token_scenarios.py"),
                          str(default_model)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_the_first_token_leaves_before_the_blocks_and_the_daemon_hears_of_them_before_the_end(seen):
    miss = seen["miss"]
    steps = miss["steps"]  # each step's events for the request, by type
    first = next(i for i, types in enumerate(steps) if "Delta" in types)
    assert "Cached" not in steps[first], steps
    assert steps[first + 1] == ["Cached", "Delta"] and miss["stored"] > 0, steps  # before that step's token
    assert sum(types.count("Cached") for types in steps) == 1
    # what it wrote is read back: the same prompt again hits its blocks and gives the same tokens
    assert miss["hit_tokens"] >= BLOCK * 3, miss
    assert miss["again_tokens"] == miss["tokens"] and len(miss["tokens"]) == 24


def test_a_request_that_ends_at_its_first_token_reports_its_blocks_before_that_token(seen):
    once = seen["ends_at_first"]
    assert once["types"] == ["Cached", "Delta"] and once["stored"] > 0, once
    assert once["finish_reason"] == "length"


def test_a_request_cancelled_before_its_blocks_are_written_writes_none_and_the_next_prompt_is_untouched(seen):
    cancel = seen["cancel"]
    assert cancel["pending_before_cancel"] and not cancel["pending_after_cancel"], cancel
    assert cancel["cancel_events"] == [] and cancel["planned_slots"] > 0
    assert cancel["written_slots"] == 0, cancel  # its planned slots were never written
    # the prompt context was cleared: the next prompt runs from nothing, and gives what it gives alone
    assert cancel["cached_after"] == 0 and cancel["after_tokens"] == cancel["alone_tokens"], cancel
