"""Each concern of a generation request is written once in syshaxd/api/, whichever endpoint the request came to.

Chat, completions, the Responses and the Messages APIs only translate their bodies and write their shapes;
reading the engines' output (api/core/outputs.py: the first-token deadline, a client that leaves, refusals,
failures, thinking read apart, tool text held) and writing a stream (api/core/sse.py: headers, client_timeout,
the end) happen in one module each. A second loop beside the first is where the next bug hides.
"""

from __future__ import annotations

from pathlib import Path

API = Path(__file__).resolve().parents[2] / "syshaxd" / "api"

# what only one module does (besides the module that defines the thing, and the OpenAPI document's words); modules
# are named by their path under syshaxd/api/
ONE_PLACE = {
    "web.StreamResponse(": {"core/sse.py"},  # the stream's headers
    ".prepare(request)": {"core/sse.py"},
    "StreamWrites(": {"core/sse.py"},
    "next_event(": {"core/outputs.py", "core/generation.py", "core/fanout.py"},  # generation: the acceptance event
    "ToolStream(": {"core/outputs.py"},
    "ThinkingReader(": {"core/outputs.py"},
    "rejected(": {"core/outputs.py", "core/generation.py"},  # generation: a refusal before the request starts
    "engine_failed(": {"core/outputs.py"},
    "scheduler.check_capabilities(": {"core/generation.py"},  # the capability check, once per request
    "scheduler.prepare(": {"core/generation.py"},
    "is_closing()": {"core/outputs.py", "core/sse.py", "core/connections.py"},  # whether a client left: client_gone
}


def _modules() -> dict[str, str]:
    return {str(p.relative_to(API)): p.read_text() for p in API.rglob("*.py")}


def test_each_concern_is_written_in_one_module():
    modules = _modules()
    assert {"core/sse.py", "core/outputs.py", "core/generation.py"} <= set(modules)
    for needle, owners in ONE_PLACE.items():
        found = {name for name, text in modules.items() if needle in text}
        assert found and found <= owners, f"{needle!r} in {sorted(found - owners)}: it belongs in {sorted(owners)}"


def test_no_api_module_grows_past_500_lines():
    for name, text in _modules().items():
        assert len(text.splitlines()) <= 500, name


def test_api_stands_in_rooms_by_surface():
    # the shared core, OpenAI's endpoints, the admin socket and the web page in their folders; Anthropic's Messages,
    # the Responses API, the app, the OpenAPI document and the service routes (health, metrics) a file each
    top = sorted(p.name for p in API.glob("*.py") if p.name != "__init__.py")
    assert top == ["app.py", "messages.py", "openapi.py", "responses.py", "service_routes.py"], top
    assert {p.name for p in API.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"core", "openai", "admin",
                                                                                       "web"}
