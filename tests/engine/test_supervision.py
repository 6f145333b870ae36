"""The daemon spawns, pins, supervises and restarts its engine workers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import openai
import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon, wait_for


def test_killed_worker_is_restarted_and_serving_resumes(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "worker_restart_delay": 0.2})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0)
        first = d.status()["workers"][0]
        os.kill(first["pid"], signal.SIGKILL)
        worker = wait_for(lambda: (w := d.status()["workers"][0])["state"] == "ready" and w["pid"] != first["pid"]
                          and w, what="the restarted worker")
        assert worker["restarts"] == 1
        r = client.completions.create(model=MODEL_NAME, prompt="Back again", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    finally:
        assert d.stop() == 0


def test_a_request_in_flight_when_its_worker_dies_resumes_on_the_restarted_worker(default_model, tmp_path):
    """The journey resumes it (engine/journey.py): the restarted worker gets the prompt and the tokens so far, and
    the client's stream goes on; greedy, its text is the text of an undisturbed run."""
    d = start_daemon(tmp_path, {"model": str(default_model), "worker_restart_delay": 0.2})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=120)
        ask = dict(model=MODEL_NAME, prompt="Tell a long story", max_tokens=120, temperature=0,
                   extra_body={"ignore_eos": True})
        undisturbed = client.completions.create(**ask).choices[0].text
        it = iter(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        chunks = [next(it)]
        pid = d.status()["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        chunks += list(it)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert text == undisturbed and finish == ["length"] and chunks[-1].usage.completion_tokens == 120
        status = d.status()
        assert status["workers"][0]["restarts"] == 1 and status["workers"][0]["pid"] != pid
        assert status["rescued"]["resumed"] == 1 and status["rescued"]["lost"] == 0, status["rescued"]
        assert "resumed on cpu0" in d.log()
    finally:
        assert d.stop() == 0


def test_a_request_whose_worker_is_not_back_within_request_timeout_ends_with_a_clean_error(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "worker_restart_delay": 4.0, "request_timeout": 0.5})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0)
        stream = client.completions.create(model=MODEL_NAME, prompt="Tell a long story", max_tokens=2000,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        os.kill(d.status()["workers"][0]["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="worker died mid-stream, and no CPU worker is ready"):
            for _ in it:
                pass
        assert d.status()["rescued"]["lost"] == 1
        wait_for(lambda: d.status()["workers"][0]["state"] == "ready", what="restart")
        assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=2,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    finally:
        assert d.stop() == 0


def test_an_engine_that_cannot_load_keeps_health_at_503_with_the_reason(tmp_path, default_model):
    broken = tmp_path / "broken.gguf"  # a GGUF cut short: its header reads, its weights are not all there
    with open(default_model, "rb") as src:
        broken.write_bytes(src.read(default_model.stat().st_size // 2))
    d = start_daemon(tmp_path, {"model": str(broken), "quantize": ""}, wait=False)
    try:
        status, body = wait_for(lambda: _health_if(d, "failed"), what="the failed state")
        assert status == 503
        assert "could not load" in body["workers"][0]["error"]
        status, err = http_json(f"{d.base_url}/completions", {"model": "broken", "prompt": "hi"})
        assert status == 503 and err["error"]["code"] == "engine_unavailable"
    finally:
        assert d.stop() == 0


def _health_if(d, wanted: str):
    try:
        status, body = http_json(f"{d.url}/health", timeout=1)
    except OSError:
        return None  # not listening yet
    return (status, body) if body.get("status") == wanted else None


def test_a_file_that_is_not_a_gguf_is_a_clear_startup_error(tmp_path):
    broken = tmp_path / "model.safetensors"
    broken.write_bytes(b"this is not a GGUF file")
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--model", str(broken), "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "model.safetensors: not a GGUF" in done.stderr and "pass --model PATH to a GGUF file" in done.stderr


def test_missing_model_file_is_a_clear_startup_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--model", str(tmp_path / "none.gguf"), "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "none.gguf" in done.stderr


def test_unavailable_mode_is_refused_with_the_reason(tmp_path, default_model):
    # auto mode's GPU engine must generate and prefill: the torch backend only prefills
    config = tmp_path / "syshax.toml"
    config.write_text('prefill_engine = "torch"\n')
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--config", str(config), "--model", str(default_model),
                           "--mode", "auto", "--port", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "prefill_engine: backend 'torch' cannot generate and prefill (auto mode" in done.stderr


def test_quantize_at_first_load_is_cached(tmp_path):
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(MODEL_DIR / source.name, source)
    cache = tmp_path / "cache"
    cfg = {"model": str(source), "model_dir": str(cache), "quantize": ""}
    d = start_daemon(tmp_path, cfg, env={"SYSHAX_QUANTIZE": "q4_0"})
    quantized = cache / "SmolLM2-135M-Instruct.q4_0.gguf"
    try:
        assert quantized.is_file()
        assert "quantizing" in d.log()
    finally:
        assert d.stop() == 0
    stamp = quantized.stat().st_mtime_ns
    d = start_daemon(tmp_path, cfg, env={"SYSHAX_QUANTIZE": "q4_0"})
    try:
        assert quantized.stat().st_mtime_ns == stamp and "quantizing" not in d.log()
    finally:
        assert d.stop() == 0


def test_cpu_affinity_and_threads_from_the_environment(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model)}, env={"CUSTOM_CPU_AFFINITY": "1", "OMP_NUM_THREADS": "1"})
    try:
        worker = d.status()["workers"][0]
        assert worker["cpus"] == [1] and worker["threads"] == 1
        assert os.sched_getaffinity(worker["pid"]) == {1}
    finally:
        assert d.stop() == 0
