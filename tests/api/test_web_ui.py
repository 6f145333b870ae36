"""The web page at /, in a real browser: Debian's headless Chromium driven by Playwright, against real daemons.

Screenshots of each test's page are kept in tests/artifacts/ (not committed): what the page looked like when
its test ran.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from conftest import MODEL_NAME, start_daemon

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parents[1] / "artifacts"
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


DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


class Page:
    """A page of the web UI, with every console error, page error and request it made."""

    def __init__(self, browser, url: str, viewport: dict = DESKTOP, route=None) -> None:
        self.context = browser.new_context(viewport=viewport, is_mobile=viewport is PHONE,
                                           has_touch=viewport is PHONE)
        if route is not None:
            self.context.route(*route)
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


def until(check, timeout: float, what: str):
    """check()'s first truthy value, polled (the page's CSP forbids Playwright's string predicates)."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def finished(page, timeout: float = 120_000):
    """The first answer's finish line, once it is there."""
    line = page.page.locator(".turn.assistant .meta.finish").first
    line.wait_for(timeout=timeout)
    return line


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


def test_the_prefix_cache_card_shows_its_memory_and_its_disk_tier(page, daemon):
    disk = daemon.status()["prefix_cache"]["disk"]
    assert disk["state"] == "open", disk  # the daemon's tier, in its own folder (tests/conftest.py)
    card = page.page.locator("#prefix")
    card.locator("dt", has_text="on disk").wait_for(timeout=15_000)
    terms = card.locator("dt").all_inner_texts()
    assert terms[:2] == ["blocks", "memory"] and terms[-2:] == ["on disk", "read back"], terms
    values = dict(zip(terms, card.locator("dd").all_inner_texts()))
    assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB) of [\d.]+ (B|KiB|MiB|GiB), [\d,]+ blocks", values["on disk"])
    assert re.fullmatch(r"[\d,]+ blocks \([\d.]+ (B|KiB|MiB|GiB)\)", values["read back"])
    assert values["memory"].endswith(("MiB", "GiB"))  # of 512 MiB by default
    assert page.errors == []


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
    page.page.locator(".turn.assistant .meta.finish").first.wait_for(timeout=60_000)
    meta = page.page.locator(".turn.assistant .meta").first
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
            p.page.locator(".turn.assistant .meta.finish").first.wait_for(timeout=60_000)
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
    web = Path(__file__).parents[2] / "syshaxd" / "api" / "web"
    static = [f for f in web.iterdir() if f.is_file() and f.suffix != ".py"]  # what the browser loads; routes.py serves it
    sizes = {f.name: f.stat().st_size for f in static}
    assert set(sizes) == {"index.html", "app.js", "style.css", "icon.svg"}
    assert sum(sizes.values()) < 200_000, sizes
    for f in static:  # no address of another host (an SVG's namespace is a name, never fetched)
        text = f.read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]", text), f


def test_the_stop_button_ends_the_answer_and_frees_the_daemon(page, daemon):
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    assert page.page.locator("#stop").is_hidden()
    page.page.fill("#temperature", "0")
    page.page.fill("#max-tokens", "3000")
    send(page, "Write a very long story about a dragon who learns to cook, with many chapters.")
    stop = page.page.locator("#stop")
    stop.wait_for(state="visible", timeout=10_000)
    text = page.page.locator(".turn.assistant .text").first
    until(lambda: len(text.inner_text()) > 40, 60, "the answer under way")
    assert daemon.status()["in_flight"] == 1
    stop.click()
    assert finished(page, 10_000).inner_text() == "stopped by you"
    deadline = time.monotonic() + 5
    while daemon.status()["in_flight"] and time.monotonic() < deadline:  # the daemon cancelled it
        time.sleep(0.1)
    assert daemon.status()["in_flight"] == 0
    assert stop.is_hidden() and page.page.locator("#send").is_enabled()
    assert page.page.locator(".turn.assistant .text").first.inner_text().strip()  # what came is kept
    assert page.errors == []


