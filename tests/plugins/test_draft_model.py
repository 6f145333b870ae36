"""A draft model's guesses (config draft_model; plugins/llamacpp/syshax_llamacpp/draft_model.py) never change a text.

A daemon whose draft is SmolLM2-135M in Q8_0 (the served model is its q4_0: the same vocabulary, other tokens often
enough that guesses are refused as well as kept), checking every guess (SYSHAX_GUESS=always: on any machine,
paying or not), against one that guesses nothing; requests one at a time, since the draft guesses for a sequence
decoding alone. Greedy and seeded texts, logprobs too, are the same. In a child process each: the model as its own draft
keeps its greedy guesses (the draft's KV follows the sequence through kept and refused guesses), a random-weight
draft of the same tokenizer changes nothing either, and a draft of another vocabulary, a missing file or a draft
with speculation off are refused with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MODEL_DIR, MODEL_NAME, model_in, start_daemon
from families import make_family_model
from greedy import CHATS, MAX_TOKENS, answer, assert_same, client_of, worker
from syshaxd.benchmark.copying import copy_chats
from syshaxd.config import Config, ConfigError, from_mapping
from syshaxd.engine.plan import PlanError, plan_engines

pytestmark = pytest.mark.slow

BASE = {"model_name": MODEL_NAME, "n_ctx": 2048}
ONE_BY_ONE = [*CHATS[:3], *copy_chats()[:2]]


@pytest.fixture(scope="module")
def draft(default_model):
    return model_in("Q8_0")


@pytest.fixture(scope="module")
def drafting(default_model, draft, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafting")
    d = start_daemon(tmp, {"model": str(default_model), **BASE, "speculative_tokens": 8, "draft_model": str(draft),
                           "admin_socket": str(tmp / "admin.sock")}, env={"SYSHAX_GUESS": "always"})
    d.socket = tmp / "admin.sock"
    yield d
    assert d.stop() == 0, d.log()


def guesses(daemon) -> tuple[int, int]:
    """The draft's guessed tokens, and those kept."""
    stats = worker(daemon, "cpu0")["stats"]
    return stats["drafted_tokens"], stats["kept_drafts"]


def one_by_one(daemon, chats) -> list[tuple[str, int, str]]:
    client = client_of(daemon)
    return [answer(client, messages, i % 2 == 1, None) for i, messages in enumerate(chats)]


def test_the_status_names_the_draft(drafting, draft):
    assert worker(drafting, "cpu0")["draft_model"] == draft.name
    assert f"draft model {draft.name}: a drafted token takes" in drafting.log()
    shown = subprocess.run([sys.executable, "-m", "syshaxd.cli", "status", "--socket", str(drafting.socket)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"guesses up to 8 tokens a step from {draft.name}" in shown.stdout, shown.stdout
    assert re.search(r"\d+ of \d+ drafted\)", shown.stdout), shown.stdout


def test_greedy_answers_keep_their_text_and_the_drafts_guesses_are_checked(plain, drafting):
    before = guesses(drafting)
    assert_same(one_by_one(drafting, ONE_BY_ONE), one_by_one(plain, ONE_BY_ONE), "a draft's guesses against none")
    guessed, kept = (a - b for a, b in zip(guesses(drafting), before))
    # the draft guesses wherever the lookup has nothing: some kept, some refused
    assert guessed > len(ONE_BY_ONE) * MAX_TOKENS / 2 and 0 < kept < guessed, (guessed, kept)


def test_seeded_samples_keep_their_text_and_logprobs(plain, drafting):
    cases = [(CHATS[1], 1, {}), (ONE_BY_ONE[3], 2, {}), (CHATS[2], 3, {"repetition_penalty": 1.1,
                                                                      "presence_penalty": 0.3})]

    def sampled(daemon, messages, seed, extra):
        out = client_of(daemon).chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=96, temperature=0.8, top_p=0.95, seed=seed,
            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True} | extra)
        return out.choices[0].message.content, [(t.token, t.logprob) for t in out.choices[0].logprobs.content]

    before = guesses(drafting)
    for case in cases:
        assert sampled(drafting, *case) == sampled(plain, *case), case[1:]
    assert guesses(drafting)[1] > before[1]


# --- in one process ------------------------------------------------------------------------------------------------


def generate(model, draft: str, prompts: list[str]) -> dict:
    """draft_runs.py's greedy texts of prompts, every guess checked, and the draft's counts; in a child process:
    a guessing engine tiles its attention, which llama.cpp reads once per process (test_lm_eval.py's reference in
    this one must not)."""
    run = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "draft_runs.py"), str(model), draft,
                          json.dumps(prompts)], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["failures"] == 0, got  # a draft whose KV did not follow the sequence: llama.cpp refuses its positions
    return got


PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works, step by step."]


def test_the_model_as_its_own_draft_keeps_its_greedy_guesses(default_model):
    """Its KV follows the sequence: after each step's kept guesses, and into the next request (another prompt). Its
    context is not the batch context (other ubatches), so a near-tie may part them now and then: nearly all kept."""
    got = generate(default_model, str(default_model), PROMPTS)
    assert got["guessed"] >= 100 and got["kept"] >= 0.95 * got["guessed"], got
    assert got["texts"] == generate(default_model, "", PROMPTS)["texts"]


def test_a_random_draft_of_the_same_tokenizer_changes_no_text(default_model):
    random_draft = make_family_model("llama", MODEL_DIR / "families")  # 2 layers, SmolLM2's tokenizer
    got = generate(default_model, str(random_draft), PROMPTS)
    assert got["guessed"] >= 100 and got["kept"] < got["guessed"] / 2, got
    assert got["texts"] == generate(default_model, "", PROMPTS)["texts"]


def test_a_draft_of_another_vocabulary_is_refused_with_the_reason(default_model):
    other = make_family_model("qwen2", MODEL_DIR / "families")
    with pytest.raises(RuntimeError, match="DraftModelError: draft_model: .*cannot guess this model's tokens: .*must "
                                           "share the served model's tokenizer"):
        generate(default_model, str(other), PROMPTS)


def test_a_draft_needs_speculation_on_and_a_gguf_file(default_model, tmp_path):
    with pytest.raises(ConfigError, match="speculative_tokens = 0 turns off"):
        from_mapping({"draft_model": str(default_model), "speculative_tokens": 0})
    for path, says in ((tmp_path / "none.gguf", "does not exist"), (tmp_path / "text.gguf", "not a GGUF file")):
        if path.name == "text.gguf":
            path.write_text("not a model")
        with pytest.raises(PlanError, match=f"draft_model: .*{says}"):
            plan_engines(dataclasses.replace(Config(), draft_model=str(path)), default_model, "m", {})
    planned = plan_engines(dataclasses.replace(Config(), draft_model=str(default_model)), default_model, "m", {})
    assert {spec.draft_model for _, spec in planned.workers} == {str(default_model.resolve())}
