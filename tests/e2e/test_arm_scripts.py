"""The scripts behind `make test-arm` (mk/test-arm.sh, mk/llama-arm-wheel.sh) and the wheel mk/llama-wheel.sh takes
from elsewhere (SYSHAX_LLAMA_WHEEL). make test-arm itself runs under qemu for 20 to 30 minutes and is not part of the
suite; these check what would break it before anyone runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MK = REPO / "mk"


@pytest.mark.parametrize("script", ["test-arm.sh", "llama-arm-wheel.sh", "llama-wheel.sh"])
def test_the_script_parses(script):
    done = subprocess.run(["bash", "-n", str(MK / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_test_make_test_arm_runs_by_default_is_one_the_suite_has():
    block = re.search(r'TESTS=\$\{ARM_TESTS:-"(.*?)"\}', (MK / "test-arm.sh").read_text(), re.S).group(1)
    ids = block.split()
    assert len(ids) >= 5
    for node in ids:
        path, _, name = node.partition("::")
        assert (REPO / path).is_file(), node
        assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), node
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *ids], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert f"{len(ids)} tests collected" in collected.stdout, collected.stdout


def llama_wheel(wheel: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(MK / "llama-wheel.sh"), sys.executable], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "SYSHAX_LLAMA_WHEEL": wheel},
                          cwd=cwd, timeout=30)


def test_a_wheel_from_elsewhere_is_taken_as_it_is_and_nothing_is_built(tmp_path):
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl"
    wheel.write_bytes(b"PK")
    done = llama_wheel(str(wheel))
    assert done.returncode == 0 and done.stdout == f"{wheel}\n", done.stderr
    assert "instead of building one" in done.stderr
    beside = llama_wheel(wheel.name, cwd=tmp_path)  # a name in the folder it runs in
    assert beside.returncode == 0 and beside.stdout == f"{wheel.name}\n", beside.stderr


@pytest.mark.parametrize("name, says", [
    ("llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl", "does not exist"),
    ("llama_cpp_python-0.3.35-py3-none-any.whl", "is not a llama-cpp-python 0.3.36"),
    ("something.tar.gz", "is not a llama-cpp-python 0.3.36"),
])
def test_a_wheel_from_elsewhere_that_is_missing_or_another_version_is_refused_by_name(tmp_path, name, says):
    done = llama_wheel(str(tmp_path / name))
    assert done.returncode == 2 and done.stdout == ""
    assert f"SYSHAX_LLAMA_WHEEL={tmp_path / name} {says}" in done.stderr
