"""One request's state inside the llama.cpp engine, from submit to its last Delta.

Its own module because every part of the engine (stepping, sampling, the prefix cache, the handoff) reads and
writes it: one place says what a sequence holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from syshax_llamacpp import prefix
from syshax_llamacpp.checkpoints import Checkpoint
from syshax_llamacpp.drafting import Acceptance, PromptLookup
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.types import GenerateRequest, Handling


@dataclass(eq=False)
class Sequence:
    """One request's life in the context: prefill (pending prompt tokens), then decode."""

    request: GenerateRequest
    prompt: list[int]
    max_tokens: int
    seq_id: int = -1
    n_past: int = 0  # tokens of this sequence already in the KV cache
    pending: deque = field(default_factory=deque)  # prompt tokens not yet evaluated
    next_token: int | None = None  # sampled, not yet fed back
    slotted: bool = False  # holds one of the max_batch_size slots (from _seat to _release)
    sampler: object = None
    out: SequenceOutput | None = None
    started: float = 0.0
    handling: Handling = field(default_factory=Handling)  # how the daemon has it run here (KV, handoff, resume)
    cached: bool = False  # the prompt may start from blocks of the prefix cache (handling.prefix)
    found: prefix.Found | None = None  # the cached records checked when it was submitted
    hit_tokens: int = 0  # prompt tokens it took from the prefix cache
    checkpoint: Checkpoint | None = None  # the whole state its prompt starts from (checkpoints.py), until set
    # request.prompt_logprobs: the prompt's logprobs as its chunks run (None for its first token), sent once
    prompt_lp: list | None = None
    fed: list[int] = field(default_factory=list)  # generated tokens evaluated: in the KV after the prompt
    # speculative decoding (drafting.py): its tokens indexed for guesses, made at its first decode step; and how
    # many of its guessed tokens were kept
    lookup: PromptLookup | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    # ... of the draft model's guesses (config draft_model), and whether this step's guess is the draft's
    drafts: Acceptance = field(default_factory=Acceptance)
    drafted: bool = False
