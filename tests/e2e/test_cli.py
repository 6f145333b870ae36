"""`syshax` as a user types it: plugins, init, and editing one config key in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def syshax(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_plugins_lists_the_builtin_backend_through_its_entry_point():
    done = syshax("plugins", "--json")
    assert done.returncode == 0, done.stderr
    backends = {b["name"]: b for b in json.loads(done.stdout)}
    llama = backends["llamacpp"]
    assert llama["device"] == "cpu" and llama["available"] is True
    assert set(llama["roles"]) == {"prefill", "decode", "generate", "embed"}
    table = syshax("plugins").stdout
    assert "llamacpp" in table and "AVAILABLE" in table


def test_init_writes_the_documented_config_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "syshax.toml"
    assert syshax("init", str(target)).returncode == 0
    assert target.read_text() == (REPO / "syshaxd" / "etc" / "syshax.toml").read_text()
    again = syshax("init", str(target))
    assert again.returncode != 0 and "--force" in again.stderr


def test_config_edits_one_key_and_keeps_the_comments(tmp_path):
    target = tmp_path / "syshax.toml"
    syshax("init", str(target))
    done = syshax("config", "cpu_max_batch_size", "4", "--file", str(target))
    assert done.returncode == 0, done.stderr
    text = target.read_text()
    assert "cpu_max_batch_size = 4" in text
    assert "# Sequences decoded together" in text  # the documentation survived
    original = (REPO / "syshaxd" / "etc" / "syshax.toml").read_text()
    assert len(text.splitlines()) == len(original.splitlines())


def test_config_writes_a_key_into_its_table_or_where_an_older_file_holds_it(tmp_path):
    import tomllib

    tables = tmp_path / "tables.toml"
    tables.write_text('[engines]\nn_ctx = 2048\n\n[[models]]\nname = "e"\npath = "/m/e.gguf"\n')
    for key, value in (("n_ctx", "1024"), ("max_queue_size", "9")):
        done = syshax("config", key, value, "--file", str(tables))
        assert done.returncode == 0, done.stderr
    data = tomllib.loads(tables.read_text())
    assert data["engines"] == {"n_ctx": 1024} and data["server"] == {"max_queue_size": 9}  # a table it lacked
    assert data["models"] == [{"name": "e", "path": "/m/e.gguf"}]
    assert json.loads(syshax("config", "max_queue_size", "--file", str(tables)).stdout) == 9
    flat = tmp_path / "flat.toml"
    flat.write_text("n_ctx = 2048\n")
    assert syshax("config", "n_ctx", "1024", "--file", str(flat)).returncode == 0
    assert tomllib.loads(flat.read_text()) == {"n_ctx": 1024}  # where the file has it, not twice


def test_config_refuses_bad_values_and_names_the_key(tmp_path):
    target = tmp_path / "syshax.toml"
    syshax("init", str(target))
    before = target.read_text()
    done = syshax("config", "cpu_max_batch_size", "zero", "--file", str(target))
    assert done.returncode == 2 and "cpu_max_batch_size" in done.stderr
    done = syshax("config", "mode", "warp", "--file", str(target))
    assert done.returncode == 2 and "mode" in done.stderr
    done = syshax("config", "no_such_key", "1", "--file", str(target))
    assert done.returncode == 2 and "unknown key" in done.stderr
    assert target.read_text() == before


def test_help_explains_the_commands():
    done = syshax("--help")
    assert done.returncode == 0
    for word in ("plugins", "init", "config", "model", "benchmark"):
        assert word in done.stdout
    daemon = subprocess.run([sys.executable, "-m", "syshaxd", "--help"], capture_output=True, text=True, timeout=60)
    assert daemon.returncode == 0 and "--model" in daemon.stdout and "--mode" in daemon.stdout
