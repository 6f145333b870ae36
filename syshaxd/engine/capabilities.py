"""What an engine without logprobs answers to a request that asks for them (the torch and vLLM prefill engines)."""

from __future__ import annotations

from syshaxd.engine.types import GenerateRequest, Rejected


def refuse_logprobs(request: GenerateRequest, engine: str, mode: str) -> Rejected | None:
    """A 400 naming the mode that lacks logprobs, or None when the request asks for none."""
    if request.logprobs is None and request.prompt_logprobs is None:
        return None
    return Rejected(request.request_id, 400,
                    f"'logprobs' are not available in {mode} mode here: the {engine} engine does not compute them "
                    "(a handed-on prompt's logprobs do not travel with its KV record). The llama.cpp engine does: "
                    "cpu mode, hetero mode with prefill_engine = \"llamacpp\", and gpu mode's vLLM engine; send "
                    "{\"syshax\": {\"mode\": \"cpu\"}} or use a daemon in one of those modes.",
                    "unsupported_parameter", "logprobs")
