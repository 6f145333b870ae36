"""Benchmark scenarios: input and output lengths and the concurrency levels each one sweeps."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Scenario", "SCENARIOS", "CHAT", "CHAT_SYSTEM_LEN", "CHAT_TURNS", "scenario_named", "parse_concurrency"]


@dataclass(frozen=True)
class Scenario:
    """One workload shape: every request has input_len prompt tokens and asks for output_len tokens."""

    name: str
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "concurrency": list(self.concurrency),
        }


# The seed article's three shapes (chat-like, long answers, long context with a short answer) and a multi-turn chat.
SCENARIOS: dict[str, Scenario] = {
    "short": Scenario("short", 128, 256, (1, 2, 4, 8, 16)),
    "medium": Scenario("medium", 512, 1024, (1, 2, 4, 8)),
    "long": Scenario("long", 2048, 512, (1, 2, 4)),
    # Multi-turn: input_len is each user message; --system-len and --turns shape the rest (see chat.py).
    "chat": Scenario("chat", 32, 64, (1, 4, 8)),
}
CHAT = "chat"
CHAT_SYSTEM_LEN = 512
CHAT_TURNS = 6
CUSTOM_CONCURRENCY = (1, 2, 4, 8)


def scenario_named(
    name: str,
    input_len: int | None = None,
    output_len: int | None = None,
    concurrency: tuple[int, ...] | None = None,
) -> Scenario:
    """The scenario called name, with any of its lengths or levels replaced by the ones given.

    `custom` has no lengths of its own, so it needs both input_len and output_len.
    """
    if name == "custom":
        if input_len is None or output_len is None:
            raise ValueError("--scenario custom needs both --input-len and --output-len")
        base = Scenario("custom", input_len, output_len, CUSTOM_CONCURRENCY)
    elif name in SCENARIOS:
        base = SCENARIOS[name]
    else:
        allowed = ", ".join([*SCENARIOS, "custom"])
        raise ValueError(f"--scenario: unknown scenario {name!r}; allowed: {allowed}")
    scenario = Scenario(
        base.name,
        base.input_len if input_len is None else input_len,
        base.output_len if output_len is None else output_len,
        base.concurrency if concurrency is None else concurrency,
    )
    if scenario.input_len < 1:
        raise ValueError(f"--input-len: {scenario.input_len} is not allowed; it must be at least 1")
    if scenario.output_len < 1:
        raise ValueError(f"--output-len: {scenario.output_len} is not allowed; it must be at least 1")
    return scenario


def parse_concurrency(text: str) -> tuple[int, ...]:
    """Concurrency levels from "8" or "1,2,4,8": positive, de-duplicated, in ascending order."""
    levels: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            level = int(part)
        except ValueError:
            raise ValueError(f"--concurrency: {part!r} is not a whole number; give N or a list like 1,2,4,8") from None
        if level < 1:
            raise ValueError(f"--concurrency: {level} is not allowed; levels must be at least 1")
        levels.add(level)
    if not levels:
        raise ValueError(f"--concurrency: {text!r} names no level; give N or a list like 1,2,4,8")
    return tuple(sorted(levels))
