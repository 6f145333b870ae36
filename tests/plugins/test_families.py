"""Every family llama.cpp serves, in cpu mode and in hetero: a tiny random-weight model of each (tests/families.py,
written by llama.cpp's own converter), given as the F16 file a user converts, quantized to q4_0 at first load.

* cpu mode serves each: several greedy chats at once, every answer its full length, and the warm-up proves the
  exact promises (a decode step gives a prompt chunk's bits) at head sizes 64, 96, 128 and 256, with MoE layers,
  q/k norms, QKV biases and sliding-window layers.
* hetero (a llama.cpp prefill worker handing each prompt's KV to a decoder over the ring) returns cpu mode's tokens
  for every family whose KV the record carries; a family with sliding-window layers (gemma 2 and 3) is refused at
  start, naming the family, never served with wrong tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import MODEL_DIR, MODEL_NAME, start_daemon
from families import FAMILIES, make_family_model
from greedy import CHATS, answer, client_of

from syshaxd.sdk.gguf.layout import kv_layout

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
# chats without a system message: Gemma's templates refuse one
FAMILY_CHATS = [c for c in CHATS if all(m["role"] != "system" for m in c)]
BASE = {"model_name": MODEL_NAME, "n_ctx": 512}


def _model(family: str):
    return make_family_model(family, MODEL_DIR / "families")


def _answers(daemon) -> list[tuple[str, int, str]]:
    client = client_of(daemon)
    with concurrent.futures.ThreadPoolExecutor(len(FAMILY_CHATS)) as pool:
        futures = [pool.submit(answer, client, m, i % 2 == 1, None, MAX_TOKENS) for i, m in enumerate(FAMILY_CHATS)]
        return [f.result() for f in futures]


def _serve(tmp_path_factory, family: str, mode: str):
    config = {"model": str(_model(family)), "model_dir": str(tmp_path_factory.getbasetemp() / f"cache-{family}"),
              "mode": mode, **BASE}
    return start_daemon(tmp_path_factory.mktemp(f"{family}-{mode}"),
                        config | ({"prefill_cpu_affinity": "0"} if mode == "hetero" else {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_serves_in_cpu_mode_and_hetero_returns_its_tokens(family, tmp_path_factory):
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        status = cpu.status()
        assert status["model_file"]["file_type"] == "F16" and status["model_file"]["quantized_to"] == "q4_0"
        # the quantized copy's output matrix is q8_0, whose products are exact: the promises hold in every family
        assert status["exact"] == {"hetero_equals_cpu": None, "resume_exact": True, "why": []}, status["exact"]
        reference = _answers(cpu)
        assert [(n, f) for _, n, f in reference] == [(MAX_TOKENS, "length")] * len(FAMILY_CHATS)
        _tool_turns_render_and_parse(cpu)
    finally:
        assert cpu.stop() == 0, cpu.log()
    if family.startswith("gemma"):  # its KV records carry llama.cpp's whole state: two KV caches
        assert kv_layout(_model(family)).sliding_window == 64  # the spec's window, read from the header
    hetero = _serve(tmp_path_factory, family, "hetero")
    try:
        assert hetero.status()["exact"]["hetero_equals_cpu"] is True, hetero.status()["exact"]
        got = _answers(hetero)
    finally:
        assert hetero.stop() == 0, hetero.log()
    differ = [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]
    assert not differ, f"{family}: hetero gave {len(got) - len(differ)} of {len(got)} of cpu mode's texts; chat " \
                       f"{differ[0]}:\ngot      {got[differ[0]]!r}\nexpected {reference[differ[0]]!r}"


@pytest.mark.parametrize("family", ["gemma4", "gpt-oss", "deepseek3"])
def test_sliding_window_and_mla_families_serve_exactly_in_cpu_mode(family, tmp_path_factory):
    """gemma 4 (sliding windows, a wider global layer, per-layer input embeddings), gpt-oss (sliding windows beside full
    layers, attention sinks, MoE) and DeepSeek V3 (MLA: one compressed row per token and layer, no V) serve in cpu
    mode, without the prefix cache's blocks (whole-state checkpoints instead), and every worker proves its promises
    there
    (the codec reads MLA's state, whose K rows end it: codec.state_sections). In hetero the prefill engine hands its
    decoders llama.cpp's whole state of each prompt (a KV record of FLAG_LLAMA_STATE), and they return cpu mode's
    tokens (tests/plugins/test_model_layouts.py covers the refusals where torch or vLLM is on the way)."""
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        status = cpu.status()
        assert status["exact"] == {"hetero_equals_cpu": None, "resume_exact": True, "why": []}, status["exact"]
        assert status["prefix_cache"] is None, status["prefix_cache"]
        got = _answers(cpu)
        assert [(n, f) for _, n, f in got] == [(MAX_TOKENS, "length")] * len(FAMILY_CHATS)
        again = _answers(cpu)  # the same chats again, each beside others: the same tokens
        assert again == got
    finally:
        assert cpu.stop() == 0, cpu.log()
    assert _hetero_answers(tmp_path_factory, family, _answers) == got


# llama-cpp-python in a process of its own, each prompt alone in one context: the reference a recurrent model's
# served tokens are held to (its llama.cpp takes the daemon's attention and kernels: SYSHAX_FA_TILED, GGML_CPU_TILED_MM)
LLAMA_ALONE = """
import ctypes, json, sys
import llama_cpp, numpy as np
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=2, flash_attn=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm.model)
def piece(t):  # llama-cpp-python's detokenize gives b"" for a piece over 32 bytes (SmolLM2's runs of spaces)
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(vocab, t, buf, 512, 0, False)
    return buf.raw[:max(n, 0)]
