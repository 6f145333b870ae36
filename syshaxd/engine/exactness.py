"""Which of the README's greedy promises hold on this daemon, from what its workers proved at their warm-ups.

Two promises depend on the engines: hetero (and auto's offload) returns exactly the tokens cpu mode returns, and a
request resumed after its worker died (or its node's link was lost) returns the text of an undisturbed run. Both
hold where every engine on the way gives a token the same bits from a decode step as from a prompt pass of any
chunking: a llama.cpp worker that tiles every query row's attention and proved it at its warm-up (`exact_decode`).
Another engine (torch, vLLM) computes the prompt's KV its own way: its handoffs are judged teacher-forced (top-1
agreement, KL: tests/teacher_forced.py), not token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from syshaxd.engine.lifecycle import HandleState
from syshaxd.sdk.gguf.quantize import ROW_EXACT_TYPES
from syshaxd.sdk.types import EngineSpec, Pool


class ProvingEngine(Protocol):
    """What the promises read of an engine: every EngineHandle (engine/engine_handle.py) is one."""

    name: str
    spec: EngineSpec
    info: dict

    @property
    def state(self) -> HandleState: ...


@dataclass(frozen=True)
class ExactStatus:
    """`/v1/syshax/status`'s `exact` and `syshax status`'s line: each promise, and why it does not hold where not."""

    hetero_equals_cpu: bool | None  # None: this daemon has no hetero route (no prefill engine with a ring)
    resume_exact: bool
    why: list[str] = field(default_factory=list)  # one line per worker that breaks a promise, naming it


def _proved(worker: ProvingEngine) -> bool | None:
    """Whether the worker's engine proved a decode step gives a prompt chunk's bits: its last ready report, or the
    proof its supervisor keeps across restarts; None while it has said nothing yet."""
    if "exact_decode" in worker.info:
        return bool(worker.info["exact_decode"])
    proven = getattr(worker.spec, "proven", None)
    return proven.exact_decode if proven is not None else None


def _why_not(worker: ProvingEngine, file_type: str = "") -> str:
    attention = worker.info.get("attention")
    if _proved(worker) is None and not attention:
        if worker.state != HandleState.READY:
            return f"{worker.name} is {worker.state}: it has proved nothing yet"
        return (f"{worker.name} runs {worker.spec.backend}, which computes KV its own way (its handoffs are judged "
                "teacher-forced: top-1 agreement and KL)")
    if attention == "llama.cpp":
        why = worker.info.get("attention_why") or ("tiled_attention = false, or a CPU without AVX-512 or AVX2 with "
                                                   "F16C and FMA")
        return f"{worker.name} runs llama.cpp's own attention ({why}): a near-tie can flip"
    unproven = [t for t in worker.info.get("weight_types", []) if t not in ROW_EXACT_TYPES]
    if unproven:
        return (f"{worker.name}'s warm-up found that a decode step gives other bits than a prompt chunk with this "
                f"model's {', '.join(unproven)} weights{f' ({file_type})' if file_type else ''}, whose llama.cpp "
                "kernels sum a row by how many rows share it: a near-tie can flip")
    return (f"{worker.name}'s warm-up found that a decode step gives other bits than a prompt chunk (a llama.cpp not "
            "built by mk/llama-wheel.sh, or a CPU other than x86's?): a near-tie can flip")


def exactness(workers: Sequence[ProvingEngine], hetero: bool, file_type: str = "") -> ExactStatus:
    """The promises over `workers` (local handles and remote nodes); `hetero`: the daemon serves the hetero route;
    `file_type`: the served GGUF's weight type (Q4_K_M, ...), named where it is why a promise fails."""
    decoders = [w for w in workers if w.spec.pool in (Pool.CPU, Pool.GPU)]  # they generate: resumes run there
    prefill = [w for w in workers if w.spec.pool == Pool.PREFILL or (w.spec.pool == Pool.GPU and w.spec.ring)]
    why: list[str] = []
    for w in decoders + [p for p in prefill if p not in decoders]:
        if not _proved(w):
            why.append(_why_not(w, file_type))
    resume = all(_proved(w) for w in decoders)
    equal = all(_proved(w) for w in decoders if w.spec.pool == Pool.CPU) and all(_proved(w) for w in prefill)
    return ExactStatus(hetero_equals_cpu=equal if hetero else None, resume_exact=resume, why=why)
