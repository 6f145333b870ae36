"""The step: one llama_decode for every decoding sequence, then one chunk of the oldest prompt; and a sequence's
life around it, from its start to its last Delta.

The Stepper owns no llama.cpp object. It asks the owners it is handed: the slot table who is seated, the decode
batch for its rows and streams, the guesser for guesses, the sampler for tokens, the prompt context for a chunk,
the prefix side where a prompt starts and what it keeps, the handoff for KV records. What it keeps itself is the
engine's counts of tokens and sequences.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from syshax_llamacpp import logprobs
from syshax_llamacpp.codec import StateShape
from syshax_llamacpp.decode_batch import DecodeBatch
from syshax_llamacpp.guessing import Guesser
from syshax_llamacpp.handoff import Handoff
from syshax_llamacpp.prefix_side import PrefixSide
from syshax_llamacpp.prompt_context import PromptContext
from syshax_llamacpp.sampling import GrammarDeadEnd, GrammarError, RowSampler, dead_end
from syshax_llamacpp.sequence import Sequence
from syshax_llamacpp.slots import SlotTable
from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.rate import TokenRate
from syshaxd.sdk.types import Delta, TokenLogprob

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")


class Stepper:
    """decode: the batch context's owner, None in a prefill-only worker (it hands every prompt on and never
    decodes); shape: how a sequence's state is laid out, for its move from the prompt context into a stream."""

    def __init__(self, slots: SlotTable, prompt: PromptContext, decode: DecodeBatch | None, *, prefix: PrefixSide,
                 handoff: Handoff, sampler: RowSampler, guesser: Guesser, vocab: Vocab, shape: StateShape) -> None:
        self.slots, self.prompt, self.decode = slots, prompt, decode
        self.prefix, self.handoff, self.sampler, self.guesser = prefix, handoff, sampler, guesser
        self.vocab, self.shape = vocab, shape
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "decode_errors": 0}
        self.rate = TokenRate()

    # --- a sequence's life ------------------------------------------------------------------

    def admit(self, seq: Sequence) -> list:
        """A sequence accepted: queued for a batch slot, or, a prompt only handed on (it holds no slot), started at
        once -- else an offloaded request's prefill would wait here for a whole generation to end."""
        if seq.decodes_here:
            self.slots.queue(seq)
            return []
        return self._start(self.slots.start_unseated(seq))

    def cancel(self, request_id: str) -> list:
        """The events of a cancel: a queued sequence leaves the queue (the daemon's ledger frees a KV record it was
        to read once it hears it was not read), an active one is released."""
        seq = self.slots.unqueue(request_id)
        if seq is not None:
            return self.handoff.not_read(seq)
        seq = self.slots.active.get(request_id)
        if seq is not None:
            self.release(seq)
        return []

    def _start(self, seq: Sequence) -> list:
        """seq is active: a sampler, its text stream, and its prompt to evaluate or its KV to import."""
        try:
            self.sampler.start(seq)
        except GrammarError as exc:
            return self._fail(-1, [seq], str(exc))
        seq.out = SequenceOutput.for_request(seq.request, seq.max_tokens, self.vocab.is_eog, self.vocab.piece_bytes,
                                             seq.handling.resume_tokens)
        if seq.request.prompt_logprobs is not None:
            seq.prompt_lp = [None]
        self.counters["prompt_tokens"] += len(seq.prompt)
        if seq.handling.kv is None and not seq.handling.kv_missing:
            seq.pending.extend(seq.prompt)
            return []
        imported, took = self.handoff.take_kv(seq)
        if not took:
            return [imported]
        handle = seq.handling.kv
        assert handle is not None
        if not self.sampler.accept_first(seq, handle.first_token):
            return [imported, *self._fail(-1, [seq], "the prefill engine's first token breaks the grammar")]
        return [imported, *self._emit(seq, handle.first_token, handle.first_logprob)]

    def release(self, seq: Sequence) -> None:
        """seq is done: out of the slot table, out of the KV caches, its sampler freed."""
        if not self.slots.leave(seq):
            return
        self.prefix.forget(seq)
        if seq.pending and seq.n_past > 0:
            # cut off halfway through its prompt: the prompt context still holds that part
            self.prompt.clear()
            seq.pending.clear()
        if self.decode is not None:
            self.decode.leave(seq)
        self.sampler.free(seq)

    def _fail(self, rc: int, seqs: list[Sequence], why: str = "") -> list:
        """llama.cpp refused a pass, or a sequence cannot go on (`why`): end those sequences with an error rather than
        guess."""
        self.counters["decode_errors"] += 1
        why = why or f"llama_decode failed ({rc})"
        log.error("%s; failing %d sequences", why, len(seqs))
        deltas = []
        for seq in seqs:
            self.release(seq)
            deltas.append(Delta(seq.request_id, "", 0, "error", why))
        return deltas

    def _dead_end(self, seq: Sequence) -> list:
        """The request's grammar allows no token here: a 400 before its first token, an error after
        (sampling.dead_end)."""
        ended = dead_end(seq)
        if isinstance(ended, str):
            return self._fail(-1, [seq], ended)
        self.release(seq)
        return [ended]

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list:
        """One llama_decode for every decoding sequence, then one chunk of the oldest prompt."""
        deltas = self.prefix.keep_deferred()
        while (seated := self.slots.seat_next()) is not None:
            deltas += self._start(seated)
        if not self.slots.active:
            return deltas
        if self.decode is not None:
            decoded, failed = self._decode_step(self.decode)
            if failed:
                return deltas + decoded
            deltas += decoded
        prompting = self.slots.next_prompt()
        if prompting is not None:
            deltas += self._prompt_chunk(prompting)
        n = sum(d.n_tokens for d in deltas if isinstance(d, Delta))
        self.rate.add(n)
        self.counters["generated_tokens"] += n
        return deltas

    def _decode_step(self, decode: DecodeBatch) -> tuple[list, bool]:
        """Every decoding sequence's row (and a lone one's guesses) in one llama_decode; their tokens sampled. True
        when llama.cpp refused the step: its sequences failed, and the step ends there (its other events, a written
        prompt's Cached and a seated one's, still go out)."""
        decode.compact(self.slots.active.values())
        # in stream order: with the streams one consecutive run, llama.cpp takes the batch in one ubatch
        decoding = self.slots.decoding()
        if not decoding:
            return [], False
        pad = decode.pad_stream(decoding)
        guesses = self.guesser.guesses(decoding) if pad < 0 else [[] for _ in decoding]
        rows = decode.feed(decoding, guesses, pad)
        rc, n_rows, seconds = decode.decode(pad)
        self.guesser.timed(len(rows), n_rows, seconds)
        if rc != 0:
            return self._fail(rc, decoding), True
        deltas = []
        for (seq, i), guess in zip(rows, guesses):
            deltas += self._check(decode, seq, i, guess)
        return deltas, False

    def _check(self, decode: DecodeBatch, seq: Sequence, i: int, guess: list[int]) -> list:
        """Sample seq's tokens from its rows, from batch row i on: the first row's token, then, while the token
        sampled is the guessed one, the next row's (its KV, the guess's, is then the sequence's own). The guessed
        rows after the first refused one are dropped from the KV. One Delta for all the tokens."""
        assert seq.out is not None
        sampled: list[tuple[int, TokenLogprob | None]] = []
        finish = None
        text = ""
        for j in range(len(guess) + 1):
            try:
                token, lp = self.sampler.sample(seq, decode.ctx, i + j)
            except GrammarDeadEnd:
                return self._dead_end(seq)
            sampled.append((token, lp))
            self.guesser.sampled(seq, guess, token)
            piece, finish = seq.out.token(token)
            text += piece
            if finish is not None:
                break
            if j < len(guess) and token == guess[j]:  # kept: the guess's row is this token's KV
                seq.n_past += 1
                seq.fed.append(token)
                continue
            seq.next_token = token
            break
        if guess:
            kept = 0  # the guessed tokens sampled as guessed, from the first on
            while kept < min(len(guess), len(sampled)) and sampled[kept][0] == guess[kept]:
                kept += 1
            self.guesser.checked(seq, guess, kept)
            # the refused guesses' KV, past the sequence's tokens (before a finished one's generated blocks are kept)
            decode.drop_after(seq)
        return self._delta(seq, text, sampled, finish)

    def _prompt_chunk(self, seq: Sequence) -> list:
        """The next chunk of seq's prompt (or its start from cached KV); at its end, its first token, and its KV handed
        on or moved into the decode batch."""
        logits = self.prefix.start(seq)
        if logits is not None:  # the whole prompt came from the cache: nothing to evaluate
            try:
                token, lp = self.sampler.sample_saved(seq, logits)
            except GrammarDeadEnd:
                self.prompt.clear()  # the hits imported into it
                return self._dead_end(seq)
        else:
            # up to the next multiple of the chunk: a prompt resumed after cached blocks then runs the chunks a
            # prompt run from the start runs
            take = min(len(seq.pending), self.prompt.chunk - seq.n_past % self.prompt.chunk)
            start = seq.n_past
            every = seq.prompt_lp is not None  # echo's prompt logprobs: logits for every position
            tokens = [seq.pending.popleft() for _ in range(take)]
            seq.n_past += take
            rc = self.prompt.decode(tokens, start, "all" if every else "last" if not seq.pending else "none")
            if rc != 0:
                self.prompt.clear()
                return self._fail(rc, [seq])
            k = seq.request.prompt_logprobs
            if seq.prompt_lp is not None and k is not None:  # row j predicts the prompt's token after start + j
                seq.prompt_lp += logprobs.prompt_chunk(self.prompt.ctx, take, self.prompt.n_vocab,
                                                       seq.prompt[start + 1:start + take + 1], k)
            if seq.pending:
                return []
            if seq.handling.prefix is not None and seq.handling.prefix.final_store >= 0:  # kept with the prompt
                logits = self.prompt.logits(take - 1).copy()
            try:
                token, lp = self.sampler.sample(seq, self.prompt.ctx, take - 1)
            except GrammarDeadEnd:
                self.prompt.clear()
                return self._dead_end(seq)
        if self.decode is None or seq.handling.handoff:
            cached = self.prefix.keep_blocks(seq, None, logits)
            event = self.handoff.hand_on(seq, token, lp)
            self.release(seq)
            self.counters["finished"] += 1
            return [*cached, event]
        return self._enter_batch(self.decode, seq, token, lp, logits)

    def _enter_batch(self, decode: DecodeBatch, seq: Sequence, token: int, lp: TokenLogprob | None,
                     logits: np.ndarray | None) -> list:
        """seq's prompt is done: its KV from the prompt context into a stream of the decode batch, its first token out,
        and its blocks written into the prefix cache (at the next step, where they can wait)."""
        state = self.prompt.export(room=8 * decode.max_seqs)
        self.prefix.keep_checkpoint(seq, state)  # a later prompt starting with these tokens starts here
        # the blocks are read from these bytes (the prompt's one stream, the others empty); nothing else uses the
        # prompt context's scratch before the next step's keep_deferred
        state = self.prompt.widen(state, decode.max_seqs, self.shape)
        if not decode.enter(seq, state):
            return self.prefix.keep_now(seq, state, logits) + self._fail(-1, [seq], "could not move the prompt's KV "
                                                                         "into the batch context")
        emitted = self._emit(seq, token, lp)
        if not self.prefix.defers(seq):
            return self.prefix.keep_now(seq, state, logits) + emitted  # its blocks reported before its end
        self.prefix.defer(seq, state, logits)
        return emitted

    def _emit(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> list:
        """The Delta of a token; at the sequence's end, after the blocks of what it generated that it keeps."""
        assert seq.out is not None
        text, finish = seq.out.token(token)
        if finish is None:
            seq.next_token = token
        return self._delta(seq, text, [(token, lp)], finish)

    def _delta(self, seq: Sequence, text: str, sampled: list[tuple[int, TokenLogprob | None]],
               finish: str | None) -> list:
        """The Delta of the tokens sampled (their text `text`); at the sequence's end (finish), after the blocks of
        what it generated that it keeps."""
        kept = []
        if finish is not None:
            if self.decode is not None:
                kept = self.prefix.keep_generated(seq, self.decode)
            self.release(seq)
            self.counters["finished"] += 1
        # the end-of-generation token that ends the text is not part of it: no logprob entry
        last = sampled[-1][0]
        ended = finish == "stop" and self.vocab.is_eog(last) and not seq.request.ignore_eos
        lps = tuple(lp for n, (_, lp) in enumerate(sampled)
                    if lp is not None and not (ended and n == len(sampled) - 1))
        prompt_lp, seq.prompt_lp = (tuple(seq.prompt_lp) if seq.prompt_lp is not None else None), None
        return [*kept, Delta(seq.request_id, text, len(sampled), finish, tokens=tuple(t for t, _ in sampled),
                             logprobs=lps, prompt_logprobs=prompt_lp)]