out = []
for p in json.loads(sys.argv[2]):  # a text, or token ids
    llm.reset()
    llm.eval(p if isinstance(p, list) else llm.tokenize(p.encode(), special=True))
    ids = []
    while len(ids) < int(sys.argv[3]):
        t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), (llm.n_vocab(),))))
        if llama_cpp.llama_vocab_is_eog(vocab, t):
            break
        ids.append(t)
        llm.eval([t])
    out.append(b"".join(piece(t) for t in ids).decode("utf-8", "replace"))
print(json.dumps(out))
"""
STAGGERED_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
                     "Les fleurs du mal est", "Q: What is the largest planet?\nA:"]


@pytest.mark.parametrize("family", ["lfm2", "qwen35", "qwen35moe", "nemotron_h", "mamba"])
def test_recurrent_families_serve_in_cpu_mode_with_llama_cpps_own_tokens(family, tmp_path_factory):
    """LFM2 (short convolutions beside attention), Qwen 3.5 and its MoE (gated delta-net beside attention, M-RoPE's
    cell extension), Nemotron-H (Mamba2 and MoE layers beside attention) and Mamba (recurrent only, no KV cache) serve
    in cpu mode with continuous batching: each prompt's state, its recurrent part whole, moves from the prompt context
    into a stream of the batch context (codec.widen_streams), and requests arriving while others decode get the very
    text llama.cpp gives each prompt alone in one context. There are no prefix-cache blocks (a recurrent state stands
    for all its tokens, not blocks of them: whole-state checkpoints instead) and no speculation (a refused guess
    cannot leave a recurrent state). In hetero the prefill engine hands each prompt's whole state on as a KV record,
    and the decoders return the same texts."""
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        status = cpu.status()
        assert status["exact"] == {"hetero_equals_cpu": None, "resume_exact": True, "why": []}, status["exact"]
        assert status["prefix_cache"] is None, status["prefix_cache"]
        assert {w["speculative_tokens"] for w in status["workers"]} == {0}
        got = _staggered(cpu)
        stats = cpu.status()["workers"][0]["stats"]
        assert stats["steps"] < len(STAGGERED_PROMPTS) * MAX_TOKENS / 2, stats  # they shared decode steps
        # the q4_0 copy the daemon made at first load (its model_dir, _serve's)
        quantized = next((tmp_path_factory.getbasetemp() / f"cache-{family}").glob("*.q4_0.gguf"))
    finally:
        assert cpu.stop() == 0, cpu.log()
    alone = _llama_alone(quantized, STAGGERED_PROMPTS)
    assert all(alone), alone  # each prompt gave text, or the comparison would prove little
    differ = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
    assert not differ, f"{family}: prompt {differ[0]}:\nserved {got[differ[0]]!r}\nalone  {alone[differ[0]]!r}"
    assert _hetero_answers(tmp_path_factory, family, _staggered) == got


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_a_mixture_of_experts_picks_a_sequences_experts_alone_or_beside_others(family, tmp_path_factory):
    """A mixture of experts routes each token by an f32 matmul (ffn_gate_inp, which the quantizer keeps in f32): with
    mk/patches 0016 a lone row takes the kernel several rows take, so a sequence's router logits, its experts and its
    text are the ones llama.cpp gives its prompt alone, whoever shares its decode steps (qwen3moe parted from its
    alone text on one prompt in six without it)."""
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        got = _staggered(cpu)
        quantized = next((tmp_path_factory.getbasetemp() / f"cache-{family}").glob("*.q4_0.gguf"))
    finally:
        assert cpu.stop() == 0, cpu.log()
    alone = _llama_alone(quantized, STAGGERED_PROMPTS)
    differ = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
    assert not differ, f"{family}: prompt {differ[0]}:\nserved {got[differ[0]]!r}\nalone  {alone[differ[0]]!r}"


def _staggered(daemon) -> list[str]:
    """STAGGERED_PROMPTS' greedy completions, sent 30 ms apart: each joins a batch already decoding."""
    client = client_of(daemon)

    def ask(i: int) -> str:
        time.sleep(0.03 * i)
        return client.completions.create(model=MODEL_NAME, prompt=STAGGERED_PROMPTS[i], max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(STAGGERED_PROMPTS)) as pool:
        return list(pool.map(ask, range(len(STAGGERED_PROMPTS))))


