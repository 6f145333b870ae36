"""The documentation a newcomer reads: the site builds with no broken link or anchor, and the README's links hold.

`mkdocs build --strict` (mkdocs.yml's validation turns every unresolved link, anchor and page outside the nav
into a warning, and --strict into a failure) covers docs/. The README is read on the repository's page, not on
the site, so its links are checked here: each relative link names a file that exists, each anchor a heading of
that file as GitHub spells it, and an absolute link is an address, never a registry's host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MKDOCS = Path(sys.executable).with_name("mkdocs")

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def _outside_code(text: str) -> str:
    """The Markdown without its fenced blocks and inline code, where a bracket is not a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def links_of(text: str) -> list[str]:
    return LINK.findall(_outside_code(text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation gone, each space a hyphen."""
    text = re.sub(r"`", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in _outside_code(text).splitlines() if re.match(r"#{1,6} ", line)]
    return {github_anchor(h) for h in headings}


def broken_links(markdown: Path) -> list[str]:
    """Each link of a Markdown file that leads nowhere, with the reason."""
    broken = []
    for target in links_of(markdown.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            if not re.match(r"(https?|mailto):", target):
                broken.append(f"{target}: not a web or mail address")
            elif re.search(r"pypi|files\.pythonhosted|download\.pytorch|registry\.npmjs|hub\.docker", target):
                broken.append(f"{target}: names a package registry's host")
            continue
        path, _, anchor = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target}: {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors_of(file):
            broken.append(f"{target}: {file.name} has no heading #{anchor}")
    return broken


def test_the_readme_links_lead_somewhere():
    links = links_of(README.read_text(encoding="utf-8"))
    assert len(links) >= 10, "the README is a front door: its table links each feature to its page"
    assert broken_links(README) == []


def test_the_link_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [anchor](there.md#nowhere) "
                    "[host](https://pypi.org/simple/) `[code](missing.md)`\n")
    found = broken_links(page)
    assert [f.split(":")[0] for f in found] == ["missing.md", "there.md#nowhere", "https"]


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; the rest belongs on the site's pages (docs/)"
    text = "\n".join(lines)
    assert text.index("make run") < text.index("make test") < 1500, "the two commands come first"


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strict(tmp_path):
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    problems = [line for line in result.stderr.splitlines() if re.search(r"WARNING|ERROR", line)]
    assert result.returncode == 0 and problems == [], result.stderr[-4000:]
    for page in ("index.html", "getting-started/index.html", "reference/config/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def _dashboard_parser():
    """docs/grafana/render_panels.py's PromQL reader: what draws the panels is what checks the queries."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_panels", REPO / "docs" / "grafana" / "render_panels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_panels", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_grafana_dashboard_reads_series_the_daemon_exports():
    import json

    from syshaxd.docs_reference import metric_families

    exported = {name for family in metric_families() for name in family.series}
    render = _dashboard_parser()
    dashboard = json.loads((REPO / "docs" / "grafana" / "syshax-dashboard.json").read_text())
    read = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            read |= render.names_in(render.parse(target["expr"]))
    assert read - exported == set(), "the dashboard reads series /metrics does not export"
    assert {"vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
            "syshax_prefix_cache_hits_total"} <= read
    with pytest.raises(ValueError):  # a query the renderer cannot draw is refused, not drawn wrong
        render.parse("topk(3, syshax_batch_occupancy)")


def test_the_dashboard_renderer_evaluates_rates_and_quantiles():
    render = _dashboard_parser()
    le = lambda v: (("le", v),)  # noqa: E731
    scrapes = [(0.0, {"c_total": {(): 10.0}, "h_bucket": {le("1.0"): 0.0, le("2.0"): 0.0, le("+Inf"): 0.0}}),
               (30.0, {"c_total": {(): 70.0}, "h_bucket": {le("1.0"): 5.0, le("2.0"): 10.0, le("+Inf"): 10.0}})]
    assert render.evaluate(render.parse("sum(rate(c_total[1m]))"), scrapes, 1) == {(): 2.0}
    p50 = render.evaluate(render.parse("histogram_quantile(0.5, sum by (le) (rate(h_bucket[1m])))"), scrapes, 1)
    assert p50 == {(): 1.0}
    p75 = render.evaluate(render.parse("histogram_quantile(0.75, sum by (le) (rate(h_bucket[1m])))"), scrapes, 1)
    assert p75 == {(): 1.5}


def test_troubleshooting_quotes_messages_the_code_gives():
    """Each heading of the troubleshooting page quotes a message as a user sees it, its variable parts written as
    placeholders (PATH, N, '...'): some fixed part of 12 characters or more must be in the code, or the page
    describes a message that is gone."""
    sources = [*(REPO / "syshaxd").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]
    code = "\n".join(path.read_text(encoding="utf-8") for path in sources)
    code = re.sub(r"[\"']\s*\n\s*f?[\"']", "", code)  # a message written over several lines, as one string
    placeholder = re.compile(r"\.\.\.|'[^']*'|\$\w+|/\S+|\b\w*\d[\w.]*\b|\b[A-Z][A-Z_]*\b(?![a-z'])")
    page = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    quoted = re.findall(r"^### (?:\d{3} )?(?:`[a-z_]+`: )?`([^`]+)`", page, re.M)
    assert len(quoted) >= 30
    gone = []
    for message in quoted:
        parts = [part.strip(" :;,()") for part in placeholder.split(message)]
        if not any(len(part) >= 12 and part in code for part in parts):
            gone.append(message)
    assert gone == []
