"""The reference generated from the code (docs/reference/) is current, complete, and the docs name nothing that
does not exist: no environment variable, metric, config key, command or flag the code lacks.

No daemon: every check reads the code's own tables, parsers and registry.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from syshaxd import docs_reference as ref
from syshaxd.config import KEYS, SECTIONS, table_of
from syshaxd.config import TABLES as CONFIG_TABLES
from syshaxd.environment import BY_NAME, KINDS, VARIABLES
from syshaxd.model_entries import ENTRY_KEYS

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# SYSHAX_ names the docs may write that are not environment variables (C macros of mk/patches/), each with why.
NOT_VARIABLES: dict[str, str] = {}


# --- the pages are current -------------------------------------------------------------------

def test_committed_pages_are_what_the_code_writes():
    stale = list(ref.stale(REPO / "docs" / "reference"))
    assert not stale, f"stale in docs/reference: {', '.join(stale)}; regenerate with: {ref.COMMAND}"


def test_check_names_a_stale_page(tmp_path, capsys):
    assert ref.main(["--write", str(tmp_path)]) == 0
    assert ref.main(["--check", str(tmp_path)]) == 0
    (tmp_path / "metrics.md").write_text("edited by hand\n")
    assert ref.main(["--check", str(tmp_path)]) == 1
    assert "metrics.md" in capsys.readouterr().err


# --- everything has a description ------------------------------------------------------------

def test_every_config_key_has_a_description_and_a_section():
    for name, f in KEYS.items():
        assert f.metadata.get("doc", "").strip(), f"config key {name} has no description (config.py's key(...))"
        assert f.metadata.get("section") in SECTIONS, f"config key {name}: section {f.metadata.get('section')!r}"


def test_every_variable_has_a_description_and_is_read_where_it_says():
    assert len(BY_NAME) == len(VARIABLES), "an environment variable is listed twice"
    for v in VARIABLES:
        assert v.doc.strip() and v.kind in KINDS, v
        if v.kind == "test hook":
            assert v.effect, f"{v.name}: a test hook needs the effect the daemon's warning names"
        path = REPO / v.read_in
        if "/" in v.read_in and " " not in v.read_in:
            assert v.name in path.read_text(), f"{v.name} is not read in {v.read_in}; correct its read_in"


# what reads a variable: os.environ["X"], os.environ.get("X"), env.get("X"), getenv("X"); in a script ${X:-...}
_READS = re.compile(r"""(?:environ|env|getenv)(?:\.get|\.setdefault)?\(?\[?\s*["']([A-Z][A-Z0-9_]+)["']""")
_SCRIPT_READS = re.compile(r"\$\{([A-Z][A-Z0-9_]*):?-")


def test_every_variable_the_code_reads_is_in_the_table():
    sources = [*(REPO / "syshaxd").rglob("*.py"), *(REPO / "plugins").glob("*/syshax_*/**/*.py")]
    read = {(name, p) for p in sources for name in _READS.findall(p.read_text())}
    read |= {(name, p) for p in (REPO / "mk").glob("*.sh") for name in _SCRIPT_READS.findall(p.read_text())}
    missing = sorted(f"{name} ({p.relative_to(REPO)})" for name, p in read if name not in BY_NAME)
    assert not missing, f"read but not in syshaxd/environment.py's VARIABLES: {', '.join(missing)}"


def test_every_flag_has_help():
    hidden = set()
    for command in ref.commands():
        for action in ref.arguments(command):
            if (command.name, action.dest) in ref.HIDDEN:
                hidden.add((command.name, action.dest))
                continue
            text = ref.help_text(command, action)
            if action.option_strings:
                assert text, f"{command.name} {'/'.join(action.option_strings)}: no help text"
            else:
                assert text or action.choices, f"{command.name} {action.dest}: neither help nor choices"
    assert hidden == set(ref.HIDDEN), f"docs_reference.HIDDEN names arguments that do not exist: " \
                                      f"{set(ref.HIDDEN) - hidden}"


def test_every_metric_has_help():
    families = ref.metric_families()
    assert len({f.name for f in families}) == len(families)
    for f in families:
        assert f.help.strip(), f"metric {f.name} has no help text"
        assert f.name.startswith(("syshax_", "vllm:")), f"metric {f.name}: neither syshax_ nor vLLM's vllm:"


def test_every_route_has_a_line():
    served = {(r.method, r.path) for r in ref.routes()}
    for r in ref.routes():
        assert r.summary, f"{r.method} {r.path}: no summary in the OpenAPI document, no docstring, not in " \
                          "docs_reference.UNDOCUMENTED_ROUTES"
    assert set(ref.UNDOCUMENTED_ROUTES) <= served, "UNDOCUMENTED_ROUTES names a route the daemon does not serve"


def test_test_hooks_are_marked_in_the_reference():
    page = ref.environment_page()
    for v in VARIABLES:
        if v.kind == "test hook":
            assert f"### {v.name}\n\n**Test hook.**" in page


# --- the docs name nothing that does not exist -----------------------------------------------

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_INLINE = re.compile(r"`([^`\n]+)`")


def _blocks(text: str) -> tuple[list[tuple[int, str, str]], list[tuple[int, str]]]:
    """Fenced blocks as (line number, language, text of each line, joined), and the prose lines outside them."""
    blocks, prose = [], []
    fence = lang = None
    body: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, lang, body, start = m.group(1), m.group(2).lower(), [], n + 1
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
            blocks.append((start, lang, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append((n, line))
    return blocks, prose


def _code(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every piece of code in a page: inline code spans and the lines of fenced blocks."""
    blocks, prose = _blocks(path.read_text())
    found = [(n, span) for n, line in prose for span in _INLINE.findall(line)]
    for start, _, body in blocks:
        found += [(start + i, line) for i, line in enumerate(body.splitlines())]
    return found


def _where(path: Path, n: int) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{n}"


def _variable_problems(path: Path) -> list[str]:
    return [f"{_where(path, n)}: {name}" for n, line in enumerate(path.read_text().splitlines(), 1)
            for name in re.findall(r"\bSYSHAX_[A-Z0-9][A-Z0-9_]*\b", line)
            if name not in BY_NAME and name not in NOT_VARIABLES]


def test_docs_name_only_variables_that_exist():
    wrong = [problem for path in DOCS for problem in _variable_problems(path)]
    assert not wrong, "environment variables the docs name but syshaxd/environment.py lacks:\n" + "\n".join(wrong)


_METRIC = re.compile(r"(?<![\w/.:-])(syshax_[a-z0-9_]+\*?|vllm:[a-z0-9_]+\*?)")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
# syshax_llamacpp, syshax_vllm, ...: the plugins' packages, which the docs name in code too
PACKAGES = {p.name for p in (REPO / "plugins").glob("*/syshax_*") if p.is_dir()}


def _exported_names() -> set[str]:
    return {name for f in ref.metric_families() for name in (f.name, *f.series)}


def _is_exported(name: str, exported: set[str]) -> bool:
    if name.endswith("*"):  # syshax_prefix_cache_disk_*: a family of series
        return any(e.startswith(name.rstrip("*")) for e in exported)
    if name in exported:
        return True
    return any(name.endswith(s) and name.removesuffix(s) in exported for s in _SUFFIXES)


def _metric_problems(path: Path, exported: set[str]) -> list[str]:
    return [f"{_where(path, n)}: {name}" for n, code in _code(path) for name in _METRIC.findall(code)
            if name not in PACKAGES and not _is_exported(name, exported)]


def test_docs_name_only_metrics_that_exist():
    exported = _exported_names()
    wrong = [problem for path in DOCS for problem in _metric_problems(path, exported)]
    assert not wrong, "metrics the docs name that /metrics does not export:\n" + "\n".join(wrong)


RULE_FIELDS = {"name", "priority", "conditions", "action"}


# the config's tables and arrays of tables, and the keys or fields each takes
TABLES = {"auto.routing_rules": RULE_FIELDS, "models": ENTRY_KEYS} | {
    t: {k for k in KEYS if table_of(k) == t} for t in CONFIG_TABLES}


def _toml_problems(path: Path) -> list[str]:
    """Keys set in the page's toml blocks that are no key of their table (or, in [[auto.routing_rules]] and
    [[models]], no field of a rule or an entry), and config keys set outside their tables."""
    wrong = []
    blocks, _ = _blocks(path.read_text())
    for start, lang, body in blocks:
        if lang != "toml":
            continue
        table = ""
        for i, line in enumerate(body.splitlines()):
            header = re.match(r"^\s*\[\[?\s*([\w.-]+)\s*\]\]?", line)
            if header:
                table = header.group(1)
                if table not in TABLES:
                    wrong.append(f"{_where(path, start + i)}: [{table}] is no table of the config")
                continue
            m = re.match(r"^\s*([A-Za-z_][\w-]*)\s*=", line)
            if m is None:
                continue
            name = m.group(1)
            if not table:
                home = f"[{table_of(name)}]" if name in KEYS and table_of(name) else ""
                wrong.append(f"{_where(path, start + i)}: {name}" + (f" (at the top level; it lives in {home})"
                                                                     if home else ""))
            elif table in TABLES and name not in TABLES[table]:
                field = (f" (a field of [[{table}]])" if table in ("auto.routing_rules", "models")
                         else f" (not in [{table}])")
                wrong.append(f"{_where(path, start + i)}: {name}{field}")
    return wrong


def test_docs_toml_sets_only_config_keys():
    wrong = [problem for path in DOCS for problem in _toml_problems(path)]
    assert not wrong, "config keys the docs set that syshaxd/config.py lacks:\n" + "\n".join(wrong)


_SHELL = {"", "sh", "bash", "console", "shell", "shell-session", "text"}
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def _command_problems(line: str, parsers: dict[str, ref.Command]) -> list[str]:
    """What is wrong with one command line that starts with syshax or syshaxd: an unknown subcommand or flag."""
    line = _QUOTED.sub("''", line)
    line = re.split(r"\s(?:\||&&|\|\||;|#|>|2>)\s", line)[0]  # the command itself, not what it is piped to
    words = line.split()
    program = words[0].rsplit("/", 1)[-1]
    command = parsers[program]
    rest = words[1:]
    if program == "syshax" and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        if f"syshax {rest[0]}" not in parsers:
            return [f"syshax {rest[0]}: no such subcommand"]
        command = parsers[f"syshax {rest[0]}"]
    known = ref.flags(command)
    return [f"{command.name} {flag}: no such flag" for flag in re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", line)
            if flag not in known]


def _command_lines(path: Path) -> list[tuple[int, str]]:
    """Command lines in shell blocks and inline code that run syshax or syshaxd (continuations joined)."""
    blocks, prose = _blocks(path.read_text())
    found = []
    start_word = re.compile(r"^(?:\$\s+)?(?:sudo\s+)?((?:[\w./-]*/)?syshaxd?(?:\s.*)?)$")
    for start, lang, body in blocks:
        if lang not in _SHELL:
            continue
        lines = body.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            m = start_word.match(line.strip())
            if m:
                found.append((start + i, m.group(1)))
    for n, line in prose:
        for span in _INLINE.findall(line):
            m = start_word.match(span.strip())
            if m:
                found.append((n, m.group(1)))
    return found


def test_docs_run_only_commands_and_flags_that_exist():
    parsers = {c.name: c for c in ref.commands()}
    wrong = []
    for path in DOCS:
        for n, line in _command_lines(path):
            wrong += [f"{_where(path, n)}: {problem}" for problem in _command_problems(line, parsers)]
    assert not wrong, "commands or flags the docs name that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("line, problems", [
    ("syshax cache warm prompts.jsonl --json", []),
    ("syshax config set n_ctx 8192 --save | tee log", []),
    ("syshaxd [--config PATH] [--mode cpu|gpu|hetero|auto]", []),
    ("syshax benchmark --url http://x:8000 --concurrency 1,2", []),
    ("syshax cahce stats", ["syshax cahce: no such subcommand"]),
    ("syshax status --wait 5", ["syshax status --wait: no such flag"]),
    ("syshaxd --threads 4", ["syshaxd --threads: no such flag"]),
])
def test_the_command_scanner(line, problems):
    assert _command_problems(line, {c.name: c for c in ref.commands()}) == problems


def test_the_scanners_find_what_is_wrong(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Set `SYSHAX_NOPE`, not SYSHAX_CONFIG.\n\n```toml\nn_ctx = 1\nnot_a_key = 2\n"
                    "[[auto.routing_rules]]\n"
                    'name = "x"\ndevice = 1\n```\n\n`syshax_nope_total` and `syshax_prefix_cache_hits_total`, '
                    "`vllm:nope`, `syshax_prefix_cache_disk_*`, `syshax_nope_*`, `plugins/llamacpp/syshax_llamacpp`\n\n"
                    "```sh\n$ syshax cache warm p.jsonl \\\n    --jsn\n```\n")
    assert _variable_problems(page) == ["page.md:1: SYSHAX_NOPE"]
    assert _toml_problems(page) == ["page.md:4: n_ctx (at the top level; it lives in [engines])",
                                    "page.md:5: not_a_key", "page.md:8: device (a field of [[auto.routing_rules]])"]
    assert _metric_problems(page, _exported_names()) == ["page.md:11: syshax_nope_total", "page.md:11: vllm:nope",
                                                         "page.md:11: syshax_nope_*"]
    assert _command_lines(page) == [(14, "syshax cache warm p.jsonl      --jsn")]
    page.write_text("```toml\n[engines]\nport = 1\n[routing_rules]\nname = 1\n```\n")
    assert _toml_problems(page) == ["page.md:3: port (not in [engines])",
                                    "page.md:4: [routing_rules] is no table of the config"]


def test_help_expands_like_argparse():
    # help_text must show what --help shows
    parser = argparse.ArgumentParser(prog="x")
    action = parser.add_argument("--n", default=3, help="count (default %(default)s)")
    assert ref.help_text(ref.Command("x", parser, ""), action) == "count (default 3)"