def _hetero_answers(tmp_path_factory, family: str, answers):
    """answers(daemon) from a hetero daemon whose llama.cpp prefill engine hands every prompt on as a KV record of
    llama.cpp's whole state; each handed over and imported, none recomputed."""
    hetero = _serve(tmp_path_factory, family, "hetero")
    try:
        assert hetero.status()["exact"]["hetero_equals_cpu"] is True, hetero.status()["exact"]
        got = answers(hetero)
        kv = hetero.status()["kv"]
    finally:
        assert hetero.stop() == 0, hetero.log()
    assert kv["records_written"] >= 5 and kv["records_read"] == kv["records_written"], kv
    return got


def _llama_alone(model, prompts: list) -> list[str]:
    """Each prompt's greedy text from llama-cpp-python alone (LLAMA_ALONE), with the daemon's attention and kernels."""
    run = subprocess.run([sys.executable, "-c", LLAMA_ALONE, str(model), json.dumps(prompts), str(MAX_TOKENS)],
                         env=os.environ | {"SYSHAX_FA_TILED": "1", "GGML_CPU_TILED_MM": "0"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen35", "mamba", "gemma4", "gpt-oss", "deepseek3"])
def test_a_prompt_resumes_from_the_whole_state_of_one_it_starts_with(family, tmp_path_factory):
    """A model whose KV the prefix cache's blocks do not carry (a recurrent state, sliding-window layers, MLA) reuses
    prompts from whole-state checkpoints (checkpoints.py), as an agent's next turn repeats its last: the next prompt
    starts from the state after the last one, says so in its usage, and gets the very text llama.cpp gives it computed
    whole."""
    first = [100 + (7 + 31 * i) % 1000 for i in range(150)]  # token ids: longer than gpt-oss's window (64)
    turn = first + [100 + (11 + 17 * i) % 1000 for i in range(40)]
    cpu = _serve(tmp_path_factory, family, "cpu")
    try:
        assert {w["state_checkpoints_mb"] for w in cpu.status()["workers"]} == {512}
        client = client_of(cpu)

        def complete(prompt: list[int]):
            return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)

        assert complete(first).usage.prompt_tokens_details.cached_tokens == 0
        client.completions.create(model=MODEL_NAME, prompt="A side request between turns", max_tokens=4)
        again = complete(turn)
        assert again.usage.prompt_tokens_details.cached_tokens == len(first)
        # the worker set the state into its prompt context (its counter, reported every STATS_INTERVAL)
        deadline = time.monotonic() + 10
        while cpu.status()["workers"][0]["stats"]["cached_tokens"] != len(first) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cpu.status()["workers"][0]["stats"]["cached_tokens"] == len(first)
        quantized = next((tmp_path_factory.getbasetemp() / f"cache-{family}").glob("*.q4_0.gguf"))
    finally:
        assert cpu.stop() == 0, cpu.log()
    (whole,) = _llama_alone(quantized, [turn])
    assert whole and again.choices[0].text == whole


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}


def _tool_turns_render_and_parse(daemon) -> None:
    """Through the family's own template: a forced call comes back as a call, and a conversation holding a call and
    its result (the id as OpenAI makes it, which Mistral's template would refuse) renders and is answered."""
    client = client_of(daemon)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=[WEATHER], tool_choice="required",
                                         max_tokens=48, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason in ("tool_calls", "length")
    turns = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_8f2a1c9d7e6b5a4f3e2d1c0b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_8f2a1c9d7e6b5a4f3e2d1c0b", "content": '{"celsius": 18}'}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=turns, tools=[WEATHER], max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8


# --- the cross-engine codec: a torch prefill engine's KV decoded by llama.cpp -----------------------------------

