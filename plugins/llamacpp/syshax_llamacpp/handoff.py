"""This engine's end of the KV ring: a finished prompt's KV out as a record, or a record in.

KVPort reads and writes the ring; Handoff is what the engine does with it (a decoder starts a sequence from a
record, a prefill worker writes its finished prompt as one before the engine lets the sequence go). Apart from the
rest of the engine because a record can be refused for many reasons, each counted by the daemon, and every one of
them ends in the same place: the prompt recomputed here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

import llama_cpp

from syshax_llamacpp.codec import (
    StateBuffer,
    StateFormatError,
    StateImportError,
    StateShape,
    encode_state_into,
    export_seq,
    import_record,
    parse_seq_state,
    widen_streams,
)
from syshax_llamacpp.decode_batch import DecodeBatch
from syshax_llamacpp.prompt_context import PromptContext
from syshax_llamacpp.sequence import Sequence, SlotState
from syshaxd.sdk.types import Fallback, Imported, KVHandle, Prefilled, TokenLogprob
from syshaxd.sdk.gguf.header import fingerprint_from_gguf
from syshaxd.sdk.kv.record import (FingerprintMismatch, RecordCorrupt, RecordError, decode,
                                   encode_state_record_into, record_size, state_record_size)
from syshaxd.sdk.kv.ring import KVRing, RingError


# the engine's lines, under the engine's logger name (the worker's log prints it)
engine_log = logging.getLogger("syshax_llamacpp.engine")


class ImportRefused(Exception):
    """A KV record could not be used; `reason` says why, as the ledger counts it."""

    def __init__(self, reason: Fallback, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _refusal(exc: Exception) -> Fallback:
    if isinstance(exc, RingError):
        return Fallback.STALE  # released, reset or reused since it was reported
    if isinstance(exc, FingerprintMismatch):
        return Fallback.FINGERPRINT
    if isinstance(exc, RecordError):
        return Fallback.CHECKSUM
    return Fallback.STATE_FORMAT


class KVPort:
    """whole_state: the model's KV is not rows per head of one cache (a recurrent state, sliding-window layers, MLA,
    M-RoPE's cells), so a record carries llama.cpp's whole state of the sequence (FLAG_LLAMA_STATE), which only a
    llama.cpp engine of the same model reads; `shape` says how to re-address it for the importing context."""

    def __init__(self, ring_instance: str, model_path: str, n_stream: int, timeout: float,
                 whole_state: bool = False, shape: StateShape = StateShape()) -> None:
        self.ring = KVRing.attach(ring_instance)
        self.fingerprint = fingerprint_from_gguf(model_path)
        self.n_stream = n_stream  # KV streams of the context records are imported into
        self.timeout = timeout
        self.whole_state, self.shape = whole_state, shape
        self.scratch = StateBuffer()

    def export(self, ctx, seq_id: int, tokens: list[int], first_token: int) -> KVHandle:
        """Write seq_id's KV as one record; raises RingFull when no room frees in time."""
        raw = export_seq(ctx, seq_id, self.scratch)
        state = None if self.whole_state else parse_seq_state(raw, self.fingerprint)
        size = (state_record_size(self.fingerprint, len(tokens), raw.nbytes) if state is None else
                record_size(self.fingerprint, len(tokens), state.dtype))
        res = self.ring.reserve(size, self.timeout)
        try:
            if state is None:
                encode_state_record_into(res.view, self.fingerprint, tokens, raw)
            else:
                encode_state_into(res.view, self.fingerprint, state, tokens)
            checksum = decode(res.view, verify=False, llama_state=True).checksum
        except BaseException:
            res.abort()
            raise
        offset = res.commit()
        return KVHandle(offset, size, res.seq, checksum, len(tokens), first_token, time.time())

    def import_into(self, ctx, seq_id: int, handle: KVHandle, prompt: list[int]) -> int:
        """Load the record into seq_id of ctx; raises ImportRefused if it cannot be used.

        The ring space is not ours to free: the daemon's ledger frees it when the Imported event says
        this worker is done with it, used or not.
        """
        try:
            record = decode(self.ring.read(handle.offset, handle.seq), expect=self.fingerprint, llama_state=True)
            if record.checksum != handle.checksum:
                raise RecordCorrupt(f"record checksum {record.checksum:#x} is not the {handle.checksum:#x} reported")
            if record.n_tokens != len(prompt) or record.tokens.tolist() != prompt:
                raise ImportRefused(Fallback.TOKEN_MISMATCH, "the record holds other tokens than this request's prompt")
            if record.state is not None:
                self._import_state(ctx, seq_id, record.state)
            else:
                import_record(ctx, seq_id, record, v_trans=False, scratch=self.scratch, n_stream=self.n_stream)
        except (RingError, RecordError, StateFormatError, StateImportError) as exc:
            raise ImportRefused(_refusal(exc), str(exc)) from exc
        return handle.length

    def _import_state(self, ctx, seq_id: int, state) -> None:
        """llama.cpp's own state of a sequence (a one-stream export by a prefill engine of this model) into seq_id."""
        import llama_cpp

        buf = self.scratch.ensure(state.nbytes + 8 * self.n_stream)  # widen_streams: 2 KV caches at most
        buf[:state.nbytes] = state
        size = widen_streams(buf, state.nbytes, self.n_stream, self.shape)
        got = llama_cpp.llama_state_seq_set_data(ctx, StateBuffer.pointer(buf), size, seq_id)
        if got != size:
            raise StateImportError(f"llama_state_seq_set_data took {got} of {size} bytes for sequence {seq_id}")

    def close(self) -> None:
        self.ring.close()


