"""CPU kernels: the llama.cpp engine picks kernels that run on this CPU, proves them in a warm-up before it says
ready, and a worker whose kernels crash (in the warm-up, or on every request) falls back to safe kernels or is
reported failed with the reason -- never restarted forever while requests are lost.

The crashes are injected (SYSHAX_FAULT, syshaxd/sdk/faults.py: a real SIGSEGV at that point), so these paths
run on every CPU, not only on the AMX Xeons whose kernels crash in this llama.cpp.
"""

from __future__ import annotations

import socket
import time

import openai
import pytest

from conftest import MODEL_NAME, http_json, start_daemon, wait_for
from syshax_llamacpp.kernels import (KernelChoice, choose, cpu_flags, extra_buffer_types, read_cpu_flags,
                                     tiles_decode_cheaply, why_not_tiled)
from syshaxd.config import ConfigError, from_mapping
from syshaxd.sdk import faults

SAPPHIRE_RAPIDS = frozenset("avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
ZEN4 = frozenset("avx2 avx512f avx512_vnni avx512_bf16".split())
GRAVITON = frozenset("fp asimd sve i8mm".split())


# --- the choice, for CPUs and builds this machine is not ------------------------------------------



def test_every_rows_attention_is_tiled_only_where_k_packs_in_vectors():
    # mk/patches/ computes a few rows' attention with AVX-512, or AVX2 with F16C and FMA (patches 0003 and 0007, as
    # the wheel is compiled for this CPU); elsewhere a decode step's tiled attention costs more
    assert tiles_decode_cheaply(ZEN4) and tiles_decode_cheaply(SAPPHIRE_RAPIDS)
    assert tiles_decode_cheaply(frozenset("avx avx2 f16c fma".split()))  # Haswell
    assert not tiles_decode_cheaply(frozenset("avx avx2 fma".split())) and not tiles_decode_cheaply(GRAVITON)
    assert not tiles_decode_cheaply(frozenset("avx avx2 f16c".split()))  # 0007 needs fused multiply-adds

def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_int8 amx_tile\nbogomips\t: 1\n"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve i8mm\nCPU implementer\t: 0x41\n"
    assert cpu_flags(x86) == cpu_flags(x86, "x86_64") == {"fpu", "avx2", "amx_int8", "amx_tile"}
    assert cpu_flags(arm) == cpu_flags(arm, "aarch64") == {"fp", "asimd", "sve", "i8mm"}
    assert cpu_flags("") == frozenset()
    assert read_cpu_flags("/nonexistent/cpuinfo") == frozenset()


def test_an_arm_process_under_qemu_does_not_take_the_x86_hosts_flags_for_its_own(tmp_path):
    """qemu-user (make test-arm) shows an arm64 process the x86 host's /proc/cpuinfo: its AVX-512 must not make the
    ARM llama.cpp's decode steps take the tiled attention that is cheap only with AVX."""
    host = tmp_path / "cpuinfo"
    host.write_text("processor\t: 0\nflags\t\t: fpu avx2 f16c fma avx512f amx_int8\n")
    assert read_cpu_flags(str(host), "aarch64") == frozenset()
    assert not tiles_decode_cheaply(read_cpu_flags(str(host), "aarch64"))
    assert tiles_decode_cheaply(read_cpu_flags(str(host), "x86_64"))
    # and the status says why, naming the architecture
    assert why_not_tiled(read_cpu_flags(str(host), "aarch64"), "aarch64").startswith("this aarch64 CPU: ")
    assert why_not_tiled(read_cpu_flags(str(host), "x86_64"), "x86_64") == ""
    assert why_not_tiled(frozenset({"avx2", "fma"}), "x86_64").startswith("this CPU has neither AVX-512 nor AVX2")


def test_auto_repacks_where_the_build_has_no_amx():
    for flags in (ZEN4, SAPPHIRE_RAPIDS):  # the no-AMX build (mk/llama-wheel.sh) on an AMX Xeon too
        got = choose("auto", ["CPU_REPACK"], flags)
        assert got == KernelChoice(True, "repack", got.why, safe_repack="off") and got.why
    arm = choose("auto", ["KLEIDIAI", "CPU_REPACK"], GRAVITON)
    assert arm.use_extra_bufts and arm.kernels == "kleidiai+repack" and arm.safe_repack == "off"


def test_auto_turns_amx_off_on_an_amx_cpu_and_says_how_to_keep_repacking():
    got = choose("auto", ["AMX", "CPU_REPACK"], SAPPHIRE_RAPIDS)
    assert not got.use_extra_bufts and got.kernels == "plain" and got.safe_repack == ""
    assert "AMX" in got.why and "20824" in got.why and "mk/llama-wheel.sh" in got.why


def test_on_takes_amx_but_keeps_safer_kernels_and_off_is_plain():
    on = choose("on", ["AMX", "CPU_REPACK"], SAPPHIRE_RAPIDS)
    assert on.use_extra_bufts and on.kernels == "amx+repack" and on.safe_repack == "off" and "20824" in on.why
    off = choose("off", ["AMX", "CPU_REPACK"], SAPPHIRE_RAPIDS)
    assert not off.use_extra_bufts and off.kernels == "plain" and "config" in off.why


def test_a_build_without_extra_kernels_or_one_that_cannot_be_asked():
    bare = choose("auto", [], ZEN4)
    assert (bare.use_extra_bufts, bare.kernels, bare.safe_repack) == (False, "plain", "") and "no repacked" in bare.why
    unknown = choose("auto", None, ZEN4)
    assert unknown.use_extra_bufts and unknown.safe_repack == "off"
    with pytest.raises(ValueError, match="repack"):
        choose("fast", ["CPU_REPACK"], ZEN4)


def test_the_repack_key_is_checked():
    assert from_mapping({"repack": "off"}).repack == "off"
    with pytest.raises(ConfigError, match='repack: must be "auto"'):
        from_mapping({"repack": "yes"})


def test_fault_names_are_checked():
    assert faults.parse("") == "" and faults.parse("decode:repacked") == "decode:repacked"
    for bad in ("warm", "decode:always", "prefill"):
        with pytest.raises(faults.FaultError, match="SYSHAX_FAULT"):
            faults.parse(bad)


# --- real daemons: the warm-up, the safer kernels, the crash loop --------------------------------------


def worker(d) -> dict:
    return d.status()["workers"][0]


def config(model, **extra) -> dict:
    return {"model": str(model), "model_name": MODEL_NAME, "worker_restart_delay": 0.2} | extra


def health_when_failed(d, timeout: float = 60) -> dict:
    """/health's body once it says the daemon failed (its one worker given up on)."""
    def failed():
        try:
            _, body = http_json(f"{d.url}/health", timeout=2)
        except OSError:
            return None
        return body if body.get("status") == "failed" else None

    return wait_for(failed, timeout=timeout, what="/health to say failed")


def complete(d, prompt="The capital of France is", max_tokens=8) -> tuple[int, dict]:
    return http_json(f"{d.base_url}/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=120)


def test_a_worker_proves_its_kernels_and_the_status_says_which(default_model, tmp_path):
    d = start_daemon(tmp_path, config(default_model))
    try:
        w = worker(d)
        flags = read_cpu_flags()
        import llama_cpp

        llama_cpp.llama_backend_init()
        assert w["kernels"] == choose("auto", extra_buffer_types(), flags).kernels and w["kernels_why"], w
        if "avx2" in flags or "asimd" in flags:  # llama.cpp repacks q4_0 for these (and AMX is left out of the build)
            assert w["kernels"] == "repack", w
        assert w["restarts"] == 0
        log = wait_for(lambda: "syshaxd ready" in (text := d.log()) and text, what="the ready line")
        assert "warming up" in log and "warm-up passed" in log
        assert log.index("warm-up passed") < log.index("syshaxd ready")
        status, body = complete(d)
        assert status == 200, body
    finally:
        assert d.stop() == 0


def test_off_runs_plain_kernels(default_model, tmp_path):
    d = start_daemon(tmp_path, config(default_model, repack="off"))
    try:
        w = worker(d)
        assert w["kernels"] == "plain" and "config" in w["kernels_why"]
        assert complete(d)[0] == 200
    finally:
        assert d.stop() == 0


def test_a_worker_that_dies_in_its_warm_up_falls_back_to_plain_kernels(default_model, tmp_path):
    d = start_daemon(tmp_path, config(default_model), env={"SYSHAX_FAULT": "warmup:repacked"})
    try:
        w = worker(d)
        assert w["state"] == "ready" and w["kernels"] == "plain" and w["restarts"] == 1, w
        assert "weight repacking" in w["kernels_why"] and "SIGSEGV" in w["kernels_why"], w
        status, body = complete(d)
        assert status == 200 and body["choices"][0]["text"], body
        log = d.log()
        # said once, in words: what was turned off and why
        assert log.count("turned off (as with repack = \"off\" in the config)") == 1, log
        assert "in its warm-up" in log
    finally:
        assert d.stop() == 0


def test_a_worker_that_dies_in_its_warm_up_with_nothing_safer_is_failed_with_the_reason(default_model, tmp_path):
    d = start_daemon(tmp_path, config(default_model, repack="off"), env={"SYSHAX_FAULT": "warmup"}, wait=False)
    try:
        health = health_when_failed(d)
        error = health["workers"][0]["error"]
        assert "SIGSEGV" in error and "warm-up" in error and "not restarted" in error, health
        time.sleep(1.0)  # not restarted forever
        w = worker(d)
        assert w["state"] == "failed" and w["restarts"] == 0 and w["pid"] is None, w
        status, body = complete(d)
        assert status == 503 and "can serve" in body["error"]["message"] and "SIGSEGV" in body["error"]["message"]
        assert "retry shortly" not in body["error"]["message"]
        assert d.proc.poll() is None  # the daemon itself keeps serving /health and the status
    finally:
        assert d.stop() == 0


def test_a_warm_up_that_fails_on_the_model_is_failed_with_its_reason_not_blamed_on_the_kernels(default_model, tmp_path):
    # A state the codec cannot parse (StateFormatError, a ModelNotServable: a KV cache layout this engine does not
    # carry; SYSHAX_FAULT=state makes the warm-up meet one) is the model's cause: other kernels would meet it again,
    # so the worker is failed at once, with that reason, and the repack kernels are neither blamed nor turned off.
    d = start_daemon(tmp_path, config(default_model), env={"SYSHAX_FAULT": "state"}, wait=False)
    try:
        health = health_when_failed(d, timeout=180)
        error = health["workers"][0]["error"]
        assert error.startswith("its warm-up failed: StateFormatError: fault injection"), health
        w = wait_for(lambda: (w := worker(d))["pid"] is None and w, what="the worker to exit")
        time.sleep(1.0)  # not restarted, with other kernels or the same
        w = worker(d)
        assert w["state"] == "failed" and w["restarts"] == 0 and w["pid"] is None, w
        if "avx2" in read_cpu_flags():  # q4_0 is repacked here: there were safer kernels, and they were not tried
            assert w["kernels"] == "repack", w
        assert "turned off" not in w["kernels_why"] and "turned off" not in d.log(), w
        status, body = complete(d)
        assert status == 503 and "StateFormatError" in body["error"]["message"], body
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0


def test_a_worker_that_dies_on_every_request_falls_back_and_then_serves(default_model, tmp_path):
    d = start_daemon(tmp_path, config(default_model), env={"SYSHAX_FAULT": "decode:repacked"})
    try:
        assert worker(d)["kernels"] == "repack"
        answers = []
        for _ in range(4):  # two deaths for the first request (it is retried once), the third is a crash loop
            # as a client honouring Retry-After: a request sent while the worker restarts gets 503 at once
            wait_for(lambda: worker(d)["state"] == "ready", what="the worker to be back")
            answers.append(complete(d))
            if answers[-1][0] == 200:
                break
        status, body = answers[-1]
        assert status == 200 and body["choices"][0]["text"], answers
        # the first request: its worker died, it was sent again once the worker was back, and died again
        assert answers[0][0] == 503 and answers[0][1]["error"]["code"] == "engine_restarting", answers
        assert len(answers) == 2, answers
        w = worker(d)
        assert w["kernels"] == "plain" and "crash loop" in w["kernels_why"] and w["restarts"] == 3, w
        assert all(complete(d, f"Request {i}")[0] == 200 for i in range(3))
    finally:
        assert d.stop() == 0


def test_a_crash_loop_with_nothing_safer_is_failed_and_requests_get_the_reason(default_model, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # systemd's end of sd_notify
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.5)
    d = start_daemon(tmp_path, config(default_model, repack="off"),
                     env={"SYSHAX_FAULT": "decode", "NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=120)
        errors = []
        for _ in range(3):
            wait_for(lambda: worker(d)["state"] in ("ready", "failed"), what="the worker to be back")
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
            errors.append(caught.value)
            if caught.value.body.get("code") == "engine_failed":
                break
        last = errors[-1]
        assert last.status_code == 503 and last.body["code"] == "engine_failed", [e.body for e in errors]
        assert "crash loop" in last.body["message"], last.body
        w = wait_for(lambda: (w := worker(d))["state"] == "failed" and w, what="the worker to be given up")
        assert "3 times in a row" in w["error"]
        time.sleep(1.0)
        assert worker(d)["restarts"] == w["restarts"]  # no more restarts
        status, health = http_json(f"{d.url}/health")
        assert status == 503 and health["status"] == "failed"
        with pytest.raises(openai.APIStatusError, match="can serve"):
            client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
        said = []
        while True:
            try:
                said += notify.recv(4096).decode().split("\n")
            except TimeoutError:
                break
        assert any(line.startswith("STATUS=degraded: cpu0 failed: the engine died 3 times in a row") for line in said), said
    finally:
        assert d.stop() == 0
        notify.close()
