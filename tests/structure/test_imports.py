"""Who imports whom, read from the source with ast: no import cycles, plugins stand on the core and never on each other.

The core is the `syshaxd` package; a plugin is each package under plugins/<name>/ (its own distribution).
Cycles are counted among imports that run when a module is imported, and then among every import, those inside
functions and under `if TYPE_CHECKING:` too: a type-only circle is still two modules that cannot be read apart. The
plugin, core and floor rules count every import, wherever it is written.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = "syshaxd"
SDK = "syshaxd.sdk"  # all that plugins may import of the core


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # module name, resolved to the longest known module
    line: int
    at_import_time: bool  # False inside a function body or under `if TYPE_CHECKING:`
    type_checking: bool = False  # under `if TYPE_CHECKING:`: never runs


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

    def add(name: str, line: int, at_import_time: bool, type_checking: bool) -> None:
        target = resolve(name)
        if target is not None and target != module:
            found.append(Import(module, target, line, at_import_time, type_checking))

    def visit(node: ast.AST, at_import_time: bool, type_checking: bool = False) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False, True)
            for child in node.orelse:
                visit(child, at_import_time, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, at_import_time, type_checking)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                add(f"{prefix}.{alias.name}", node.lineno, at_import_time, type_checking)  # a submodule, or its prefix
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time, type_checking)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def in_sdk(module: str) -> bool:
    return module == SDK or module.startswith(SDK + ".")


def layering_errors(imports: list[Import], plugins: set[str]) -> list[str]:
    """The core importing a plugin, a plugin importing another plugin or the core outside its SDK, or the SDK
    importing the serving side."""
    errors = []
    for i in imports:
        src, dst = top(i.importer), top(i.imported)
        if src == CORE and dst in plugins:
            errors.append(f"{i.importer}:{i.line}: the core imports plugin {i.imported}")
        elif src in plugins and dst in plugins and src != dst:
            errors.append(f"{i.importer}:{i.line}: plugin {src} imports plugin {i.imported}")
        elif src in plugins and dst == CORE and not in_sdk(i.imported):
            errors.append(f"{i.importer}:{i.line}: plugin {src} imports {i.imported}, outside the SDK ({SDK})")
        elif in_sdk(i.importer) and dst == CORE and not in_sdk(i.imported) and i.imported != CORE:
            errors.append(f"{i.importer}:{i.line}: the SDK imports the serving side's {i.imported}")
    return errors


WORKER_ENTRY = "syshaxd.sdk.worker"  # the worker process's loop: where a plugin's engine runs


def sdk_strays(imports: list[Import], sdk_modules: set[str], plugins: set[str]) -> list[str]:
    """The SDK's modules that neither a plugin nor the worker process reaches (directly or through other SDK
    modules): daemon-only code that belongs on the serving side."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.importer, set()).add(i.imported)
    reached: set[str] = set()
    todo = [i.imported for i in imports if top(i.importer) in plugins and in_sdk(i.imported)] + [WORKER_ENTRY]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(m for m in graph.get(module, ()) if in_sdk(m))
    packages = {m.rpartition(".")[0] for m in reached}  # a reached module's package __init__ runs too
    return sorted(m for m in sdk_modules if m not in reached and m not in packages and m != SDK)


