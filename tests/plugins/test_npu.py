"""NPU and torch backends (both from the torch plugin) on a host without them: listed with why not, refused at start."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, start_daemon

NO_NPU = importlib.util.find_spec("torch_npu") is None


def plugins_json(env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-m", "syshaxd.cli", "plugins", "--json"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return {b["name"]: b for b in json.loads(done.stdout)}


@pytest.mark.skipif(not NO_NPU, reason="this host has torch_npu")
def test_plugins_lists_npu_as_unavailable_and_says_why():
    npu = plugins_json()["npu"]
    assert npu["device"] == "npu" and npu["roles"] == ["prefill"]
    assert npu["available"] is False and npu["reason"].startswith("no torch_npu")
    table = subprocess.run([sys.executable, "-m", "syshaxd.cli", "plugins"], capture_output=True, text=True,
                           timeout=60, cwd=REPO).stdout
    assert "why not: no torch_npu" in table


@pytest.mark.skipif(not NO_NPU, reason="this host has torch_npu")
def test_choosing_npu_here_is_a_clear_startup_error(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "prefill_engine": "npu"}, wait=False)
    try:
        code = d.proc.wait(timeout=60)
    finally:
        d.stop()
    log = d.log()
    assert code != 0
    assert "prefill_engine" in log and "'npu' is not available here: no torch_npu" in log, log
    assert "Traceback" not in log, log


HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(NO_NPU, reason="needs an Ascend host where torch_npu imports; this host has none")
def test_npu_backend_is_offered_where_torch_npu_imports():
    npu = plugins_json()["npu"]
    assert npu["available"] is True, npu


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed here (make test installs it); the torch-missing path "
                    "runs where the syshax-torch plugin is installed without its dependencies")
def test_torch_backends_say_why_not_when_torch_is_missing():
    backends = plugins_json()
    why = backends["torch"]
    assert not why["available"] and why["reason"].startswith("torch not installed") and "syshax-torch" in why["reason"]
    assert backends["npu"]["reason"].startswith("no torch_npu")


@pytest.mark.parametrize(("mode", "engine", "why"), [
    ("cpu", "npu", "cpu_engine: backend 'npu' cannot generate (its roles: prefill)"),
    ("hetero", "vllm", "cpu_engine: backend 'vllm' cannot generate and decode"),
    ("cpu", "nonesuch", "cpu_engine: no backend named 'nonesuch' is installed"),
])
def test_cpu_engine_is_checked_at_start(tmp_path, default_model, mode, engine, why):
    config = tmp_path / "syshax.toml"
    config.write_text(f'cpu_engine = "{engine}"\n')
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--config", str(config), "--model", str(default_model),
                           "--mode", mode, "--port", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert why in done.stderr, done.stderr
