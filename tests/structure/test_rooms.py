"""The suite's rooms: every test module stands in one of them, and each room and need is a registered marker."""

from __future__ import annotations

import tomllib
from pathlib import Path

from conftest import ROOMS

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_stands_in_a_room():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"{loose}: move each into its room, one of tests/{{{','.join(ROOMS)}}}/"
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders == set(ROOMS), f"test folders {sorted(folders)} are not the rooms {sorted(ROOMS)} (conftest.py)"


def test_every_marker_the_suite_sets_is_registered():
    pyproject = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    registered = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert registered >= set(ROOMS) | {"slow", "browser", "namespaces", "vllm"}
