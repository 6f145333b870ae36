"""A third party's install: the core and the llama.cpp plugin alone, in a fresh venv, list one backend and serve cpu mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import MODEL_NAME, REPO, http_json, start_daemon

# the parts of the tree a `pip install . plugins/llamacpp` reads (copied, so the build leaves nothing in the tree)
SOURCES = ("pyproject.toml", "README.md", "syshaxd", "plugins/llamacpp")


@pytest.mark.slow
def test_core_and_the_llamacpp_plugin_alone_serve_cpu_mode(tmp_path, default_model):
    src = tmp_path / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # nothing from the test's own tree or venv
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env |= {"PYTHONPATH": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # llama-cpp-python as `make install` takes it: the wheel mk/llama-wheel.sh built for this CPU (kept by it, not
    # in pip's cache); the other dependencies from pip's cache or the registry
    wheel = subprocess.run(["bash", str(REPO / "mk" / "llama-wheel.sh"), str(venv / "bin" / "python")],
                           capture_output=True, text=True, timeout=900, env=env)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    installed = subprocess.run([venv / "bin" / "pip", "install", "-q", wheel.stdout.strip().splitlines()[-1],
                                str(src), str(src / "plugins" / "llamacpp")],
                               capture_output=True, text=True, timeout=240, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]

    listed = subprocess.run([venv / "bin" / "syshax", "plugins", "--json"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    backends = {b["name"]: b for b in json.loads(listed.stdout)}
    assert set(backends) == {"llamacpp"} and backends["llamacpp"]["available"], backends
    # the documented config is package data: `syshax init` finds it in the installed wheel
    made = subprocess.run([venv / "bin" / "syshax", "init", str(tmp_path / "syshax.toml")], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "syshax.toml").read_text() == (REPO / "syshaxd" / "etc" / "syshax.toml").read_text()

    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "cpu"}, env=env,
                     command=[str(venv / "bin" / "syshaxd")])
    try:
        status, body = http_json(f"{d.url}/v1/completions", {"model": MODEL_NAME, "prompt": "The capital of France is",
                                                              "max_tokens": 8, "temperature": 0}, timeout=60)
        assert status == 200, body
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] <= 8
    finally:
        assert d.stop() == 0, d.log()

