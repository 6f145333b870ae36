"""Draw the Grafana dashboard's panels (docs/grafana/syshax-dashboard.json) from a real daemon's /metrics.

Grafana does not run here, so this does what it would: it starts a cpu-mode syshaxd on the default model, puts
a little load on it (`syshax benchmark`'s chat scenario: conversations behind a shared system prompt, so the
prefix cache has hits), scrapes /metrics every two seconds, evaluates each panel's PromQL over the scrapes and
draws the panels with matplotlib (the plotting the benchmark already uses) into docs/images/grafana-panels.png.

It evaluates the part of PromQL the dashboard uses, and refuses anything else: NAME, rate(NAME[1m]),
sum(...), max(...), sum by (LABELS) (...), histogram_quantile(Q, sum by (le) (rate(NAME_bucket[1m]))) and
A / B. tests/e2e/test_docs.py checks the dashboard's queries with the same parser.

    .venv/bin/python docs/grafana/render_panels.py [--seconds 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docs" / "grafana" / "syshax-dashboard.json"
OUT = REPO / "docs" / "images" / "grafana-panels.png"

Labels = tuple[tuple[str, str], ...]
Sample = dict[Labels, float]  # one series family at one scrape: labels -> value


@dataclass
class Node:
    """One PromQL expression node: op is name, rate, sum, max, quantile or div."""

    op: str
    name: str = ""
    by: tuple[str, ...] | None = None
    q: float = 0.0
    args: tuple["Node", ...] = ()


_TOKEN = re.compile(r"\s*(histogram_quantile|rate|sum|max|by|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?|\[1m\]|[(),/])")


def parse(expr: str) -> Node:
    """The expression as a tree; ValueError for anything outside the subset above."""
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        match = _TOKEN.match(expr, pos)
        if not match:
            raise ValueError(f"{expr!r}: cannot read from {expr[pos:]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    node, rest = _expr(tokens)
    if rest:
        raise ValueError(f"{expr!r}: unexpected {' '.join(rest)!r}")
    return node


def _expr(tokens: list[str]) -> tuple[Node, list[str]]:
    left, rest = _term(tokens)
    if rest[:1] == ["/"]:
        right, rest = _term(rest[1:])
        return Node("div", args=(left, right)), rest
    return left, rest


def _expect(tokens: list[str], token: str) -> list[str]:
    if tokens[:1] != [token]:
        raise ValueError(f"expected {token!r}, got {' '.join(tokens[:3])!r}")
    return tokens[1:]


def _term(tokens: list[str]) -> tuple[Node, list[str]]:
    head, rest = tokens[0], tokens[1:]
    if head == "rate":
        rest = _expect(rest, "(")
        name, rest = rest[0], rest[1:]
        rest = _expect(_expect(rest, "[1m]"), ")")
        return Node("rate", name=name), rest
    if head in ("sum", "max"):
        by = None
        if rest[:1] == ["by"]:
            rest = _expect(rest[1:], "(")
            labels = []
            while rest[:1] != [")"]:
                labels.append(rest[0])
                rest = rest[1:] if rest[1:2] != [","] else rest[2:]
            by, rest = tuple(labels), rest[1:]
        rest = _expect(rest, "(")
        inner, rest = _expr(rest)
        return Node(head, by=by, args=(inner,)), _expect(rest, ")")
    if head == "histogram_quantile":
        rest = _expect(rest, "(")
        q, rest = float(rest[0]), _expect(rest[1:], ",")
        inner, rest = _expr(rest)
        if inner.op != "sum" or inner.by != ("le",) or inner.args[0].op != "rate" \
                or not inner.args[0].name.endswith("_bucket"):
            raise ValueError("histogram_quantile takes sum by (le) (rate(NAME_bucket[1m])) only")
        return Node("quantile", q=q, args=(inner,)), _expect(rest, ")")
    if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", head) and head not in ("by",):
        return Node("name", name=head), rest
    raise ValueError(f"unexpected {head!r}")


def names_in(node: Node) -> set[str]:
    """The series names an expression reads (histograms by their _bucket series)."""
    found = {node.name} if node.name else set()
    for arg in node.args:
        found |= names_in(arg)
    return found


def evaluate(node: Node, scrapes: list[tuple[float, dict[str, Sample]]], i: int) -> Sample:
    """The expression's value at scrape i, as labelled series."""
    t, now = scrapes[i]
    if node.op == "name":
        return dict(now.get(node.name, {}))
    if node.op == "rate":
        j = i
        while j > 0 and t - scrapes[j - 1][0] <= 60.0:
            j -= 1
        if j == i:
            return {}
        t0, then = scrapes[j]
        old = then.get(node.name, {})
        return {labels: max(0.0, value - old.get(labels, 0.0)) / (t - t0)
                for labels, value in now.get(node.name, {}).items()}
    if node.op in ("sum", "max"):
        inner = evaluate(node.args[0], scrapes, i)
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            key = tuple((k, v) for k, v in labels if node.by and k in node.by)
            groups.setdefault(key, []).append(value)
        return {key: (sum(vs) if node.op == "sum" else max(vs)) for key, vs in groups.items()}
    if node.op == "quantile":
        buckets = evaluate(node.args[0], scrapes, i)
        edges = sorted((float(dict(labels)["le"]), value) for labels, value in buckets.items())
        total = edges[-1][1] if edges else 0.0
        if total <= 0:
            return {}
        rank, below, lower = node.q * total, 0.0, 0.0
        for upper, count in edges:
            if count >= rank:
                if math.isinf(upper):
                    return {(): lower}
                share = (rank - below) / (count - below) if count > below else 0.0
                return {(): lower + (upper - lower) * share}
            below, lower = count, upper
        return {(): lower}
    if node.op == "div":
        a, b = evaluate(node.args[0], scrapes, i), evaluate(node.args[1], scrapes, i)
        return {labels: a[labels] / b[labels] for labels in a if b.get(labels)}
    raise ValueError(node.op)


