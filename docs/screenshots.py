"""Retake the README's pictures of the web page: docs/images/web-ui.png (a desktop) and docs/images/web-ui-phone.png (390 px).

A hetero daemon on the default model serves a little load (so the charts, the ring and the prefix cache have
something to show), then the page, in Debian's headless Chromium driven by Playwright (what `make test` installs),
answers one structured question and one cut at max tokens.

    .venv/bin/python docs/screenshots.py
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def main() -> int:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = Path(tmp) / "syshax.toml"
        config.write_text(f'model = "{MODEL}"\nmodel_dir = "{REPO / "models"}"\nmode = "hetero"\n'
                          'prefill_cpu_affinity = "0"\n')
        daemon = subprocess.Popen([sys.executable, "-m", "syshaxd", "--config", str(config), "--port", str(port)],
                                  cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            subjects = ["the sea", "a library", "winter", "bridges", "bees", "the moon", "clocks", "rain"]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:  # some load for the charts
                list(pool.map(lambda s: post(f"{url}/v1/completions", {
                    "model": model, "prompt": f"Write a few sentences about {s}.", "max_tokens": 48}), subjects * 2))
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{url}/")
                page.locator("#ready", has_text="ready").wait_for(timeout=30_000)
                page.fill("#temperature", "0")
                page.fill("#max-tokens", "12")
                page.fill("#message", "Tell me a long story about the sea.")
                page.click("#send")
                page.locator(".turn.assistant .meta.finish").first.wait_for(timeout=120_000)
                page.fill("#max-tokens", "200")
                page.fill("#schema", json.dumps(SCHEMA))
                page.fill("#message", "Which city is the capital of France?")
                page.click("#send")
                page.locator(".turn.assistant .meta.valid, .turn.assistant .meta.invalid").first.wait_for(timeout=120_000)
                time.sleep(2.5)  # the next status poll draws the charts with the answers in them
                page.screenshot(path=str(REPO / "docs" / "images" / "web-ui.png"), full_page=True)
                phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True,
                                            has_touch=True).new_page()
                phone.goto(f"{url}/")
                phone.locator("#workers tbody tr").first.wait_for(timeout=30_000)
                phone.screenshot(path=str(REPO / "docs" / "images" / "web-ui-phone.png"), full_page=True)
                browser.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
    print("wrote docs/images/web-ui.png and docs/images/web-ui-phone.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
