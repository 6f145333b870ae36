"""`syshax benchmark`: a streaming load generator, scenarios, resource sampling, and the report and plot it makes.

Entry points: `add_arguments(parser)` and `run(args) -> int` (see command.py).
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse argv as `syshax benchmark` would and run it."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="syshax benchmark",
        description="Benchmark syshaxd's modes (or any OpenAI-compatible server) on CPU/GPU/hetero scenarios.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
