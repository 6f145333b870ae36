"""How long a model of [[models]] loaded with the daemon waits before it is started again by itself (engine/
entry_models.py): a second after a death, longer when it keeps dying soon after each restart."""

from __future__ import annotations

from pathlib import Path

from syshaxd.engine.entry_models import QUICK_DEATH, RESTART_DELAYS, EntryModel
from syshaxd.model_entries import ModelEntry


def test_restarts_that_come_quickly_wait_longer_each_time():
    model = EntryModel(ModelEntry("m", "/m.gguf"), Path("/m.gguf"))
    assert model.restart_delay(1000.0) == RESTART_DELAYS[0]  # the first death
    assert model.restart_delay(1010.0) == RESTART_DELAYS[1]  # it died again 10 s after its restart
    assert model.restart_delay(1020.0) == RESTART_DELAYS[2]
    assert model.restart_delay(1030.0) == RESTART_DELAYS[-1]  # and no longer than the last
    assert model.restart_delay(1030.0 + QUICK_DEATH + 1) == RESTART_DELAYS[0]  # it served a while: a fresh start
    assert model.needs_restart() is False  # nothing loaded, nothing to start again
