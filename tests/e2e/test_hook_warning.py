"""A daemon started with a test hook in its environment (SYSHAX_FAULT, SYSHAX_GUESS, SYSHAX_SLOW) says so in its log:
a hook left in a production unit must not go unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys

from syshaxd.environment import TEST_HOOKS, hook_warnings


def test_one_warning_per_hook_set():
    assert set(TEST_HOOKS) == {"SYSHAX_FAULT", "SYSHAX_GUESS", "SYSHAX_SLOW"}
    assert hook_warnings({"PATH": "/bin", "SYSHAX_FAULT": ""}) == []  # empty: the hook is off
    warnings = hook_warnings({"SYSHAX_GUESS": "always", "SYSHAX_SLOW": "cpu0=0.01", "SYSHAX_CONFIG": "x.toml"})
    assert len(warnings) == 2
    guess, slow = warnings
    assert guess.startswith("SYSHAX_GUESS='always': a test hook that forces guesses")
    assert slow.startswith("SYSHAX_SLOW='cpu0=0.01': a test hook that injects slowness")
    assert all("production must not set it" in w for w in warnings)
    assert "injects faults" in hook_warnings({"SYSHAX_FAULT": "decode"})[0]


def test_the_daemon_logs_the_warning_at_start(tmp_path):
    # the warning comes right after the config is read, before the model: a model that does not exist ends the
    # start there (exit 2) without loading anything
    config = tmp_path / "syshax.toml"
    config.write_text(f'[serve]\nmodel_dir = "{tmp_path}"\n')
    env = {k: v for k, v in os.environ.items() if k not in TEST_HOOKS} | {"SYSHAX_GUESS": "always"}
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--config", str(config), "--model",
                           str(tmp_path / "missing.gguf")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, done.stderr
    assert "SYSHAX_GUESS='always': a test hook" in warnings[0] and "production must not set it" in warnings[0]
    assert "missing.gguf" in done.stderr  # and it went on to the start it was given
