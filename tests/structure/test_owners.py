"""The llama.cpp engine's objects keep their state to themselves: no module of the plugin reads or writes another
object's private attribute (`x._name`, where x is not self or cls). Each owner (prompt_context, decode_batch, slots,
prefix_side, handoff, sampling, guessing, proofs, stepping) is asked through what it makes public, so what one owns
another cannot reach into, and a reader finds every use of an owner's state in its own file. Third-party modules'
private names (llama-cpp-python's library path) are theirs to keep; the test allows those by their import.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "plugins" / "llamacpp" / "syshax_llamacpp"


def third_party_names(tree: ast.Module) -> set[str]:
    """Names a module binds to imports from outside the project (llama_cpp, numpy, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(("syshaxd", "syshax_")):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(("syshaxd", "syshax_")):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def reaches_into(source: str) -> list[str]:
    """`x._name` uses in source where x is neither self, cls nor a third-party import."""
    tree = ast.parse(source)
    outside = third_party_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls"} | outside:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_of_the_engine_reaches_into_another_s_state():
    modules = sorted(ENGINE.glob("*.py"))
    assert len(modules) >= 20 and (ENGINE / "stepping.py") in modules
    found = {path.name: hits for path in modules if (hits := reaches_into(path.read_text()))}
    assert found == {}


def test_the_check_finds_a_reach_into_another_owner():
    # the check that passes the engine fails the mixins' way of sharing: a part reading another's private state
    assert reaches_into("class Stepper:\n    def step(self):\n        return self.prefix._unkept\n") == [
        "3: self.prefix._unkept"]
    assert reaches_into("def f(engine):\n    engine._state.ensure(8)\n") == ["2: engine._state"]
    assert reaches_into("from llama_cpp import llama_cpp as lib\nprint(lib._base_path)\n") == []
