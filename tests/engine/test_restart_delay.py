"""How long a model of [[models]] loaded with the daemon waits before it is started again by itself (engine/
entry_models.py): a second after a death, longer when it keeps dying soon after it serves, and never by itself
after QUICK_DEATHS such deaths in a row."""

from __future__ import annotations

from pathlib import Path

from syshaxd.engine.entry_models import QUICK_DEATH, QUICK_DEATHS, RESTART_DELAYS, EntryModel
from syshaxd.model_entries import ModelEntry


def _model() -> EntryModel:
    return EntryModel(ModelEntry("m", "/m.gguf"), Path("/m.gguf"))


def test_a_model_that_served_long_is_restarted_at_once_every_time():
    model = _model()
    for _ in range(10):
        assert model.restart_delay(QUICK_DEATH + 1) == RESTART_DELAYS[0]
    assert model.restart_delay(None) == RESTART_DELAYS[0]  # (how long it served unknown: not counted as quick)
    assert model.needs_restart() is False  # nothing loaded, nothing to start again


def test_deaths_soon_after_serving_wait_longer_then_stop_the_restarts():
    """Each death within QUICK_DEATH seconds of serving waits the next delay; QUICK_DEATHS of them in a row, however
    long its start takes (the delays and the start are not counted, only how long it served), end the restarts."""
    model = _model()
    delays = [model.restart_delay(5.0) for _ in range(QUICK_DEATHS)]
    assert delays == [*RESTART_DELAYS[1:QUICK_DEATHS], None]
    assert model.restart_delay(5.0) is None  # until it serves a while again
    assert model.restart_delay(QUICK_DEATH * 2) == RESTART_DELAYS[0]
    assert model.restart_delay(5.0) == RESTART_DELAYS[1]