@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral", "phi3"])
def test_torch_prefill_hands_each_proven_family_on_teacher_forced(family, tmp_path):
    """The torch engine's record, imported into the llama.cpp decoder, gives the decoder's own next-token
    distributions: judged teacher-forced (random weights make near-ties common, hence 85 %, where the default model
    gets 95 %), per family whose K layout and rope the codec knows (head_dim 128 with GQA, n_head * head_dim !=
    n_embd, q/k norms, llama 3 rope scaling, fused QKV)."""
    pytest.importorskip("transformers")
    import uuid

    from teacher_forced import Decoder, judge
    from test_torch_prefill import instance_of, records_of

    from syshax_torch.engine import TorchPrefillEngine
    from syshaxd.sdk.gguf.quantize import ensure_quantized
    from syshaxd.sdk.kv.ring import KVRing
    from syshaxd.sdk.types import EngineSpec

    source, cache = _model(family), MODEL_DIR / "families"
    ring = KVRing.create(f"test-fam-{uuid.uuid4().hex[:8]}", 64 << 20)
    engine = TorchPrefillEngine(EngineSpec(backend="torch", role="prefill", model_path=str(source), model_name="m",
                                           n_ctx=512, threads=2, ring=instance_of(ring), quantize="q4_0",
                                           cache_dir=str(cache)))
    decoder = Decoder(ensure_quantized(source, "q4_0", cache))
    try:
        good, _ = judge(decoder, records_of(engine, ring))
        print(f"\n{family}: torch prefill -> llama.cpp decode, teacher-forced: {good}")
        assert good.steps == 150 and good.agreement >= 0.85 and good.mean_kl <= 0.005, good
    finally:
        engine.close()
        decoder.close()
        ring.unlink()
        ring.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_hetero_with_a_torch_engine_refuses_a_family_its_codec_does_not_know(family, tmp_path_factory):
    """mixtral's experts came back as garbage served with 200 (20 % top-1), qwen3moe's failed to load: both are
    refused at start, naming the family, and pointed at the llama.cpp prefill engine, which serves them."""
    with pytest.raises(RuntimeError) as refused:
        start_daemon(tmp_path_factory.mktemp(f"{family}-torch"),
                     {"model": str(_model(family)), "mode": "hetero", "prefill_engine": "torch", **BASE})
    message = str(refused.value)
    assert "prefill_engine torch" in message and 'prefill_engine = "llamacpp"' in message, message
    assert ("mixture of 4 experts" if family == "mixtral" else "is a qwen3moe model") in message


# each family's own tool-call format, as its real template writes an assistant's call: read back as that call
TOOL_TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": ("<|im_start|>assistant\n", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("<|im_start|>assistant\n", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("[/INST]", "</s>"),
}


@pytest.mark.parametrize("template", sorted(TOOL_TEMPLATES))
def test_a_call_in_the_familys_own_format_is_read_back_as_that_call(template):
    from families import llama_source

    from syshaxd.api.core.tools import parse_output, parse_tools
    from syshaxd.sdk.gguf.chat import ChatTemplate

    opens, closes = TOOL_TEMPLATES[template]
    chat = ChatTemplate((llama_source() / "models" / "templates" / template).read_text(), "<s>", closes)
    call = {"id": "call_8f2a1c9d7e6b5a4f3e2d1c0b", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    before = chat.render(ask, [WEATHER])
    after = chat.render(ask + [{"role": "assistant", "content": "", "tool_calls": [call]}], [WEATHER])
    written = after[after.index(opens, len(before) - len(opens) - 8) + len(opens):]
    written = written[:written.index(closes)] if closes in written else written
    content, calls = parse_output(written, parse_tools({"tools": [WEATHER]}))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})], written
    # Qwen3's template writes an empty thinking block before the call: it is what the reasoning parser takes
    assert not (content or "").replace("<think>", "").replace("</think>", "").strip(), content


def test_only_a_template_that_refuses_every_system_turn_gets_it_folded_into_the_first_user_turn():
    """Gemma's template refuses a system turn: its text goes at the head of the first user turn, as Gemma 3's own
    template puts it. Another template's refusal that names the system message (Qwen3.5's "System message must be at
    the beginning.") is the request's mistake, and stays a refusal."""
    from families import llama_source

    from syshaxd.sdk.gguf.chat import ChatTemplate

    templates = llama_source() / "models" / "templates"
    gemma = ChatTemplate((templates / "google-gemma-2-2b-it.jinja").read_text(), "<bos>", "<eos>")
    prompt = gemma.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>" in prompt, prompt
    qwen = ChatTemplate((templates / "Qwen3.5-4B.jinja").read_text(), "", "<|im_end|>")
    with pytest.raises(ValueError, match="System message must be at the beginning"):
        qwen.render([{"role": "user", "content": "Hi!"}, {"role": "system", "content": "Be brief."}])