def import_cycles(imports: list[Import], every: bool = False) -> list[list[str]]:
    """Cycles among the imports that run at import time, or with every, among all imports: those inside functions
    and under `if TYPE_CHECKING:` too (each found once, as the modules along it)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.at_import_time or every:
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


def analyse(root: Path, every: bool = False) -> tuple[list[str], list[list[str]]]:
    core, plugin_dirs = project_packages(root)
    modules = modules_under(root, [core, *plugin_dirs])
    known = set(modules)
    imports = [i for name, path in modules.items() for i in imports_of(name, path, known)]
    return layering_errors(imports, {p.name for p in plugin_dirs}), import_cycles(imports, every)


def test_the_sdk_holds_only_what_plugins_and_workers_import():
    # sdk/ is what a plugin may import; a module there that no plugin and no worker reaches is the daemon's own
    # and belongs under syshaxd/engine, syshaxd/api or beside the daemon
    core, plugin_dirs = project_packages(REPO)
    modules = modules_under(REPO, [core, *plugin_dirs])
    imports = [i for name, path in modules.items() for i in imports_of(name, path, set(modules))]
    strays = sdk_strays(imports, {m for m in modules if in_sdk(m)}, {p.name for p in plugin_dirs})
    assert not strays, f"only the daemon uses {strays}: move them out of {SDK}"


def test_the_tree_has_plugins_and_a_core():
    core, plugins = project_packages(REPO)
    assert core.is_dir()
    assert {p.name for p in plugins} >= {"syshax_llamacpp", "syshax_torch", "syshax_vllm"}


def test_plugins_depend_on_the_core_only():
    errors, _ = analyse(REPO)
    assert not errors, "\n".join(errors)


def test_no_import_cycles_not_even_a_deferred_or_type_only_one():
    _, cycles = analyse(REPO, every=True)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


# The core's rooms by floor: a room imports only rooms on its floor's level or below (a package room is every
# module under it). A module that is in no room here fails the test below until it is given its floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("syshaxd",),  # the package itself: its version
    ("syshaxd.sdk", "syshaxd.environment", "syshaxd.notify", "syshaxd.recent"),
    ("syshaxd.model", "syshaxd.model_entries", "syshaxd.routing_rules"),  # what a config's tables are
    ("syshaxd.config",),
    ("syshaxd.engine",),
    ("syshaxd.metrics", "syshaxd.startup", "syshaxd.status_text", "syshaxd.benchmark"),
    ("syshaxd.api", "syshaxd.remote"),
    ("syshaxd.daemon", "syshaxd.cli"),
    ("syshaxd.docs_reference", "syshaxd.__main__"),
)


def floor_of(module: str, floors: tuple[tuple[str, ...], ...] = FLOORS) -> int | None:
    """The floor of the longest room that holds module; None where no room does."""
    best: tuple[int, int] | None = None
    for level, rooms in enumerate(floors):
        for room in rooms:
            holds = module == room or (room != CORE and module.startswith(room + "."))  # "syshaxd": __init__ alone
            if holds and (best is None or len(room) > best[1]):
                best = (level, len(room))
    return best[0] if best is not None else None


def floor_errors(imports: list[Import], modules: set[str], floors: tuple[tuple[str, ...], ...] = FLOORS) -> list[str]:
    errors = [f"{m}: in no room of FLOORS; give it its floor" for m in sorted(modules) if floor_of(m, floors) is None]
    for i in imports:
        low, high = floor_of(i.importer, floors), floor_of(i.imported, floors)
        if low is not None and high is not None and high > low:
            errors.append(f"{i.importer}:{i.line}: imports {i.imported}, a floor above it")
    return list(dict.fromkeys(errors))  # one line for an import of several names


def test_each_room_of_the_core_imports_only_rooms_below_it():
    core = REPO / CORE
    modules = modules_under(REPO, [core])
    imports = [i for name, path in modules.items() for i in imports_of(name, path, set(modules))]
    errors = floor_errors(imports, set(modules))
    assert not errors, "\n".join(errors)


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
        "syshaxd/e.py": "import syshaxd.d\n",  # a cycle only when type-only imports count (every=True)
        "syshaxd/f.py": "def late():\n    import syshaxd.g\n",  # a deferred cycle
        "syshaxd/g.py": "import syshaxd.f\n",
        "syshaxd/sdk/__init__.py": "",
        "syshaxd/sdk/types.py": "def late():\n    from syshaxd.a import x\n",  # the SDK reaching into the serving side
        "plugins/one/syshax_one/__init__.py": "",
        "plugins/one/syshax_one/engine.py": "from syshaxd.sdk.types import x\nfrom syshax_two.plugin import y\n",
        "plugins/two/syshax_two/__init__.py": "",
        "plugins/two/syshax_two/plugin.py": "import syshaxd.b\n",  # a plugin importing the core outside the SDK
    })
    errors, cycles = analyse(tmp_path)
    assert errors == ["syshaxd.c:2: the core imports plugin syshax_one.engine",
                      "syshaxd.sdk.types:2: the SDK imports the serving side's syshaxd.a",
                      "syshax_one.engine:2: plugin syshax_one imports plugin syshax_two.plugin",
                      "syshax_two.plugin:1: plugin syshax_two imports syshaxd.b, outside the SDK (syshaxd.sdk)"]
    assert cycles == [["syshaxd.a", "syshaxd.b", "syshaxd.a"]]
    (tmp_path / "syshaxd/sdk/worker.py").write_text("from syshaxd.sdk import types\n")
    (tmp_path / "syshaxd/sdk/pipe.py").write_text("")  # no plugin or worker imports it
    modules = modules_under(tmp_path, [tmp_path / "syshaxd", tmp_path / "plugins/one/syshax_one"])
    imports = [i for name, path in modules.items() for i in imports_of(name, path, set(modules))]
    assert sdk_strays(imports, {m for m in modules if in_sdk(m)}, {"syshax_one"}) == ["syshaxd.sdk.pipe"]
    _, all_cycles = analyse(tmp_path, every=True)
    assert all_cycles == [["syshaxd.a", "syshaxd.b", "syshaxd.a"], ["syshaxd.d", "syshaxd.e", "syshaxd.d"],
                          ["syshaxd.f", "syshaxd.g", "syshaxd.f"]]
    floors = (("syshaxd.sdk",), ("syshaxd.a", "syshaxd.b"), ("syshaxd.c",))
    core_imports = [i for name, path in modules_under(tmp_path, [tmp_path / "syshaxd"]).items()
                    for i in imports_of(name, path, set(modules_under(tmp_path, [tmp_path / "syshaxd"])))]
    assert floor_errors([i for i in core_imports if i.importer == "syshaxd.sdk.types"], {"syshaxd.sdk.types"},
                        floors) == ["syshaxd.sdk.types:2: imports syshaxd.a, a floor above it"]
    assert floor_errors([], {"syshaxd.sdk.types", "syshaxd.z"}, floors) == [
        "syshaxd.z: in no room of FLOORS; give it its floor"]
    assert floor_errors([], {"syshaxd", "syshaxd.newthing"}) == [  # the real floors: the package holds no module
        "syshaxd.newthing: in no room of FLOORS; give it its floor"]
