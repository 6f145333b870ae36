"""Each prompt is rendered and tokenized once, in the daemon, however many choices it has (Scheduler.prepare).

The daemon's vocabulary is the real one (vocab-only, from the default model's GGUF); its tokenizer is counted by
wrapping the real method. The engines then get token ids, which they take as they are (gguf/vocab.py admit).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from conftest import MODEL_NAME
from syshaxd.api.core.validate import parse_chat, parse_completion
from syshaxd.config import Config
from syshaxd.engine.prompts import DaemonVocab, PromptTokenizer
from syshaxd.engine.scheduler import Scheduler
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.types import Rejected


def prepared_counting(default_model, parsed, config: Config | None = None, n_ctx: int = 4096):
    """The scheduler's prepared choices, and how many times the tokenizer ran for them."""
    async def go():
        prompts = PromptTokenizer(DaemonVocab(str(default_model)), n_ctx)
        vocab = await prompts.vocab.get()
        calls = []
        real = vocab.tokenize

        def counted(*args, **kwargs):
            calls.append(args[0])
            return real(*args, **kwargs)

        vocab.tokenize = counted
        choices = await Scheduler(config or Config(), [], prompts=prompts).prepare(parsed.generates, parsed.n)
        return choices, calls, vocab

    return asyncio.run(go())


def test_n_choices_of_a_chat_prompt_are_tokenized_once(default_model):
    parsed = parse_chat({"model": MODEL_NAME, "n": 5, "messages": [{"role": "user", "content": "Name a colour."}]},
                        MODEL_NAME)
    choices, calls, vocab = prepared_counting(default_model, parsed)
    assert len(calls) == 1 and len(choices) == 5
    expected = vocab.tokenize(vocab.template.render(list(parsed.generate.messages), None), add_special=False)
    assert all(list(c.prompt_tokens) == expected and c.messages is None for c in choices)
    assert len({c.request_id for c in choices}) == 5  # each choice is still its own request
    # the engine takes the ids as they are: no second tokenization there
    before = len(calls)
    tokens, _ = fit_prompt(vocab, choices[0], 4096)
    assert tokens == expected and len(calls) == before


def test_each_of_several_prompts_is_tokenized_once_for_all_its_choices(default_model):
    parsed = parse_completion({"model": MODEL_NAME, "n": 3, "prompt": ["One", "Two", "Three"], "max_tokens": 2},
                              MODEL_NAME)
    choices, calls, vocab = prepared_counting(default_model, parsed)
    assert calls == ["One", "Two", "Three"] and len(choices) == 9
    for i, word in enumerate(["One", "Two", "Three"]):
        assert {tuple(c.prompt_tokens) for c in choices[3 * i:3 * i + 3]} == {tuple(vocab.tokenize(word, True))}


def test_a_prompt_that_cannot_run_is_refused_before_any_engine(default_model):
    parsed = parse_completion({"model": MODEL_NAME, "prompt": "word " * 5000, "max_tokens": 2}, MODEL_NAME)
    refused, calls, _ = prepared_counting(default_model, parsed)
    assert isinstance(refused, Rejected) and refused.code == "context_length_exceeded" and refused.param == "prompt"


def test_the_daemon_alone_gives_a_chat_without_max_tokens_its_default(default_model):
    # default_max_tokens within the room the prompt leaves; the engines get it as the request's max_tokens
    chat = {"model": MODEL_NAME, "n": 2, "messages": [{"role": "user", "content": "Name a colour."}]}
    parsed = parse_chat(chat, MODEL_NAME)
    assert parsed.generate.max_tokens is None
    choices, _, vocab = prepared_counting(default_model, parsed, Config(default_max_tokens=7))
    assert [c.max_tokens for c in choices] == [7, 7]
    prompt = len(choices[0].prompt_tokens)
    choices, _, _ = prepared_counting(default_model, parsed, Config(default_max_tokens=7), n_ctx=prompt + 3)
    assert [c.max_tokens for c in choices] == [3, 3]  # the room, where it is less
    asked = parse_chat(chat | {"max_tokens": 9}, MODEL_NAME)
    choices, _, _ = prepared_counting(default_model, asked, Config(default_max_tokens=7))
    assert [c.max_tokens for c in choices] == [9, 9]  # what the client asked for stands
    assert fit_prompt(vocab, replace(choices[0], max_tokens=None), prompt + 3)[1] == 3  # an engine's own rule


def test_an_engine_with_less_room_takes_the_default_within_it_and_refuses_what_the_client_asked(default_model):
    # a decode node whose n_ctx is smaller than its front's: the front's default shrinks to the node's room, as a
    # missing max_tokens would; a max_tokens the client sent is refused as too long, naming it
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}]}
    default, _, vocab = prepared_counting(default_model, parse_chat(chat, MODEL_NAME), Config(default_max_tokens=64))
    asked, _, _ = prepared_counting(default_model, parse_chat(chat | {"max_tokens": 64}, MODEL_NAME))
    assert (default[0].max_tokens, default[0].max_tokens_default) == (64, True)
    assert (asked[0].max_tokens, asked[0].max_tokens_default) == (64, False)
    node_ctx = len(default[0].prompt_tokens) + 10
    assert fit_prompt(vocab, default[0], node_ctx)[1] == 10
    refused = fit_prompt(vocab, asked[0], node_ctx)
    assert isinstance(refused, Rejected) and (refused.code, refused.param) == ("context_length_exceeded", "max_tokens")
