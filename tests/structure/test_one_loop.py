"""Each concern of a generation request is written once in syshaxd/api/, whichever endpoint the request came to.

Chat, completions, the Responses and the Messages APIs only translate their bodies and write their shapes;
reading the engines' output (api/outputs.py: the first-token deadline, a client that leaves, refusals,
failures, thinking read apart, tool text held) and writing a stream (api/sse.py: headers, client_timeout,
the end) happen in one module each. A second loop beside the first is where the next bug hides.
"""

from __future__ import annotations

from pathlib import Path

API = Path(__file__).resolve().parents[2] / "syshaxd" / "api"

# what only one module does (besides the module that defines the thing, and the OpenAPI document's words)
ONE_PLACE = {
    "web.StreamResponse(": {"sse.py"},  # the stream's headers
    ".prepare(request)": {"sse.py"},
    "StreamWrites(": {"sse.py"},
    "next_event(": {"outputs.py", "generation.py", "fanout.py"},  # generation: the acceptance event only
    "ToolStream(": {"outputs.py"},
    "ThinkingReader(": {"outputs.py"},
    "rejected(": {"outputs.py", "generation.py"},  # generation: a refusal before the request starts
    "engine_failed(": {"outputs.py"},
    "scheduler.check_capabilities(": {"generation.py"},  # the capability check, once per request
    "scheduler.prepare(": {"generation.py"},
    "is_closing()": {"outputs.py", "sse.py", "limits.py"},  # whether a client left: outputs.client_gone
}


def test_each_concern_is_written_in_one_module():
    for needle, owners in ONE_PLACE.items():
        found = {p.name for p in API.glob("*.py") if needle in p.read_text()}
        assert found and found <= owners, f"{needle!r} in {sorted(found - owners)}: it belongs in {sorted(owners)}"


def test_no_api_module_grows_past_500_lines():
    for path in API.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path.name