def test_a_long_prompt_shows_that_it_is_being_read_and_how_long(page, daemon):
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    page.page.fill("#temperature", "0")
    page.page.fill("#max-tokens", "4")
    words = " ".join(f"item{i} is on the list;" for i in range(400))  # about 3,000 tokens: seconds to read here
    send(page, f"Here is a list. {words} Which item comes first?")
    progress = page.page.locator(".turn.assistant .meta.progress").first
    progress.wait_for(timeout=10_000)
    line = re.compile(r"Reading the prompt \([0-9,]+ tokens\) · [0-9.]+ s")
    shown = until(lambda: (t := progress.inner_text()) and line.search(t) and t, 10, "the prompt's size shown")
    tokens = int(re.search(r"\(([0-9,]+) tokens\)", shown).group(1).replace(",", ""))
    assert tokens > 2000, shown
    page.screenshot("long-prompt")
    assert finished(page).inner_text() == "cut at max tokens"
    assert page.page.locator(".turn.assistant .meta.progress").count() == 0  # gone once the answer came
    assert page.errors == []


def test_a_phone_gets_the_chat_first_and_nothing_wider_than_its_screen(browser, daemon):
    p = Page(browser, f"{daemon.url}/", PHONE)
    try:
        p.page.locator("#workers tbody tr").first.wait_for(timeout=15_000)
        width = p.page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"the page is {width} px wide on a {PHONE['width']} px screen"
        chat = p.page.locator("#playground").bounding_box()
        workers = p.page.locator("#workers").bounding_box()
        assert chat["y"] < workers["y"]  # the chat first, the status cards after it
        # the table scrolls inside its card, which stays on the screen
        card = p.page.locator("#workers").locator("xpath=ancestor::section").bounding_box()
        assert card["x"] >= 0 and card["x"] + card["width"] <= PHONE["width"]
        box = p.page.locator("#message")
        placeholder = box.get_attribute("placeholder")
        fits = p.page.evaluate("""([el, text]) => {
            const c = document.createElement('canvas').getContext('2d');
            c.font = getComputedStyle(el).font;
            return c.measureText(text).width <= el.clientWidth;
        }""", [box.element_handle(), placeholder])
        assert fits, "the message box's placeholder is cut"
        p.screenshot("phone")
        assert p.errors == []
    finally:
        p.close()
    d = Page(browser, f"{daemon.url}/")
    try:
        d.page.locator("#workers tbody tr").first.wait_for(timeout=15_000)
        assert d.page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
        d.screenshot("desktop")
    finally:
        d.close()


def test_an_invalid_schema_is_named_beside_its_field_and_the_message_is_kept(page, daemon):
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    page.page.fill("#schema", '{"type": "object", "properties": {"name": {"type": "string"} }')
    send(page, "Describe a person, please.")
    error = page.page.locator("#schema-error")
    error.wait_for(state="visible", timeout=5_000)
    assert error.inner_text().startswith("JSON schema: not a valid JSON schema")
    assert page.page.get_attribute("#schema", "aria-invalid") == "true"
    assert page.page.input_value("#message") == "Describe a person, please."  # kept, not sent
    assert page.page.locator(".turn").count() == 0
    # a schema the daemon refuses (a keyword a grammar cannot hold): its message, beside the field, message kept
    page.page.fill("#schema", json.dumps({"type": "object", "properties": {"age": {"type": "integer",
                                                                                   "minimum": 0}}}))
    assert error.is_hidden()  # editing the field clears its error
    page.page.click("#send")
    page.page.locator("#schema-error", has_text="minimum").wait_for(timeout=15_000)
    assert page.page.input_value("#message") == "Describe a person, please."
    assert page.page.locator(".turn").count() == 0
    page.screenshot("field-error")
    assert [e for e in page.errors if "400" not in e] == []  # the browser logs the refused request itself


