"""The front door's capability check: one function, for every backend, refuses a request that asks an engine on
its way for what that engine's backend does not declare (sdk.backend.Capabilities), before any engine sees it.

A request's way is the engines it may visit on its route (the scheduler knows them): a prefill that hands the
prompt on, then a decoder; or one engine that does it all. Engines do not refuse what they lack themselves:
this check refuses it for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from syshaxd.sdk.backend import Capabilities
from syshaxd.sdk.types import GenerateRequest

# where logprobs are computed today, for a refusal to say how to get them
_LOGPROBS_HINT = ("The llama.cpp engine does: cpu mode, hetero mode with prefill_engine = \"llamacpp\", and gpu "
                  "mode's vLLM engine; send {\"syshax\": {\"mode\": \"cpu\"}} or use a daemon in one of those modes.")


@dataclass(frozen=True)
class Stop:
    """One engine a request may visit."""

    backend: str
    capabilities: Capabilities
    hands_on: bool = False  # runs the prompt and hands its KV to a decoder: it samples only the first token


class Unsupported(ValueError):
    """The request asks an engine on its way for what it cannot do; `param` is the request field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check(request: GenerateRequest, mode: str, way: Sequence[Stop]) -> None:
    """Raises Unsupported naming the first thing the request asks that an engine on `way` lacks."""
    for stop in way:
        caps = stop.capabilities
        if stop.hands_on:  # its logprobs reach the client only if they travel with the KV record
            if (request.logprobs is not None or request.prompt_logprobs is not None) and not caps.handed_on_logprobs:
                raise Unsupported(f"'logprobs' are not available in {mode} mode here: the {stop.backend} prefill "
                                  "engine does not compute them (a handed-on prompt's logprobs do not travel with "
                                  f"its KV record). {_LOGPROBS_HINT}", "logprobs")
        else:
            for name, asked, has in (("logprobs", request.logprobs, caps.logprobs),
                                     ("prompt_logprobs", request.prompt_logprobs, caps.prompt_logprobs)):
                if asked is not None and not has:
                    raise Unsupported(f"'{name}' are not available in {mode} mode here: the {stop.backend} engine "
                                      f"does not compute them. {_LOGPROBS_HINT}", "logprobs")
        if request.grammar and not caps.grammars:
            field = request.grammar_field
            raise Unsupported(f"Structured output ('{field}': a schema, regex, choice or grammar, or a forced tool "
                              f"call) is not supported by the {stop.backend} engine in {mode} mode: it samples "
                              f"{'the first token' if stop.hands_on else 'tokens'} without a grammar. Use "
                              "prefill_engine \"llamacpp\", or syshax.mode \"cpu\".", field)
