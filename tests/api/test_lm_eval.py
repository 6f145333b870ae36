"""lm-evaluation-harness's `local-completions` model against a real syshaxd, offline.

Two tiny tasks are written into a temporary folder with their data (json lines): a multiple_choice
task (lm-eval asks loglikelihoods: echo + logprobs + max_tokens 1, batched prompts of token ids) and a
generate_until task. lm-eval tokenizes through the daemon (/tokenizer_info, /tokenize: its `remote`
backend), so nothing comes from a hub. Each item's loglikelihood must equal the sum of the
continuation's token logprobs from a plain llama-cpp-python forward pass over the same GGUF, within
LL_TOL: 1e-3 per token (the daemon's and a lone forward pass's rounding) times the continuation's
length, at most a few tokens here.
"""

from __future__ import annotations

import json

import pytest

from conftest import MODEL_NAME, STOCK_ATTENTION

# the reference is llama-cpp-python in this process: the daemon takes its attention (conftest.py)
DAEMON_CONFIG = STOCK_ATTENTION

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extras: pip install -e .[test]")

pytestmark = pytest.mark.slow

PER_TOKEN_TOL = 1e-3

MC = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "seven"], "answer": 0},
    {"question": "The colour of the clear sky is", "choices": ["green", "blue"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "Fahrenheit"], "answer": 0},
]
GEN = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: What is two plus two?\nA:", "answer": " 4"},
    {"question": "Q: What colour is grass?\nA:", "answer": " Green"},
]

MC_YAML = """task: syshax_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_YAML = """task: syshax_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _write_tasks(folder) -> None:
    for name, items, yaml in (("mc", MC, MC_YAML), ("gen", GEN, GEN_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items))
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))


def test_lm_eval_local_completions_matches_a_forward_pass(daemon, default_model, tmp_path, monkeypatch):
    import llama_cpp
    import numpy as np
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    _write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{daemon.base_url}/completions", "model": MODEL_NAME, "tokenizer_backend": "remote",
                    "tokenized_requests": True, "batch_size": 4, "num_concurrent": 1, "max_retries": 1},
        tasks=["syshax_mc", "syshax_gen"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
    )
    assert "acc,none" in results["results"]["syshax_mc"]
    assert "exact_match,none" in results["results"]["syshax_gen"]
    generated = [s["resps"][0][0] for s in results["samples"]["syshax_gen"]]
    assert len(generated) == len(GEN) and all(isinstance(g, str) for g in generated)

    llm = llama_cpp.Llama(str(default_model), n_ctx=512, logits_all=True, verbose=False, n_threads=1,
                          flash_attn=True)
    try:
        checked = 0
        for sample in results["samples"]["syshax_mc"]:
            item = sample["doc"]
            for choice, resp in zip(item["choices"], sample["resps"]):
                loglikelihood = resp[0][0]
                context = llm.tokenize(item["question"].encode(), add_bos=False, special=True)
                continuation = llm.tokenize((" " + choice).encode(), add_bos=False, special=True)
                tokens = context + continuation
                llm.reset()
                llm.eval(tokens)
                scores = np.array(llm.scores[: len(tokens)], dtype=np.float64)
                shifted = scores - scores.max(axis=1, keepdims=True)
                lp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
                expected = sum(lp[i - 1, tokens[i]] for i in range(len(context), len(tokens)))
                assert abs(loglikelihood - expected) < PER_TOKEN_TOL * len(continuation), (item, choice)
                checked += 1
        assert checked == sum(len(item["choices"]) for item in MC)
    finally:
        llm.close()
