"""A user's own GGUF keeps its quant: only F32/F16/BF16 files are quantized at first load (to `quantize`: q4_0 or
q8_0), a Q4_K_M, Q8_0 or any other quantized file is loaded as it is, and the status says which happened.

The files are SmolLM2-135M made into each type by llama.cpp's own quantizer (from the embedded Q4_1, once, cached
in models/). Each served file gives, in hetero mode, cpu mode's tokens on the long greedy chats (tests/greedy.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import MODEL_DIR, MODEL_NAME, model_in, start_daemon
from greedy import answer_all, assert_same

from syshaxd.sdk.gguf.quantize import load_plan, quantized_path

pytestmark = pytest.mark.slow

BASE = {"model_name": MODEL_NAME, "n_ctx": 1024}
@pytest.mark.parametrize("file_type,qtype,kept", [
    ("Q4_K_M", "q4_0", True), ("Q8_0", "q4_0", True), ("Q4_K_M", "q8_0", True),
    ("F16", "q4_0", False), ("F16", "q8_0", False), ("F16", "", True)])
def test_only_unquantized_files_are_quantized(default_model, file_type, qtype, kept):
    plan = load_plan(model_in(file_type), qtype)
    assert plan.file_type == file_type
    assert plan.quantize_to == ("" if kept else qtype), plan.why
    assert ("loaded as it is" in plan.why) == kept


def test_the_default_model_is_served_as_q4_0(default_model):
    plan = load_plan(MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf", "q4_0")
    assert (plan.file_type, plan.quantize_to) == ("Q4_1", "q4_0")
    assert load_plan(default_model, "q4_0").quantize_to == ""  # the q4_0 copy itself is loaded as it is


def _served(tmp_path_factory, name: str, model: Path, mode: str, **config):
    cache = tmp_path_factory.getbasetemp() / f"cache-{name}"
    return start_daemon(tmp_path_factory.mktemp(f"{name}-{mode}"),
                        {"model": str(model), "model_dir": str(cache), "mode": mode, **BASE, **config}
                        | ({"prefill_cpu_affinity": "0"} if mode == "hetero" else {}))


def test_an_f16_file_is_quantized_to_q8_0_and_hetero_returns_cpu_modes_tokens(default_model, tmp_path_factory):
    model, answers = model_in("F16"), {}
    for mode in ("cpu", "hetero"):
        d = _served(tmp_path_factory, "F16", model, mode, quantize="q8_0")
        try:
            status = d.status()
            assert status["model_file"] | {"path": ""} == {
                "path": "", "file_type": "F16", "quantized_to": "q8_0",
                "why": "F16 is not quantized: quantized to q8_0 at first load (cached beside the model)"}
            assert quantized_path(model, "q8_0", tmp_path_factory.getbasetemp() / "cache-F16").is_file()
            assert status["exact"]["resume_exact"] is True and not status["exact"]["why"]
            answers[mode] = answer_all(d)
        finally:
            assert d.stop() == 0, d.log()
    assert_same(answers["hetero"], answers["cpu"], "F16 served as q8_0: hetero against cpu mode")


@pytest.mark.parametrize("file_type", ["Q4_K_M", "F16"])
def test_a_users_file_as_it_is_keeps_every_exact_promise(default_model, tmp_path_factory, file_type):
    """A Q4_K_M (Q4_K, Q6_K and the Q5_0 and Q8_0 of its narrow rows) and an F16 file, loaded as they are: their
    kernels give a row the same bits alone, beside other rows and in a prompt chunk (mk/patches 0013 and 0014 and the
    engine's one kernel per type), so every worker proves it at its warm-up. The status promises hetero == cpu and
    exact resumes, a lone sequence decodes without a padding row, speculation is on, and hetero returns cpu mode's
    tokens on the long greedy chats."""
    model, answers = model_in(file_type), {}
    for mode in ("cpu", "hetero"):
        d = _served(tmp_path_factory, f"{file_type}-as-is", model, mode, quantize="")
        try:
            status = d.status()
            assert status["model_file"]["file_type"] == file_type and status["model_file"]["quantized_to"] is None
            assert not (tmp_path_factory.getbasetemp() / f"cache-{file_type}-as-is").exists()  # never requantized
            exact = status["exact"]
            assert exact["resume_exact"] is True and not exact["why"], exact
            assert exact["hetero_equals_cpu"] is (True if mode == "hetero" else None), exact
            decoders = [w for w in status["workers"] if w["name"].startswith(("cpu", "decode"))]
            assert decoders and all(w["exact_decode"] and not w["lone_padding"] and w["speculative_tokens"] > 0
                                    for w in decoders), decoders
            answers[mode] = answer_all(d)
        finally:
            assert d.stop() == 0, d.log()
    assert [n for _, n, _ in answers["cpu"]] == [128] * len(answers["cpu"])
    assert_same(answers["hetero"], answers["cpu"], f"{file_type} as it is: hetero against cpu mode")


def test_a_ring_too_small_for_one_prompt_of_n_ctx_tokens_is_said_at_start(default_model, caplog):
    """A handoff record must fit the ring whole: the plan says so when a prompt of n_ctx tokens would not (the seed's
    32B model's 2,048 tokens are 512 MiB, past the default 256)."""
    import logging

    from syshaxd.engine.plan import _warn_if_the_ring_is_small

    from syshaxd.sdk.gguf.header import fingerprint_from_gguf
    from syshaxd.sdk.kv.record import DType, record_size
    from syshaxd.sdk.kv.ring import RECORD_HEADER

    # the record as the ring takes it: its header, tokens, positions and the f16 K and V (SmolLM2-135M: 30 layers,
    # 3 KV heads of 64, 23,040 bytes a token), not the KV alone
    need = RECORD_HEADER + record_size(fingerprint_from_gguf(default_model), 4096, DType.F16)
    assert need > 2 * 30 * 3 * 64 * 2 * 4096
    with caplog.at_level(logging.WARNING, logger="syshaxd.engine.plan"):
        _warn_if_the_ring_is_small(default_model, need, 4096)
        assert not caplog.records
        _warn_if_the_ring_is_small(default_model, need - 1, 4096)
    (said,) = caplog.records
    assert "holds the KV of a prompt of at most 4095 tokens" in said.getMessage()
    assert f"ring_size_mb = {-(-need >> 20)} holds one of n_ctx tokens" in said.getMessage()
