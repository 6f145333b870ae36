"""What a model keeps beside one plain KV cache (sliding-window layers, a recurrent state, MLA's compressed KV) is read
from its GGUF header as llama.cpp reads it, and what the engines cannot carry is refused at start by the plan, naming
the model and what to do: the daemon exits with status 2, as systemd shows it, never answers 503 after a worker
refused the model.

The models are tiny real ones of each layout (tests/families.py, written by llama.cpp's own converter): gemma 2 and 3
and gpt-oss (sliding windows), DeepSeek V3 (deepseek2, MLA), LFM2 (a hybrid: short-convolution layers), and phi 3,
whose file carries a window llama.cpp does not use.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest

from conftest import MODEL_DIR, MODEL_NAME
from families import make_family_model

from syshaxd.config import Config
from syshaxd.engine.plan import PlanError, plan_engines, plan_node
from syshaxd.sdk.gguf.header import read_gguf_header
from syshaxd.sdk.gguf.layout import KVLayout, kv_layout, layout_of


def _model(family: str):
    return make_family_model(family, MODEL_DIR / "families")


# family -> its layout as the spec makes it (tests/families.py)
LAYOUTS = {
    "llama": KVLayout("llama", 0, False, False),
    "phi3": KVLayout("phi3", 0, False, False),  # sliding_window 2047 in the file: "Phi SWA is currently disabled"
    "gemma2": KVLayout("gemma2", 64, False, False),
    "gemma3": KVLayout("gemma3", 64, False, False),
    "gpt-oss": KVLayout("gpt-oss", 64, False, False),
    "deepseek3": KVLayout("deepseek2", 0, False, True),
    "lfm2": KVLayout("lfm2", 0, True, False),
}


def _llama_cpp_says(path) -> tuple[int, bool]:
    """The loaded model's sliding window and whether it keeps a recurrent state, in llama.cpp's own words."""
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    try:
        return (llama_cpp.llama_model_n_swa(model),
                bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)))
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_the_header_says_what_llama_cpp_keeps_per_sequence(family):
    path = _model(family)
    layout = kv_layout(path)
    assert layout == LAYOUTS[family]
    assert layout.plain == (family in ("llama", "phi3"))
    assert _llama_cpp_says(path) == (layout.sliding_window, layout.recurrent)
    if family == "phi3":
        assert read_gguf_header(path)[0]["phi3.attention.sliding_window"] == 2047


def test_architectures_not_made_here_are_read_as_llama_cpp_reads_them():
    # llama.cpp's recurrent and hybrid lists (llm_arch_is_recurrent / _is_hybrid), without any state key
    for arch in ("qwen35", "qwen35moe", "qwen3next", "mamba", "rwkv7", "granitehybrid", "nemotron_h"):
        assert layout_of({"general.architecture": arch}).recurrent, arch
    # an architecture newer than those lists, known by its state's keys
    assert layout_of({"general.architecture": "newssm", "newssm.ssm.state_size": 16}).recurrent
    assert not layout_of({"general.architecture": "llama", "llama.attention.head_count": 8}).recurrent
    # windows llama.cpp takes without the key (Gemma 2's 4096, Llama 4's chunks) or ignores with it
    assert layout_of({"general.architecture": "gemma2"}).sliding_window == 4096
    assert layout_of({"general.architecture": "llama4"}).sliding_window == 8192
    assert layout_of({"general.architecture": "llama4", "llama4.attention.sliding_window": 0}).sliding_window == 0
    assert layout_of({"general.architecture": "phi3", "phi3.attention.sliding_window": 2047}).sliding_window == 0
    assert layout_of({"general.architecture": "deepseek2", "deepseek2.attention.kv_lora_rank": 512}).mla


# --- the plan: refused at start, by name --------------------------------------------------------------------------


def _config(mode: str) -> Config:
    return Config(mode=mode, prefill_cpu_affinity="0")


@pytest.mark.parametrize("mode", ["cpu", "hetero", "auto", "gpu"])
def test_a_model_with_a_recurrent_state_is_refused_in_every_mode(mode):
    path = _model("lfm2")
    with pytest.raises(PlanError) as refused:
        plan_engines(_config(mode), path, MODEL_NAME, {}, instance="plan-only")
    says = str(refused.value)
    assert says.startswith(f"{mode} mode: {path.name} is a lfm2 model, whose recurrent state"), says
    assert "serve a transformer model" in says and "llama-server" in says, says


@pytest.mark.parametrize("family, why", [("gemma2", "sliding-window layers keep a second KV cache"),
                                         ("gpt-oss", "sliding-window layers keep a second KV cache"),
                                         ("deepseek3", "multi-head latent attention (MLA), whose compressed KV")])
def test_a_layout_the_handoff_does_not_carry_is_refused_in_hetero_and_auto_and_served_in_cpu_mode(family, why):
    path = _model(family)
    for mode in ("hetero", "auto"):
        with pytest.raises(PlanError) as refused:
            plan_engines(_config(mode), path, MODEL_NAME, {}, instance="plan-only")
        says = str(refused.value)
        assert says.startswith(f"{mode} mode: {path.name} is a {LAYOUTS[family].arch} model"), says
        assert why in says and "serve it in cpu mode (--mode cpu)" in says, says
    # cpu mode serves it, without the prefix cache: its blocks carry K and V rows per head of one cache
    planned = plan_engines(_config("cpu"), path, MODEL_NAME, {}, instance="plan-only")
    assert planned.workers and planned.prefix is None and planned.ring is None
    assert {(spec.prefix_store, spec.keep_generated) for _, spec in planned.workers} == {("", False)}


def test_a_plain_model_keeps_its_prefix_cache_in_cpu_mode(default_model):
    planned = plan_engines(_config("cpu"), default_model, MODEL_NAME, {}, instance="plan-only")
    assert planned.prefix is not None and {spec.prefix_store for _, spec in planned.workers} == {"plan-only"}


@pytest.mark.parametrize("family", ["lfm2", "gpt-oss", "deepseek3"])
def test_a_decode_node_refuses_what_the_handoff_does_not_carry(family):
    path = _model(family)
    with pytest.raises(PlanError, match=f"a decode node: {path.name} is a {LAYOUTS[family].arch} model"):
        plan_node(dataclasses.replace(Config(), mode="hetero"), path, MODEL_NAME, {}, instance="plan-only")


# --- the daemon: exit status 2 and the reason -------------------------------------------------------------------


@pytest.mark.parametrize("family, mode, says", [
    ("lfm2", "cpu", "is a lfm2 model, whose recurrent state this engine cannot move between its contexts yet"),
    ("gpt-oss", "hetero", "is a gpt-oss model, whose sliding-window layers keep a second KV cache"),
])
def test_the_daemon_exits_with_status_2_and_the_reason(family, mode, says, tmp_path):
    path = _model(family)
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--model", str(path), "--mode", mode, "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{mode} mode: {path.name} {says}" in done.stderr, done.stderr
    assert "Worker" not in done.stderr and "worker" not in done.stderr  # refused before any worker started