def scrape(url: str) -> dict[str, Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found: dict[str, Sample] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def legend(fmt: str, labels: Labels) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: dict(labels).get(m.group(1), m.group(1)), fmt)


def draw(dashboard: dict, scrapes: list[tuple[float, dict[str, Sample]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    cols, rows = 2, math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 2.6 * rows))
    start = scrapes[0][0]
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel["title"], fontsize=10, loc="left")
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            node = parse(target["expr"])
            series: dict[Labels, tuple[list[float], list[float]]] = {}
            for i in range(len(scrapes)):
                for labels, value in evaluate(node, scrapes, i).items():
                    xs, ys = series.setdefault(labels, ([], []))
                    xs.append((scrapes[i][0] - start) / 60)
                    ys.append(value * (100 if unit == "percentunit" else 1))
            for labels, (xs, ys) in sorted(series.items()):
                if panel["type"] == "stat":
                    ax.text(0.5, 0.45, f"{ys[-1]:g}", fontsize=28, ha="center", va="center", transform=ax.transAxes)
                    ax.text(0.5, 0.12, legend(target["legendFormat"], labels), ha="center", transform=ax.transAxes)
                else:
                    ax.plot(xs, ys, label=legend(target["legendFormat"], labels), linewidth=1.4)
        if panel["type"] == "stat":
            ax.set_axis_off()
            continue
        if not ax.lines:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", color="gray", transform=ax.transAxes)
        ax.set_ylabel({"percentunit": "%", "bytes": "bytes", "reqps": "req/s"}.get(unit, unit), fontsize=8)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.suptitle("syshax dashboard (docs/grafana/syshax-dashboard.json), drawn from a real daemon's /metrics",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the load runs (default: 150)")
    parser.add_argument("--out", default=str(OUT), help="the PNG to write")
    args = parser.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            parse(target["expr"])  # refuse a query this cannot draw before the daemon starts

    sys.path.insert(0, str(REPO))
    from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon

    daemon = asyncio.run(start_daemon("cpu", command=daemon_command()))
    scrapes: list[tuple[float, dict[str, Sample]]] = []
    done = threading.Event()

    def scraper() -> None:
        while not done.is_set():
            scrapes.append((time.monotonic(), scrape(daemon.url)))
            done.wait(2.0)

    thread = threading.Thread(target=scraper, daemon=True)
    try:
        thread.start()
        time.sleep(10)  # an idle stretch first, as a dashboard shows one
        load = subprocess.Popen([str(Path(sys.executable).with_name("syshax")), "benchmark", "--url", f"syshaxd={daemon.url}",
                                 "--scenario", "chat", "--concurrency", "4", "--iterations", "64", "--turns", "4",
                                 "--timeout", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            load.wait(timeout=args.seconds)
        except subprocess.TimeoutExpired:
            load.terminate()
            load.wait()
        time.sleep(20)  # and the tail, where the rates fall back
    finally:
        done.set()
        thread.join()
        asyncio.run(stop_daemon(daemon.process))
    draw(dashboard, scrapes, Path(args.out))
    print(f"wrote {args.out} from {len(scrapes)} scrapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