def test_an_answer_cut_at_max_tokens_says_so(page, daemon):
    page.page.locator("#ready", has_text="ready").wait_for(timeout=15_000)
    page.page.fill("#temperature", "0")
    page.page.fill("#max-tokens", "6")
    send(page, "Tell me a long story about the sea.")
    assert finished(page).inner_text() == "cut at max tokens"
    assert "6 tokens" in page.page.locator(".turn.assistant .meta").first.inner_text()
    page.page.fill("#max-tokens", "200")
    page.page.fill("#schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                          "required": ["ok"], "additionalProperties": False}))
    send(page, "Is the sea blue? Answer in JSON.")
    page.page.locator(".turn.assistant .meta.finish").nth(1).wait_for(timeout=60_000)
    assert page.page.locator(".turn.assistant .meta.finish").nth(1).inner_text() == "finished"
    assert page.errors == []


def _with_an_outlier(route):
    """The daemon's own status, with one request's TTFT of 179,492 ms among 50 ms ones (a 20,000-character prompt
    on a busy machine): what the latency chart must still show readably."""
    resp = route.fetch()
    status = resp.json()
    points = status["recent"]["points"]
    for i, point in enumerate(points[-40:]):
        point["ttft_ms"] = 179_492.0 if i == 20 else 50.0 + i
        point["tpot_ms"] = 12.0
    status["recent"]["summary"] = {"ttft_ms": {"p50": 60.0, "p99": 179_492.0, "last": 89.0},
                                   "tpot_ms": {"p50": 12.0, "p99": 14.5, "last": 12.0}}
    route.fulfill(response=resp, json=status)


def test_the_latency_chart_reads_past_an_outlier_with_units_and_quantiles(browser, daemon):
    p = Page(browser, f"{daemon.url}/", route=("**/v1/syshax/status", _with_an_outlier))
    try:
        chart = p.page.locator("#chart-latency")
        p.page.locator("#chart-latency polyline.ttft").first.wait_for(timeout=15_000)
        assert chart.get_attribute("data-scale") == "log"
        labels = chart.locator("text").all_text_contents()
        assert "ms (log)" in labels and "100,000" in labels and "200,000" in labels and "10" in labels, labels
        # the 50 ms points stand clear of the axis (a linear scale drew them 0.03 px above it), the outlier near the top
        ys = [float(pt.split(",")[1]) for line in chart.locator("polyline.ttft").all()
              for pt in line.get_attribute("points").split()]
        base = 130 - 16
        assert max(ys) < base - 10 and min(ys) < 30, ys
        for cls in ("ttft.p50", "ttft.p99", "tpot.p50", "tpot.p99"):
            assert chart.locator(f"line.{cls}").count() == 1, cls
        figures = p.page.locator("#latency-figures").inner_text()
        assert "TTFT last 89 ms, p50 60 ms, p99 179,492 ms" in figures, figures
        assert "TPOT last 12 ms, p50 12 ms, p99 14.5 ms" in figures, figures
        assert "tok/s" in p.page.locator("#chart-throughput").locator("text").all_text_contents()
        assert re.match(r"last [0-9,.]+ tok/s · peak [0-9,.]+ tok/s", p.page.locator("#throughput-figures").inner_text())
        p.screenshot("latency-outlier")
        assert p.errors == []
    finally:
        p.close()


def test_the_model_picker_chats_with_a_chat_model_of_models(browser, default_model, tmp_path):
    """The playground offers the daemon's own model and the chat models of [[models]] (not an embedding model);
    picking one sends the chat to it, which loads it, and its row shows it loaded."""
    from families import make_family_model
    from conftest import MODEL_DIR

    embed = make_family_model("qwen3-embedding", MODEL_DIR / "families")
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": 1024},
                     tables=f'[[models]]\nname = "small"\npath = "{default_model}"\nload = "on_demand"\n'
                            f'[[models]]\nname = "embed"\npath = "{embed}"\nn_ctx = 256\nload = "on_demand"\n')
    p = Page(browser, f"{d.url}/")
    try:
        picker = p.page.locator("#model-pick")
        p.page.locator("#model-pick option", has_text="small").wait_for(state="attached", timeout=15_000)
        assert picker.locator("option").all_inner_texts() == [MODEL_NAME, "small"]
        picker.select_option("small")
        p.page.locator("#model", has_text="small").wait_for()
        p.page.fill("#temperature", "0")
        p.page.fill("#max-tokens", "16")
        send(p, "Tell me about the sea.")
        finished(p)
        assert p.page.locator(".turn.assistant .text").first.inner_text().strip()
        small = {m["name"]: m for m in d.status()["chat_models"]}["small"]
        assert small["state"] == "ready" and small["requests"] >= 1, small
        p.page.locator("#workers tbody tr", has_text="model small").wait_for(timeout=15_000)
        p.screenshot("model-picker")
        assert p.errors == []
    finally:
        p.close()
        assert d.stop(60) == 0, d.log()