class Handoff:
    """The engine's two ends of a handoff, through its KV port (the one owner of the ring's side here): a decoder
    starts a sequence from a record (or, when it cannot, has the prompt recomputed and says why), a prefill worker
    writes its finished prompt as one."""

    def __init__(self, port: KVPort | None, prompt: PromptContext, decode: DecodeBatch | None) -> None:
        self.port = port
        self.prompt = prompt
        self.decode = decode

    def take_kv(self, seq: Sequence) -> tuple[Imported, bool]:
        """Start seq from the KV another engine computed: in a stream of the decode batch, its prompt's tokens in
        the KV (True). Where it cannot be used, its prompt is to be recomputed here (False, its pending tokens set).
        The daemon hears which from the Imported event."""
        rid, handle = seq.request_id, seq.handling.kv
        reason = seq.handling.kv_missing
        started = time.monotonic()
        if handle is not None:
            # a record is only ever sent to a decoder (the daemon's plan): this engine has a decode batch
            assert self.decode is not None, "a KV record was sent to a prefill-only worker"
            seq.seq_id = self.decode.take_stream()  # held by seq from now: its release gives it back, whatever raises
            try:
                if self.port is None:
                    raise ImportRefused(Fallback.NO_RING, "this worker has no KV ring")
                nbytes = self.port.import_into(self.decode.ctx, seq.seq_id, handle, seq.prompt)
            except ImportRefused as exc:
                reason = exc.reason
                self.decode.leave(seq)  # it joins when its recomputed prompt is done
                engine_log.warning("%s: KV record unusable (%s: %s); recomputing the prompt here", rid, reason, exc)
            else:
                seq.enter(SlotState.DECODING)
                seq.n_past = len(seq.prompt)
                if handle.prompt_logprobs is not None:  # computed by the prefill engine, as this one would
                    seq.prompt_lp = list(handle.prompt_logprobs)
                return Imported(rid, True, seconds=time.monotonic() - started, nbytes=nbytes), True
        else:
            engine_log.warning("%s: no KV record (%s); recomputing the prompt here", rid, reason)
        seq.pending = deque(seq.prompt)
        return Imported(rid, False, reason=reason), False

    def hand_on(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> Prefilled:
        """Prefill role: write the prompt's KV into the ring (its first token `token` with it) and clear the prompt
        context; the engine then lets the sequence go."""
        rid = seq.request_id
        try:
            if self.port is None:
                raise RingError("this worker has no KV ring")
            handle = self.port.export(self.prompt.ctx, 0, seq.prompt, token)
        except RingError as exc:
            engine_log.warning("%s: KV record not written (%s); the decoder will recompute the prompt", rid, exc)
            event = Prefilled(rid, None, Fallback.of_export(exc))
        else:
            prompt_lp = tuple(seq.prompt_lp) if seq.prompt_lp is not None else None
            event = Prefilled(rid, replace(handle, first_logprob=lp, prompt_logprobs=prompt_lp))
        self.prompt.clear()
        return event

    def not_read(self, seq: Sequence) -> list:
        """seq was cancelled before it started: a KV record it was to read was not (the daemon's ledger frees it once
        it hears so)."""
        return [Imported(seq.request_id, False, reason=Fallback.CANCELLED)] if seq.handling.kv is not None else []

    def close(self) -> None:
        if self.port is not None:
            self.port.close()
