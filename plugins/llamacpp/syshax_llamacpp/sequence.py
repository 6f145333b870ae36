"""One request's state inside the llama.cpp engine, from submit to its last Delta, and the states it passes through.

Its own module because every owner of the engine (the slot table, the decode batch, the prompt's reuse, the
handoff, the sampler) is handed sequences: one place says what a sequence holds and which way its state may go.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from syshax_llamacpp import prefix
from syshax_llamacpp.checkpoints import Checkpoint
from syshax_llamacpp.drafting import Acceptance, PromptLookup
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.types import GenerateRequest, Handling


class SlotState(Enum):
    """Where a sequence is in the engine, as llama.cpp's server has its slot states and vLLM its RequestStatus."""

    QUEUED = "queued"  # accepted, waiting in the slot table's queue for a batch slot
    PROMPT = "prompt"  # its prompt runs in the prompt context, a chunk a step (or its KV record is read)
    DECODING = "decoding"  # its KV is in a stream of the batch context: a row in every decode step
    DONE = "done"  # finished, failed, cancelled or handed on: no slot, no stream, no sampler


# every move a sequence's state may make; Sequence.enter refuses any other
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.QUEUED: frozenset({SlotState.PROMPT, SlotState.DONE}),
    SlotState.PROMPT: frozenset({SlotState.DECODING, SlotState.DONE}),
    SlotState.DECODING: frozenset({SlotState.DONE}),
    SlotState.DONE: frozenset(),
}


@dataclass(eq=False)
class Sequence:
    """One request's life in the engine: queued, its prompt (pending tokens), then decode; done."""

    request: GenerateRequest
    prompt: list[int]
    max_tokens: int
    # decodes in this engine's batch context, so holds one of its max_batch_size slots from its seat to its end;
    # False for a prompt only handed on (a prefill worker's, or auto mode's offloaded decode)
    decodes_here: bool = True
    state: SlotState = SlotState.QUEUED
    seq_id: int = -1  # its stream of the batch context, while it has one
    n_past: int = 0  # tokens of this sequence already in the KV cache
    pending: deque = field(default_factory=deque)  # prompt tokens not yet evaluated
    next_token: int | None = None  # sampled, not yet fed back
    sampler: object = None  # its llama.cpp sampler chain (sampling.RowSampler makes and frees it)
    out: SequenceOutput | None = None
    started: float = 0.0
    handling: Handling = field(default_factory=Handling)  # how the daemon has it run here (KV, handoff, resume)
    # where its prompt may start instead of token 0, taken at its first chunk (prefix_side.py): the prefix cache's
    # records checked when it was submitted, or a whole state kept after an earlier prompt
    found: prefix.Found | None = None
    checkpoint: Checkpoint | None = None
    hit_tokens: int = 0  # prompt tokens it took from the prefix cache or a checkpoint
    # request.prompt_logprobs: the prompt's logprobs as its chunks run (None for its first token), sent once
    prompt_lp: list | None = None
    fed: list[int] = field(default_factory=list)  # generated tokens evaluated: in the KV after the prompt
    # speculative decoding (guessing.py): its tokens indexed for guesses, made at its first decode step; and how
    # many of its guessed tokens were kept
    lookup: PromptLookup | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    # ... of the draft model's guesses (config draft_model), and whether this step's guess is the draft's
    drafts: Acceptance = field(default_factory=Acceptance)
    drafted: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def enter(self, state: SlotState) -> None:
        """Move to `state`; a move TRANSITIONS does not allow is the engine's bug, raised where it happens."""
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"{self.request.request_id}: a sequence cannot go from {self.state.value} to "
                               f"{state.value}")
        self.state = state
