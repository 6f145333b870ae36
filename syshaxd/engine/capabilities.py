"""What an engine without logprobs answers to a request that asks for them (vLLM, torch)."""

from __future__ import annotations

from syshaxd.engine.types import GenerateRequest, Rejected


def refuse_logprobs(request: GenerateRequest, engine: str, mode: str) -> Rejected | None:
    """A 400 naming the mode that lacks logprobs, or None when the request asks for none."""
    if request.logprobs is None and request.prompt_logprobs is None:
        return None
    return Rejected(request.request_id, 400,
                    f"'logprobs' are not available in {mode} mode: the {engine} engine does not compute them. "
                    "cpu and hetero modes (llama.cpp) do: send {\"syshax\": {\"mode\": \"cpu\"}} or start syshaxd "
                    "in one of those modes.", "unsupported_parameter", "logprobs")
