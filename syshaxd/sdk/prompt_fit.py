"""Whether a request's prompt can run, and with how many tokens to generate: the rule every engine (and the
daemon, which tokenizes each prompt once) applies, with the same Rejected for the same prompt."""

from __future__ import annotations

from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.types import GenerateRequest, Refusal, Rejected


def fit_prompt(vocab: Vocab, request: GenerateRequest, n_ctx: int) -> tuple[list[int], int] | Rejected:
    """(prompt tokens, max_tokens) for a request, or why it cannot run (a Rejected, as every engine answers).

    A request without max_tokens may fill the context; the daemon gives every request it sends a max_tokens
    (its default_max_tokens within its room: engine/prompts.py), which an engine with less room (a decode node's
    smaller n_ctx) takes within its own, as it would a missing one.

    A prompt that cannot fit is refused from its size before it is rendered or tokenized: tokenizing
    a 4 MB prompt takes seconds of the engine's one thread, which its other requests would wait out.
    """
    rid = request.request_id
    floor = vocab.fewest_tokens(request)
    if floor >= n_ctx:
        return Rejected(rid, Refusal.INVALID, f"This model's maximum context length is {n_ctx} tokens. However, "
                        f"your prompt has at least {floor} tokens (judged from its size: no token covers more than "
                        f"{vocab.max_token_bytes} bytes). Please reduce the prompt.", "context_length_exceeded",
                        "messages" if request.messages is not None else "prompt")
    try:
        prompt = vocab.prompt_tokens(request)
    except ValueError as exc:
        return Rejected(rid, Refusal.INVALID, str(exc), code="invalid_prompt",
                        param="messages" if request.messages else "prompt")
    if not prompt:
        return Rejected(rid, Refusal.INVALID, "the prompt is empty after tokenization; send at least one token",
                        "invalid_prompt", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab.n_vocab]
    if bad:
        return Rejected(rid, Refusal.INVALID,
                        f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab.n_vocab - 1})",
                        "invalid_prompt", "prompt")
    room = n_ctx - len(prompt)
    asked_for = request.max_tokens is not None and not request.max_tokens_default  # by the client itself
    if request.max_tokens is None:
        max_tokens = room
    elif request.max_tokens_default:  # the daemon's default, within this engine's room
        max_tokens = min(request.max_tokens, room)
    else:
        max_tokens = request.max_tokens
    if room < 1 or max_tokens > room:
        asked = len(prompt) + (max_tokens if asked_for else 1)
        return Rejected(
            rid, Refusal.INVALID,
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{asked} tokens ({len(prompt)} in the prompt, {asked - len(prompt)} in the completion). "
            "Please reduce the prompt or max_tokens.",
            "context_length_exceeded", "max_tokens" if asked_for and room >= 1 else "prompt",
        )
    return prompt, max_tokens
