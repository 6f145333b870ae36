"""The web page at /, in a real browser: Debian's headless Chromium driven by Playwright, against real daemons.

Screenshots of each test's page are kept in tests/artifacts/ (not committed): what the page looked like when
its test ran.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from conftest import MODEL_NAME, start_daemon

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
# as this machine's probe starts it: without the background-networking flags Chromium tries hosts a closed
# network refuses
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
KEY = "sk-web-ui-test-key-0123456789"

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra: make test installs it")
if not CHROMIUM.exists():
    pytest.skip("needs Debian's chromium at /usr/bin/chromium (make test installs it with apt-get as root)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A page of the web UI, with every console error, page error and request it made."""

    def __init__(self, browser, url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("request", lambda req: self.requests.append(req.url))
        self.response = self.page.goto(url)

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, daemon):
    p = Page(browser, f"{daemon.url}/")
    yield p
    p.close()


def send(page, text: str) -> None:
    page.page.fill("#message", text)
    page.page.click("#send")


def test_the_page_loads_with_no_console_errors_and_shows_the_real_worker(page, daemon):
    assert page.response.status == 200
    csp = page.response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    worker = daemon.status()["workers"][0]
    row = page.page.locator("#workers tbody tr", has_text=worker["name"])
    row.wait_for(timeout=15_000)
    cells = row.locator("td").all_inner_texts()
    assert cells[:5] == [worker["name"], worker["backend"], worker["role"], "ready", str(worker["pid"])]
    page.page.locator("#model", has_text=MODEL_NAME).wait_for()
    page.page.locator("#ready", has_text="ready").wait_for()
    # the throughput line is drawn across the whole window (zeros where nothing ran), beside the two axes
    assert page.page.locator("#chart-throughput polyline.throughput").count() == 1
    assert page.page.locator("#chart-throughput line.axis").count() == 2
    page.screenshot("status")
    assert page.errors == []
    own = urllib.parse.urlsplit(daemon.url).netloc
    assert all(urllib.parse.urlsplit(u).netloc == own for u in page.requests), page.requests  # nothing leaves


def test_a_chat_message_streams_an_answer(page, daemon):
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    # count the answer's text as it grows: a streamed answer shows in several steps
    page.page.evaluate("""() => {
        window.textSteps = 0;
        new MutationObserver(() => { window.textSteps++; })
            .observe(document.getElementById('conversation'), {subtree: true, characterData: true, childList: true});
    }""")
    page.page.fill("#temperature", "0")
    page.page.fill("#max-tokens", "24")
    send(page, "Tell me about the sea.")
    meta = page.page.locator(".turn.assistant .meta").first
    meta.wait_for(timeout=60_000)
    assert "route cpu" in meta.inner_text() and "TTFT" in meta.inner_text()
    answer = page.page.locator(".turn.assistant .text").first.inner_text()
    assert answer.strip()
    assert page.page.evaluate("window.textSteps") >= 5  # the user's turn, the empty answer, then tokens as they came
    page.screenshot("chat")
    assert page.errors == []


def test_a_structured_output_request_shows_valid_json(page, daemon):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    page.page.fill("#schema", json.dumps(schema))
    page.page.fill("#temperature", "0")  # greedy: the grammar holds every token, and the object closes well within
    page.page.fill("#max-tokens", "200")
    send(page, "Describe a person.")
    verdict = page.page.locator(".turn.assistant .meta.valid, .turn.assistant .meta.invalid").first
    verdict.wait_for(timeout=60_000)
    page.screenshot("structured")
    answer = page.page.locator(".turn.assistant").first.inner_text()
    assert verdict.inner_text() == "valid JSON", answer
    jsonschema.validate(json.loads(page.page.locator(".turn.assistant .text").first.inner_text()), schema)
    assert page.errors == []


def test_the_page_asks_for_the_api_key_and_keeps_it_to_itself(browser, default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "api_keys": [KEY]})
    try:
        p = Page(browser, f"{d.url}/")
        try:
            assert p.response.status == 200  # the page itself holds nothing secret
            p.page.locator("#error", has_text="needs an API key").wait_for(timeout=15_000)
            p.page.fill("#key", KEY)
            p.page.click("#key-form button")
            p.page.locator("#workers tbody tr", has_text="cpu0").wait_for(timeout=15_000)
            send(p, "Hello")
            p.page.locator(".turn.assistant .meta").first.wait_for(timeout=60_000)
            assert "Failed" not in p.page.locator(".turn.assistant").first.inner_text()
            kept = p.page.evaluate("() => JSON.stringify([localStorage, sessionStorage, document.cookie, location.href,"
                                   " document.documentElement.outerHTML])")
            assert KEY not in kept
            assert all(KEY not in u for u in p.requests)
            p.screenshot("api-key")
            assert p.errors == [e for e in p.errors if "401" in e]  # the first status poll, before the key
        finally:
            p.close()
    finally:
        assert d.stop() == 0, d.log()


def test_web_ui_false_turns_the_page_off(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "web_ui": False})
    try:
        with pytest.raises(urllib.error.HTTPError) as off:
            urllib.request.urlopen(f"{d.url}/", timeout=10)
        assert off.value.code == 404
        assert urllib.request.urlopen(f"{d.url}/health", timeout=10).status == 200
    finally:
        assert d.stop() == 0, d.log()


def test_the_page_is_light():
    web = Path(__file__).parents[1] / "syshaxd" / "api" / "web"
    sizes = {f.name: f.stat().st_size for f in web.iterdir()}
    assert set(sizes) == {"index.html", "app.js", "style.css", "icon.svg"}
    assert sum(sizes.values()) < 200_000, sizes
    for f in web.iterdir():  # no address of another host (an SVG's namespace is a name, never fetched)
        text = f.read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]", text), f
