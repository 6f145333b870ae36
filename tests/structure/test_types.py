"""The type checker over the core and the built-in plugins: mypy on syshaxd/, plugins/llamacpp, plugins/torch and
plugins/vllm (its settings in pyproject.toml) finds nothing.

Among what it checks: every engine the scheduler holds is an EngineHandle (engine/engine_handle.py), a local
WorkerHandle or a remote node alike, and the typed messages are built with the types they declare.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mypy(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".mypy_cache"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_mypy_finds_no_error_in_the_core_and_the_plugins():
    done = mypy("--config-file", str(REPO / "pyproject.toml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_engine_without_what_the_protocol_declares_is_refused(tmp_path):
    # the check that passes the real tree fails a decoder that imitates WorkerHandle attribute by attribute, as the
    # remote node once did (hangs = 0, log_level, no set_log_level or link_status)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from syshaxd.engine.engine_handle import EngineHandle\n"
        "from syshaxd.remote.front import RemoteNode\n"
        "from syshaxd.engine.supervisor import WorkerHandle\n\n"
        "class Duck:\n"
        "    name, remote, hangs, log_level = 'node 10.0.0.2:8701', True, 0, 'info'\n\n"
        "def hold(local: WorkerHandle, node: RemoteNode, duck: Duck) -> list[EngineHandle]:\n"
        "    return [local, node, duck]\n")
    done = mypy("--ignore-missing-imports", "--python-version", "3.11", str(probe))
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "probe.py:9" in errors[0] and '"Duck"' in errors[0], done.stdout
