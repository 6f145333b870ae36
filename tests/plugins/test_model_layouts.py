"""What a model keeps beside one plain KV cache (sliding-window layers, a recurrent state, MLA's compressed KV) is read
from its GGUF header as llama.cpp reads it, and what an engine on the way cannot carry (torch and vLLM take K and V
rows per head; llama.cpp's engines move a sequence's whole state) is refused at start by the plan, naming the model
and what to do: the daemon exits with status 2, as systemd shows it, never answers 503 after a worker
refused the model.

The models are tiny real ones of each layout (tests/families.py, written by llama.cpp's own converter): gemma 2, 3
and 4 and gpt-oss (sliding windows), DeepSeek V3 (deepseek2, MLA), LFM2, Qwen 3.5 and its MoE, Nemotron-H (hybrids:
short-convolution, gated delta-net and Mamba2 layers beside attention), Mamba (recurrent only), and phi 3, whose file
carries a window llama.cpp does not use.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest

from conftest import MODEL_DIR, MODEL_NAME
from families import make_family_model
from syshax_llamacpp.codec import StateShape

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
    "gemma4": KVLayout("gemma4", 64, False, False),
    "gpt-oss": KVLayout("gpt-oss", 64, False, False),
    "deepseek3": KVLayout("deepseek2", 0, False, True),
    "lfm2": KVLayout("lfm2", 0, True, False),
    "qwen35": KVLayout("qwen35", 0, True, False),
    "qwen35moe": KVLayout("qwen35moe", 0, True, False),
    "nemotron_h": KVLayout("nemotron_h_moe", 0, True, False),
    "mamba": KVLayout("mamba", 0, True, False),
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


@pytest.mark.parametrize("family", ["lfm2", "qwen35", "mamba"])
def test_a_model_with_a_recurrent_state_is_refused_where_an_engine_other_than_llama_cpp_is_on_the_way(family):
    path = _model(family)
    for mode, backend in (("hetero", "torch"), ("auto", "vllm"), ("gpu", "vllm")):
        with pytest.raises(PlanError) as refused:
            plan_engines(dataclasses.replace(_config(mode), prefill_engine=backend), path, MODEL_NAME, {},
                         instance="plan-only")
        says = str(refused.value)
        assert says.startswith(f"{mode} mode: {path.name} is a {LAYOUTS[family].arch} model whose recurrent state "
                               f"prefill_engine {backend} does not carry"), says
        assert 'serve it in cpu mode (--mode cpu), or with llama.cpp engines ("llamacpp")' in says, says
    # cpu mode serves it, without the prefix cache's blocks (a recurrent state stands for all its tokens, not blocks
    # of them): each worker keeps whole states after prompts instead, within prefix_cache_mb
    planned = plan_engines(_config("cpu"), path, MODEL_NAME, {}, instance="plan-only")
    assert planned.workers and planned.prefix is None and planned.ring is None
    assert {(spec.prefix_store, spec.keep_generated, spec.state_checkpoints_mb)
            for _, spec in planned.workers} == {("", False, Config().prefix_cache_mb)}
    off = plan_engines(dataclasses.replace(_config("cpu"), prefix_cache_mb=0), path, MODEL_NAME, {}, instance="p")
    assert {spec.state_checkpoints_mb for _, spec in off.workers} == {0}
    # llama.cpp's prefill engine hands its decoders the whole state (a KV record of llama.cpp's own state)
    hetero = plan_engines(_config("hetero"), path, MODEL_NAME, {}, instance="plan-only")
    assert hetero.ring is not None and {spec.backend for _, spec in hetero.workers} == {"llamacpp"}


@pytest.mark.parametrize("family, why", [("gemma2", "whose sliding-window layers keep a second KV cache"),
                                         ("gpt-oss", "whose sliding-window layers keep a second KV cache"),
                                         ("deepseek3", "with multi-head latent attention (MLA), whose compressed KV")])
def test_a_layout_torch_and_vllm_do_not_carry_is_refused_with_them_and_served_by_llama_cpp(family, why):
    path = _model(family)
    for mode, backend in (("hetero", "torch"), ("auto", "vllm")):
        with pytest.raises(PlanError) as refused:
            plan_engines(dataclasses.replace(_config(mode), prefill_engine=backend), path, MODEL_NAME, {},
                         instance="plan-only")
        says = str(refused.value)
        assert says.startswith(f"{mode} mode: {path.name} is a {LAYOUTS[family].arch} model {why}"), says
        assert f"prefill_engine {backend} does not carry; serve it in cpu mode (--mode cpu)" in says, says
    # cpu mode serves it, without the prefix cache's blocks (they carry K and V rows per head of one cache): whole
    # states after prompts instead
    planned = plan_engines(_config("cpu"), path, MODEL_NAME, {}, instance="plan-only")
    assert planned.workers and planned.prefix is None and planned.ring is None
    assert {(spec.prefix_store, spec.keep_generated, spec.state_checkpoints_mb)
            for _, spec in planned.workers} == {("", False, Config().prefix_cache_mb)}
    assert plan_engines(_config("hetero"), path, MODEL_NAME, {}, instance="plan-only").ring is not None


def test_a_plain_model_keeps_its_prefix_cache_in_cpu_mode(default_model):
    planned = plan_engines(_config("cpu"), default_model, MODEL_NAME, {}, instance="plan-only")
    assert planned.prefix is not None and {spec.prefix_store for _, spec in planned.workers} == {"plan-only"}


@pytest.mark.parametrize("family", ["lfm2", "qwen35", "gpt-oss", "deepseek3"])
def test_a_decode_node_refuses_what_the_handoff_does_not_carry(family):
    path = _model(family)
    with pytest.raises(PlanError, match=f"a decode node: {path.name} is a {LAYOUTS[family].arch} model"):
        plan_node(dataclasses.replace(Config(), mode="hetero"), path, MODEL_NAME, {}, instance="plan-only")


# --- the daemon: exit status 2 and the reason -------------------------------------------------------------------


@pytest.mark.parametrize("family, mode, says", [
    ("qwen35", "hetero", "is a qwen35 model whose recurrent state prefill_engine torch does not carry"),
    ("gpt-oss", "auto", "is a gpt-oss model whose sliding-window layers keep a second KV cache that prefill_engine "
                        "torch does not carry"),
])
def test_the_daemon_exits_with_status_2_and_the_reason(family, mode, says, tmp_path):
    path = _model(family)
    config = tmp_path / "syshax.toml"
    config.write_text('prefill_engine = "torch"\n')
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--config", str(config), "--model", str(path), "--mode",
                           mode, "--port", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{mode} mode: {path.name} {says}" in done.stderr, done.stderr
    assert "Worker" not in done.stderr and "worker" not in done.stderr  # refused before any worker started


# --- the state: what llama.cpp writes for one sequence, moved whole between contexts -------------------------------


@pytest.mark.parametrize("family, shape", [
    ("llama", StateShape(None, False, False)),
    ("gemma3", StateShape(None, False, False)),  # two KV caches, found by reading them (state_sections)
    ("lfm2", StateShape(1, False, True)),
    ("qwen35", StateShape(1, True, True)),  # M-RoPE: 12 more bytes per KV cell
    ("mamba", StateShape(0, False, True)),  # no KV cache at all
])
def test_a_sequences_state_moves_whole_into_any_stream_of_the_batch_context(family, shape):
    """What the engine does with every prompt: its state exported from a 1-sequence context, re-addressed for a context
    of 4 streams (codec.widen_streams, which must leave a recurrent state as it is and find each KV cache's part), set
    into stream 2 there, and the next token decoded in both contexts: the very same logits."""
    import ctypes

    import llama_cpp
    import numpy as np
    from syshax_llamacpp.codec import StateBuffer, export_seq, shape_of, widen_streams
    from syshax_llamacpp.contexts import add_row

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(_model(family)).encode(), llama_cpp.llama_model_default_params())
    contexts, batch = [], llama_cpp.llama_batch_init(64, 0, 1)
    try:
        assert shape_of(model) == shape

        def context(n_seq: int):
            p = llama_cpp.llama_context_default_params()
            p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 128 * n_seq, 64, 64, n_seq
            p.kv_unified, p.flash_attn_type, p.n_threads, p.n_threads_batch = False, 1, 1, 1
            contexts.append(llama_cpp.llama_init_from_model(model, p))
            return contexts[-1]

        def next_logits(ctx, seq_id: int, pos: int) -> np.ndarray:
            batch.n_tokens = 0
            add_row(batch, 77, pos, seq_id, True)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, 0), (n_vocab,)).copy()

        alone, wide = context(1), context(4)
        prompt = [(11 + 37 * i) % 1000 for i in range(40)]
        for pos, token in enumerate(prompt):
            add_row(batch, token, pos, 0, pos == len(prompt) - 1)
        assert llama_cpp.llama_decode(alone, batch) == 0
        scratch = StateBuffer()
        size = llama_cpp.llama_state_seq_get_size(alone, 0)
        buf = scratch.ensure(size + 8 * 4)
        export_seq(alone, 0, scratch)
        size = widen_streams(buf, size, 4, shape)
        got = llama_cpp.llama_state_seq_set_data(wide, ctypes.cast(buf.ctypes.data, ctypes.POINTER(ctypes.c_uint8)),
                                                 size, 2)
        assert got == size
        assert np.array_equal(next_logits(wide, 2, len(prompt)), next_logits(alone, 0, len(prompt)))
    finally:
        llama_cpp.llama_batch_free(batch)
        for ctx in contexts:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def test_a_recurrent_state_the_codec_does_not_know_is_refused_by_name():
    """A state whose recurrent part is not one sequence's (a whole-context export) is a StateFormatError: the warm-up
    fails with it, as the model's, never blamed on the kernels."""
    import numpy as np
    from syshax_llamacpp.codec import STATE_MAGIC, StateFormatError, StateShape, state_sections

    state = np.frombuffer(np.array([STATE_MAGIC, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 2], np.uint32).tobytes(), np.uint8)
    with pytest.raises(StateFormatError, match="a recurrent state of 3 cells"):
        state_sections(state, len(state), StateShape(0, False, True))
