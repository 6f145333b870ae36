"""Stepping: one llama_decode for every decoding sequence, then one chunk of the oldest prompt.

The busy loop's own job, kept apart from what it calls on: who takes a batch slot (`_seat`), the decode batch
in stream order (with a padding row where a stock llama.cpp would sum a lone row otherwise), a prompt chunk in
the prompt context and the move of its finished KV into the batch context, and keeping the streams one run
(streams.py says why). Sampling, the prefix cache and the handoff are asked, not done here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from syshax_llamacpp import drafting, logprobs
from syshax_llamacpp.codec import StateBuffer, export_seq, widen_streams
from syshax_llamacpp.proofs import SPLIT_KV_FROM
from syshax_llamacpp.sampling import GrammarDeadEnd, sample_logits
from syshaxd.sdk.types import Delta, TokenLogprob

if TYPE_CHECKING:
    from syshax_llamacpp.sequence import Sequence

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")


class Stepping:
    """The LlamaCppEngine's step: its slots, its decode batch, its prompt chunks and its KV streams."""

    def _seat(self) -> list:
        """Give free batch slots to the waiting sequences, oldest first, and start them."""
        # FIFO: the head of the queue is never overtaken, so a long request is not starved
        deltas = []
        while self.waiting and self.free_slots > 0:
            seq = self.waiting.popleft()
            del self.queued[seq.request.request_id]
            seq.slotted = True
            self.free_slots -= 1
            deltas += self._start(seq)
        return deltas

    def step(self) -> list:
        """One llama_decode for every decoding sequence, then one chunk of the oldest prompt."""
        deltas = self._keep_unkept()
        deltas += self._seat()
        if not self.active:
            return deltas
        self._compact()
        rows = []
        self.batch.n_tokens = 0
        # in stream order: with the streams one consecutive run, llama.cpp takes the batch in one ubatch
        decoding = sorted((s for s in self.active.values() if s.next_token is not None), key=lambda s: s.seq_id)
        pad = self._pad_stream(decoding)
        guesses = self._guesses(decoding) if pad < 0 else [[] for _ in decoding]
        for seq, guess in zip(decoding, guesses):
            if 0 <= pad < seq.seq_id:
                self._add(self.batch, seq.next_token, 0, pad, False)
            rows.append((seq, self._add(self.batch, seq.next_token, seq.n_past, seq.seq_id, True), guess))
            for j, token in enumerate(guess):  # each guessed token's row: its logits check the next guess
                self._add(self.batch, token, seq.n_past + 1 + j, seq.seq_id, True)
            if pad > seq.seq_id:
                self._add(self.batch, seq.next_token, 0, pad, False)
            seq.n_past += 1
            seq.fed.append(seq.next_token)
            seq.next_token = None
        if rows:
            started = time.perf_counter()
            rc = llama_cpp.llama_decode(self.ctx, self.batch)
            if self.step_cost is not None and len(rows) == 1:  # a lone sequence's step: what a guess costs
                self.step_cost.add(self.batch.n_tokens, time.perf_counter() - started)
            if pad >= 0:
                llama_cpp.llama_memory_seq_rm(self.memory, pad, -1, -1)
                self.counters["padded_steps"] += 1
            self.counters["steps"] += 1
            if rc != 0:  # the step's other events (a written prompt's Cached, a seated one's) still go out
                return deltas + self._fail(rc, [seq for seq, _, _ in rows])
            for seq, i, guess in rows:
                deltas += self._check(seq, i, guess)
        seq = next((s for s in self.active.values() if s.pending), None)
        if seq is not None:
            deltas += self._prefill_chunk(seq)
        self._count(sum(d.n_tokens for d in deltas if isinstance(d, Delta)))
        return deltas

    def _pad_stream(self, decoding: list[Sequence]) -> int:
        """A free stream next to a lone decoding sequence's, for a one-token row beside it; -1 when none is needed.

        Only with a stock llama.cpp (pad_lone: the warm-up's proof, _proves_lone; mk/llama-wheel.sh builds one that
        never splits). With one query row in the ubatch and 512 KV cells or more (a sequence past 256 tokens), its
        CPU flash attention splits the KV among its threads and sums the parts (ops.cpp, use_split_kv_path); with
        two streams in the ubatch it walks every row's KV in order. The two sum differently, so a sequence
        decoded alone would get other bits than in a batch (bench/bench_concurrent_exactness.py): a row in a
        second stream keeps a lone sequence on the batch's path, and its text the same alone or not. The price:
        a lone step past 256 tokens takes 1 to 2 ms more (bench/bench_concurrent_exactness.py --step-cost)."""
        # the KV length llama.cpp attends over is the stream's cells padded to 256, so the split starts past 256
        # tokens; below that a padding row would only cost time (about 2 ms a step here: two rows take another
        # matmul path than one)
        if not self.pad_lone or len(decoding) != 1 or decoding[0].n_past + 1 <= SPLIT_KV_FROM:
            return -1
        stream = decoding[0].seq_id
        for pad in (stream + 1, stream - 1):
            if 0 <= pad < self.max_seqs and pad not in self.streams.busy:
                return pad
        return -1

    def _prefill_chunk(self, seq: Sequence) -> list:
        """Feed the next chunk of seq's prompt to the prefill context; at its end, hand it over."""
        if seq.checkpoint is not None:
            self._import_checkpoint(seq)
        logits = self._import_hits(seq) if seq.cached and seq.n_past == 0 else None
        if logits is not None:  # the whole prompt came from the cache: nothing to evaluate
            try:
                token = sample_logits(seq.sampler, logits, grammar=bool(seq.request.grammar))
            except GrammarDeadEnd:
                llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)  # the hits imported into it
                return self._dead_end(seq)
            k = seq.request.logprobs
            lp = logprobs.of_logits(logits, token, k) if k is not None else None
        else:
            b = self.prefill_batch
            b.n_tokens = 0
            # up to the next multiple of the chunk: a prompt resumed after cached blocks then runs the chunks a
            # prompt run from the start runs
            take = min(len(seq.pending), self.chunk - seq.n_past % self.chunk)
            start = seq.n_past
            every = seq.prompt_lp is not None  # echo's prompt logprobs: logits for every position
            for _ in range(take):
                last = len(seq.pending) == 1
                self._add(b, seq.pending.popleft(), seq.n_past, 0, last or every)
                seq.n_past += 1
            rc = llama_cpp.llama_decode(self.prefill_ctx, b)
            if rc != 0:
                llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
                return self._fail(rc, [seq])
            if every:  # row j predicts the prompt's token after position start + j
                seq.prompt_lp += logprobs.prompt_chunk(self.prefill_ctx, take, self.n_vocab,
                                                       seq.prompt[start + 1:start + take + 1],
                                                       seq.request.prompt_logprobs)
            if seq.pending:
                return []
            if seq.handling.prefix is not None and seq.handling.prefix.final_store >= 0:  # kept with the prompt
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.prefill_ctx, b.n_tokens - 1),
                                               (self.n_vocab,)).copy()
            try:
                token, lp = self._sample(seq, self.prefill_ctx, b.n_tokens - 1)
            except GrammarDeadEnd:
                llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
                return self._dead_end(seq)
        if not self.decodes or seq.handling.handoff:
            cached = self._keep_blocks(seq, None, logits)
            return [*cached, self._hand_on(seq, token, lp)]
        size = llama_cpp.llama_state_seq_get_size(self.prefill_ctx, 0)
        buf = self._state.ensure(size + 8 * self.max_seqs)  # widen_streams: 2 KV caches at most
        export_seq(self.prefill_ctx, 0, self._state)
        if self.checkpoints is not None:
            self.checkpoints.keep(seq.prompt, buf[:size])  # a later prompt starting with these tokens starts here
        size = widen_streams(buf, size, self.max_seqs, self.state)
        seq.seq_id = self.streams.take()  # it joins the decode batch now, next to the others
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(buf), size, seq.seq_id)
        # the blocks are read from these bytes (the prompt's one stream, the others empty); nothing else uses the
        # state buffer before the next step's _keep_unkept
        state = buf[:size]
        if got != size:
            return self._keep_now(seq, state, logits) + self._fail(-1, [seq], "could not move the prompt's KV into "
                                                                   "the batch context")
        emitted = self._emit(seq, token, lp)
        if seq.next_token is None or seq.handling.prefix is None or self.store is None:
            return self._keep_now(seq, state, logits) + emitted  # its blocks reported before its end
        # its blocks are written at the next step, after its first token left: on a 2-core machine, 5 to 10 ms
        # of writes into fresh pages of the store (bench/bench_ttft_prefix.py). The prompt context keeps its KV
        # until then.
        self._unkept = (seq, state, logits)
        return emitted

    def _keep_now(self, seq: Sequence, state, logits) -> list:
        """Write seq's prompt's blocks from its state bytes into the prefix cache (Cached), and clear the prompt
        context."""
        cached = self._keep_blocks(seq, state, logits)
        llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        return cached

    def _keep_unkept(self) -> list:
        """The blocks of the prompt whose first token left last step (Cached), before anything else runs: the
        prompt context and the state buffer are then free, and the daemon hears of them before the request can
        end."""
        if self._unkept is None:
            return []
        (seq, state, logits), self._unkept = self._unkept, None
        return self._keep_now(seq, state, logits)

    def _guesses(self, decoding: list[Sequence]) -> list[list[int]]:
        """The decoding sequences' guessed next tokens (drafting.py): a lone sequence's, as many as are expected to
        pay this step, from its own context (prompt lookup) or from the draft model, whichever is expected to give
        more tokens a second; none where speculation is off (speculative_tokens = 0, or a build whose rows may not
        give a lone row's bits) or the request has a grammar. Beside other sequences none: llama.cpp takes a step's
        rows in ubatches of equally many rows of every sequence, so a guess splits the step (the tests' SYSHAX_GUESS=
        always checks every guess of every sequence all the same, the draft's where its lookup has none;
        bench_speculation.py --always says the cost)."""
        none: list[list[int]] = [[] for _ in decoding]
        if self.step_cost is None or not decoding or (len(decoding) > 1 and not self.spec.guess_always):
            return none
        guesses = []
        for seq in decoding:
            seq.drafted = False
            if seq.request.grammar:
                guesses.append([])
                continue
            if seq.lookup is None:
                seq.lookup = drafting.PromptLookup(seq.prompt + seq.fed)
            seq.lookup.extend(seq.fed[len(seq.lookup.tokens) - len(seq.prompt):] + [seq.next_token])
            room = self._guess_room(seq)
            looked = seq.lookup.guess(room)
            draft = self.draft if len(decoding) == 1 else None  # its context holds one sequence
            if self.spec.guess_always:
                n, drafts = len(looked), (room if draft is not None and not looked else 0)
            else:
                chances = self.match_rates.chances(seq.lookup.match, len(looked), seq.acceptance.rate)
                n, rate = drafting.best_guess(chances, len(looked), self.step_cost)
                drafts, drafted_rate = (drafting.best_guess(seq.drafts.rate, room, self.step_cost, draft.seconds)
                                        if draft is not None and draft.seconds is not None else (0, 0.0))
                if drafts and drafted_rate > rate:
                    n = 0
                else:
                    drafts = 0
                    if draft is not None:  # its rate drifts back to its prior, so that a draft refused early is tried
                        seq.drafts.drift()  # again later
            if n:
                seq.acceptance.watching = []  # counted as checked instead
            else:
                seq.acceptance.watch(looked)  # a lookup not checked (the draft's taken instead, or none paid)
            if drafts:
                seq.drafted = True
                guesses.append(draft.guess(seq.prompt + seq.fed + [seq.next_token], drafts, self.n_vocab))
            else:
                guesses.append(looked[:n])
        return guesses

    def _guess_room(self, seq: Sequence) -> int:
        """The most tokens seq may guess: the request's tokens left after the one its row gives, and its KV cells."""
        return min(self.speculative_tokens, seq.max_tokens - seq.out.n_generated - 1, self.n_ctx - seq.n_past - 2)

    def _check(self, seq: Sequence, i: int, guess: list[int]) -> list:
        """Sample seq's tokens from its rows, from batch row i on: the first row's token, then, while the token
        sampled is the guessed one, the next row's (its KV, the guess's, is then the sequence's own). The guessed
        rows after the first refused one are dropped from the KV. One Delta for all the tokens."""
        sampled: list[tuple[int, TokenLogprob | None]] = []
        finish = None
        text = ""
        for j in range(len(guess) + 1):
            try:
                token, lp = self._sample(seq, self.ctx, i + j)
            except GrammarDeadEnd:
                return self._dead_end(seq)
            sampled.append((token, lp))
            if not guess or seq.drafted:  # a lookup watched as the tokens come
                seq.acceptance.token(token)
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
            (seq.drafts if seq.drafted else seq.acceptance).add(len(guess), kept)
            if seq.drafted:
                self.counters["drafted_tokens"] += len(guess)
                self.counters["kept_drafts"] += kept
            else:
                self.match_rates.add(seq.lookup.match, len(guess), kept)
            self.counters["guessed_tokens"] += len(guess)
            self.counters["kept_guesses"] += kept
            # the refused guesses' KV, past the sequence's tokens (before a finished one's generated blocks are kept)
            llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, seq.n_past, -1)
        return self._delta(seq, text, sampled, finish)

    def _emit(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> list:
        """The Delta of a token; at the sequence's end, after the blocks of what it generated that it keeps."""
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
            kept = self._keep_generated(seq)
            self._release(seq)
            self.counters["finished"] += 1
        # the end-of-generation token that ends the text is not part of it: no logprob entry
        last = sampled[-1][0]
        ended = finish == "stop" and self.vocab.is_eog(last) and not seq.request.ignore_eos
        lps = tuple(lp for n, (_, lp) in enumerate(sampled)
                    if lp is not None and not (ended and n == len(sampled) - 1))
        prompt_lp, seq.prompt_lp = (tuple(seq.prompt_lp) if seq.prompt_lp is not None else None), None
        return [*kept, Delta(seq.request.request_id, text, len(sampled), finish, tokens=tuple(t for t, _ in sampled),
                             logprobs=lps, prompt_logprobs=prompt_lp)]

    def _compact(self) -> None:
        """Fill each hole in the run of decoding streams with the end of the run that holds fewer tokens."""
        while holes := self.streams.holes():
            by_stream = {s.seq_id: s for s in self.active.values() if s.seq_id >= 0}
            lo, hi = self.streams.ends()
            if not self._move(min(by_stream[lo], by_stream[hi], key=lambda s: s.n_past), holes[0]):
                break

    def _move(self, seq: Sequence, target: int) -> bool:
        """Move seq's KV into stream `target` of the batch context: the same bytes, so the same next tokens."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq.seq_id)
        buf = export_seq(self.ctx, seq.seq_id, self._state)
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(buf), size, target)
        if got != size:  # never seen; the sequence stays where it is, and the next step takes two ubatches
            llama_cpp.llama_memory_seq_rm(self.memory, target, -1, -1)
            log.error("could not move a sequence's KV from stream %d to %d (%d of %d bytes)", seq.seq_id, target,
                      got, size)
            return False
        llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
        self.streams.moved(seq.seq_id, target)
        seq.seq_id = target
        self.counters["stream_moves"] += 1
        return True
