"""Who imports whom, read from the source with ast: no import cycles, plugins stand on the core and never on each other.

The core is the `syshaxd` package; a plugin is each package under plugins/<name>/ (its own distribution).
Cycles are counted among imports that run when a module is imported (not those inside functions or under
`if TYPE_CHECKING:`); the plugin and core rules count every import, wherever it is written.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = "syshaxd"


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # module name, resolved to the longest known module
    line: int
    at_import_time: bool  # False inside a function body or under `if TYPE_CHECKING:`


def modules_under(root: Path, package_dirs: list[Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file of the given package directories (each a top-level package)."""
    found = {}
    for pkg in package_dirs:
        for path in sorted(pkg.rglob("*.py")):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def project_packages(root: Path) -> tuple[Path, list[Path]]:
    """The core package directory and the plugin packages (plugins/<dist>/<package>/__init__.py)."""
    plugins = sorted(p.parent for p in root.glob("plugins/*/*/__init__.py"))
    return root / CORE, plugins


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """The project modules `module` imports, each resolved to the longest known module name."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(name: str) -> str | None:
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    def add(name: str, line: int, at_import_time: bool) -> None:
        target = resolve(name)
        if target is not None and target != module:
            found.append(Import(module, target, line, at_import_time))

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import_time)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, at_import_time)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                add(f"{prefix}.{alias.name}", node.lineno, at_import_time)  # a submodule, else falls back to prefix
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def layering_errors(imports: list[Import], plugins: set[str]) -> list[str]:
    """The core importing a plugin, or a plugin importing another plugin."""
    errors = []
    for i in imports:
        src, dst = top(i.importer), top(i.imported)
        if src == CORE and dst in plugins:
            errors.append(f"{i.importer}:{i.line}: the core imports plugin {i.imported}")
        elif src in plugins and dst in plugins and src != dst:
            errors.append(f"{i.importer}:{i.line}: plugin {src} imports plugin {i.imported}")
    return errors


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Cycles among the imports that run at import time (each found once, as the modules along it)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.at_import_time:
            graph.setdefault(i.importer, set()).add(i.imported)
    cycles: list[list[str]] = []
    done: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                ring = path[path.index(nxt):]
                start = ring.index(min(ring))  # the same cycle reads the same whichever module it was met from
                ring = ring[start:] + ring[:start]
                if tuple(ring) not in done:
                    done.add(tuple(ring))
                    cycles.append(ring + ring[:1])
            elif nxt not in state:
                dfs(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    return cycles


def analyse(root: Path) -> tuple[list[str], list[list[str]]]:
    core, plugin_dirs = project_packages(root)
    modules = modules_under(root, [core, *plugin_dirs])
    known = set(modules)
    imports = [i for name, path in modules.items() for i in imports_of(name, path, known)]
    return layering_errors(imports, {p.name for p in plugin_dirs}), import_cycles(imports)


def test_the_tree_has_plugins_and_a_core():
    core, plugins = project_packages(REPO)
    assert core.is_dir()
    assert {p.name for p in plugins} >= {"syshax_llamacpp", "syshax_torch", "syshax_vllm"}


def test_plugins_depend_on_the_core_only():
    errors, _ = analyse(REPO)
    assert not errors, "\n".join(errors)


def test_no_import_cycles():
    _, cycles = analyse(REPO)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_catch_what_they_forbid(tmp_path):
    # a small tree with each fault planted once: the same code that passes the real tree must fail this one
    write(tmp_path, {
        "syshaxd/__init__.py": "",
        "syshaxd/a.py": "from syshaxd import b\n",
        "syshaxd/b.py": "from . import a\n",  # a cycle, through a relative import
        "syshaxd/c.py": "def late():\n    import syshax_one.engine\n",  # the core reaching into a plugin
        "syshaxd/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from syshaxd import e\n",
        "syshaxd/e.py": "import syshaxd.d\n",  # not a cycle: d imports e for type checking only
        "plugins/one/syshax_one/__init__.py": "",
        "plugins/one/syshax_one/engine.py": "from syshaxd.a import x\nfrom syshax_two.plugin import y\n",
        "plugins/two/syshax_two/__init__.py": "",
        "plugins/two/syshax_two/plugin.py": "import syshaxd.b\n",
    })
    errors, cycles = analyse(tmp_path)
    assert errors == ["syshaxd.c:2: the core imports plugin syshax_one.engine",
                      "syshax_one.engine:2: plugin syshax_one imports plugin syshax_two.plugin"]
    assert cycles == [["syshaxd.a", "syshaxd.b", "syshaxd.a"]]
