"""This engine's end of the KV ring: a finished prompt's KV out as a record, or a record in."""

from __future__ import annotations

import logging
import time

from syshax_llamacpp.codec import (
    StateBuffer,
    StateFormatError,
    StateImportError,
    encode_state_into,
    export_seq,
    import_record,
    parse_seq_state,
)
from syshaxd.sdk.types import Fallback, KVHandle
from syshaxd.sdk.gguf.header import fingerprint_from_gguf
from syshaxd.sdk.kv.record import FingerprintMismatch, RecordCorrupt, RecordError, decode, record_size
from syshaxd.sdk.kv.ring import KVRing, RingError

log = logging.getLogger(__name__)


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
    def __init__(self, ring_instance: str, model_path: str, n_stream: int, timeout: float) -> None:
        self.ring = KVRing.attach(ring_instance)
        self.fingerprint = fingerprint_from_gguf(model_path)
        self.n_stream = n_stream  # KV streams of the context records are imported into
        self.timeout = timeout
        self.scratch = StateBuffer()

    def export(self, ctx, seq_id: int, tokens: list[int], first_token: int) -> KVHandle:
        """Write seq_id's KV as one record; raises RingFull when no room frees in time."""
        state = parse_seq_state(export_seq(ctx, seq_id, self.scratch), self.fingerprint)
        size = record_size(self.fingerprint, len(tokens), state.dtype)
        res = self.ring.reserve(size, self.timeout)
        try:
            encode_state_into(res.view, self.fingerprint, state, tokens)
            checksum = decode(res.view, verify=False).checksum
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
            record = decode(self.ring.read(handle.offset, handle.seq), expect=self.fingerprint)
            if record.checksum != handle.checksum:
                raise RecordCorrupt(f"record checksum {record.checksum:#x} is not the {handle.checksum:#x} reported")
            if record.n_tokens != len(prompt) or record.tokens.tolist() != prompt:
                raise ImportRefused(Fallback.TOKEN_MISMATCH, "the record holds other tokens than this request's prompt")
            import_record(ctx, seq_id, record, v_trans=False, scratch=self.scratch, n_stream=self.n_stream)
        except (RingError, RecordError, StateFormatError, StateImportError) as exc:
            raise ImportRefused(_refusal(exc), str(exc)) from exc
        return handle.length

    def close(self) -> None:
        self.ring.close()
