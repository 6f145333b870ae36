"""Fault injection for tests: an engine worker that dies as a CPU's bad kernels make it die.

The daemon reads SYSHAX_FAULT from its environment when it plans its workers (plan.py) and hands it to
each in its EngineSpec; the worker then kills itself with SIGSEGV at that point:

  warmup            in the warm-up, before it says ready (every start)
  decode            at its first engine step with work (every start: a crash loop)
  POINT:repacked    only while the engine runs other kernels than plain ones, so that the supervisor's
                    fallback to plain kernels is what makes it serve

and faults that kill nothing:

  chunking          the warm-up's proof that a prompt chunk's bits do not depend on where it starts
                    fails, as on a CPU whose kernels do depend on it (the prefix cache then resumes
                    only at whole prompt chunks); the proof of `generated` with it
  generated         the warm-up's proof that a decode step and a prompt chunk of any size give a token
                    the same bits fails, as with a stock llama.cpp (nothing generated is then kept, and a
                    hit resumes only where 64 prompt tokens or more are left to the chunk's end)
  lone              the warm-up's proof that a row decoded alone sums its attention as a batched row does
                    fails, as with a stock llama.cpp (a lone long sequence then decodes beside a padding row)
  guesses           the warm-up's proof that a sequence's rows in one decode step get the bits each gets in a
                    step of its own fails (speculative decoding then stays off)
  state             the warm-up reads its prompt's exported state as a layout the codec does not know, as a
                    model with a KV cache this engine cannot carry would make it (a ModelNotServable: the worker
                    is failed at once, not restarted with safer kernels)

This is how the tests prove the fallback and crash-loop paths on CPUs whose kernels do not crash.

SYSHAX_GUESS=always makes every decode step check every guess it has (speculative decoding, whether or not it pays
here), so that the tests prove a guess changes no text on any machine.

SYSHAX_SLOW="gpu0=0.05,decode0=0.01" makes the named workers sleep that many seconds after each engine step (a
slower engine whose speed a test controls: decider v2's tests place requests by measured speed).
"""

from __future__ import annotations

import os
import resource
import signal

POINTS = ("warmup", "decode")
PROOFS = ("chunking", "lone", "generated", "guesses")
LAYOUTS = ("state",)
CONDITIONS = ("", "repacked")


class FaultError(ValueError):
    """SYSHAX_FAULT is not one this module knows; the message says which are."""


def parse(text: str) -> str:
    """The fault as given, checked: "" or POINT or POINT:repacked."""
    if not text:
        return ""
    if text in PROOFS or text in LAYOUTS:
        return text
    point, _, condition = text.partition(":")
    if point not in POINTS or condition not in CONDITIONS:
        raise FaultError(f"SYSHAX_FAULT={text!r}: expected one of {', '.join(POINTS)}, optionally followed by "
                         f"':repacked', or one of {', '.join(PROOFS + LAYOUTS)}")
    return text


def parse_slow(text: str) -> dict[str, float]:
    """SYSHAX_SLOW's worker -> seconds of sleep after each engine step, checked."""
    slow: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, seconds = part.partition("=")
        try:
            slow[name.strip()] = float(seconds)
        except ValueError:
            raise FaultError(f"SYSHAX_SLOW={text!r}: expected WORKER=SECONDS[,WORKER=SECONDS...], e.g. gpu0=0.05")
        if not name.strip() or slow[name.strip()] < 0:
            raise FaultError(f"SYSHAX_SLOW={text!r}: expected WORKER=SECONDS with SECONDS >= 0")
    return slow


def fails_proof(fault: str, proof: str) -> bool:
    """Whether `fault` makes this warm-up proof fail (kernels whose chunk's bits depend on its start fail both)."""
    return fault == proof or (fault, proof) == ("chunking", "generated")


def crash_at(fault: str, point: str, kernels: str) -> None:
    """Die with SIGSEGV if `fault` names this point (and its condition holds for these kernels)."""
    if not fault:
        return
    want, _, condition = fault.partition(":")
    if want != point or (condition == "repacked" and kernels == "plain"):
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for a death we asked for
    os.kill(os.getpid(), signal.SIGSEGV)
