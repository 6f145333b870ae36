"""The neutral KV record: a versioned, checksummed byte layout of one sequence's KV cache that any engine reads."""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Sequence

import numpy as np
import xxhash

MAGIC = b"SHXKVREC"
FORMAT_VERSION = 1
HEADER_SIZE = 64
ALIGN = 64

# magic, checksum (xxh3_64 of every byte after it), version, header size, dtype, n_tokens,
# fingerprint length, total size, flags
_HEADER = struct.Struct("<8sQHHIIIQI")
_CHECKED_FROM = 16  # the checksum covers the record from here to total_size

_FP_MAGIC = b"SHFP"
_FP_VERSION = 1
# magic, version, n_layer, n_head_kv, head_dim, rope_dim, rope_freq_base, rope_freq_scale,
# tensor_table_hash, len(arch), len(rope_type)
_FP = struct.Struct("<4sHIIIIddQHH")


# flags: the payload after the positions is llama.cpp's own state of one sequence (llama_state_seq_get_data), not K
# and V rows: a model whose KV the rows do not carry (a recurrent state, sliding-window layers, MLA), handed from a
# llama.cpp engine to a llama.cpp engine of the same model
FLAG_LLAMA_STATE = 1


class RecordError(Exception):
    """A KV record cannot be used; the decode side recomputes the prefill instead."""


class RecordCorrupt(RecordError):
    """The bytes are not a well-formed record, or the checksum does not match."""


class FingerprintMismatch(RecordError):
    """The record was produced by a different model than the one that would consume it."""


class DType(IntEnum):
    """Element type of K and V; the numbers are ggml's type ids, so llama.cpp codecs map one to one."""

    F32 = 0
    F16 = 1
    BF16 = 30

    @classmethod
    def parse(cls, value: DType | str | int) -> DType:
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"dtype={value!r}: allowed are f32, f16, bf16") from None
        return cls(value)

    @property
    def numpy(self) -> np.dtype:
        # numpy has no bfloat16: bf16 travels as its raw 16-bit patterns
        return np.dtype({DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}[self])


@dataclass(frozen=True)
class ModelFingerprint:
    """What a consumer must share with the producer for KV rows to mean the same thing."""

    arch: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    rope_type: str  # "norm" (llama, GPT-J style pairs), "neox", "none", ...
    rope_dim: int
    rope_freq_base: float
    rope_freq_scale: float
    tensor_table_hash: int  # xxh3_64 over the weights' (name, shape, type) table

    def to_bytes(self) -> bytes:
        arch, rope = self.arch.encode(), self.rope_type.encode()
        return _FP.pack(_FP_MAGIC, _FP_VERSION, self.n_layer, self.n_head_kv, self.head_dim, self.rope_dim,
                        self.rope_freq_base, self.rope_freq_scale, self.tensor_table_hash,
                        len(arch), len(rope)) + arch + rope

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> ModelFingerprint:
        data = bytes(data)
        if len(data) < _FP.size or data[:4] != _FP_MAGIC:
            raise RecordCorrupt("model fingerprint: bad magic or too short")
        (_, version, n_layer, n_head_kv, head_dim, rope_dim, base, scale, table,
         n_arch, n_rope) = _FP.unpack_from(data)
        if version != _FP_VERSION:
            raise RecordCorrupt(f"model fingerprint version {version}, this code reads {_FP_VERSION}")
        if len(data) != _FP.size + n_arch + n_rope:
            raise RecordCorrupt("model fingerprint: length does not match its strings")
        arch = data[_FP.size:_FP.size + n_arch].decode()
        rope = data[_FP.size + n_arch:].decode()
        return cls(arch, n_layer, n_head_kv, head_dim, rope, rope_dim, base, scale, table)

    def differences(self, other: ModelFingerprint) -> list[str]:
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def _as_fingerprint(fp: ModelFingerprint | bytes | memoryview) -> ModelFingerprint:
    return fp if isinstance(fp, ModelFingerprint) else ModelFingerprint.from_bytes(fp)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclass(frozen=True)
class _Layout:
    fp_len: int
    tokens: int
    positions: int
    kv: int
    total: int


def _layout(fp: ModelFingerprint, fp_len: int, n_tokens: int, dtype: DType) -> _Layout:
    tokens = _align(HEADER_SIZE + fp_len)
    positions = _align(tokens + 4 * n_tokens)
    kv = _align(positions + 4 * n_tokens)
    kv_bytes = fp.n_layer * 2 * n_tokens * fp.n_head_kv * fp.head_dim * dtype.numpy.itemsize
    return _Layout(fp_len, tokens, positions, kv, kv + kv_bytes)


@dataclass(frozen=True)
class KVRecord:
    """Numpy views onto a record's bytes (no copies); writable when the buffer is."""

    fingerprint: ModelFingerprint
    dtype: DType
    tokens: np.ndarray  # int32 [n_tokens]
    positions: np.ndarray  # int32 [n_tokens]
    kv: np.ndarray  # [n_layer, 2 (K, V), n_tokens, n_head_kv, head_dim]
    nbytes: int
    checksum: int
    # FLAG_LLAMA_STATE: llama.cpp's state bytes of the sequence (a one-stream export); kv then holds no rows
    state: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def k(self, layer: int) -> np.ndarray:
        return self.kv[layer, 0]

    def v(self, layer: int) -> np.ndarray:
        return self.kv[layer, 1]


def convert_into(dst: np.ndarray, dst_dtype: DType, src: np.ndarray, src_dtype: DType) -> None:
    """Copy src into dst, converting the element type on the way (bf16 is carried as raw bits)."""
    if src_dtype == dst_dtype:
        np.copyto(dst, src)
        return
    if src_dtype is DType.BF16:
        src = (np.asarray(src).astype(np.uint32) << 16).view(np.float32)
    if dst_dtype is DType.BF16:
        bits = np.asarray(src, np.float32).view(np.uint32)
        np.copyto(dst, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))  # round to nearest even
        return
    np.copyto(dst, src, casting="unsafe")


def _fill(dst: np.ndarray, dtype: DType, src) -> None:
    src = np.asarray(src)
    if dtype is DType.BF16 and src.dtype.kind == "f":
        convert_into(dst, dtype, src, DType.F32)
    else:
        np.copyto(dst, src, casting="same_kind")


def record_size(fingerprint: ModelFingerprint | bytes, n_tokens: int, dtype: DType | str) -> int:
    """Bytes a record of n_tokens takes: reserve this much in the ring."""
    fp = _as_fingerprint(fingerprint)
    return _layout(fp, len(fp.to_bytes()), n_tokens, DType.parse(dtype)).total


def _views(buf: memoryview, fp: ModelFingerprint, lay: _Layout, n_tokens: int, dtype: DType,
           checksum: int) -> KVRecord:
    shape = (fp.n_layer, 2, n_tokens, fp.n_head_kv, fp.head_dim)
    return KVRecord(
        fingerprint=fp, dtype=dtype,
        tokens=np.frombuffer(buf, np.int32, n_tokens, lay.tokens),
        positions=np.frombuffer(buf, np.int32, n_tokens, lay.positions),
        kv=np.frombuffer(buf, dtype.numpy, int(np.prod(shape)), lay.kv).reshape(shape),
        nbytes=lay.total, checksum=checksum)


def layout_into(buf, fingerprint: ModelFingerprint | bytes, n_tokens: int, dtype: DType | str) -> KVRecord:
    """Write the header into buf and return writable views to fill; then call seal(buf)."""
    fp = _as_fingerprint(fingerprint)
    dtype = DType.parse(dtype)
    fp_bytes = fp.to_bytes()
    lay = _layout(fp, len(fp_bytes), n_tokens, dtype)
    mv = memoryview(buf).cast("B")
    if mv.readonly:
        raise ValueError("layout_into needs a writable buffer")
    if mv.nbytes < lay.total:
        raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the {lay.total}-byte record")
    mv[:lay.kv] = bytes(lay.kv)  # header, alignment gaps: zeros, so equal records hash equally
    _HEADER.pack_into(mv, 0, MAGIC, 0, FORMAT_VERSION, HEADER_SIZE, int(dtype), n_tokens,
                      len(fp_bytes), lay.total, 0)
    mv[HEADER_SIZE:HEADER_SIZE + len(fp_bytes)] = fp_bytes
    return _views(mv[:lay.total], fp, lay, n_tokens, dtype, 0)


def seal(buf) -> int:
    """Compute and store the checksum of a filled record; returns it (report it with the offset)."""
    mv = memoryview(buf).cast("B")
    (total,) = struct.unpack_from("<Q", mv, 32)
    checksum = xxhash.xxh3_64_intdigest(mv[_CHECKED_FROM:total])
    struct.pack_into("<Q", mv, 8, checksum)
    return checksum


def encode_into(buf, fingerprint: ModelFingerprint | bytes, tokens, positions,
                k: Sequence[np.ndarray] | np.ndarray, v: Sequence[np.ndarray] | np.ndarray,
                dtype: DType | str = DType.F16) -> int:
    """Encode a whole record into buf (e.g. a ring reservation); returns its size in bytes.

    k and v hold one [n_tokens, n_head_kv, head_dim] array per layer (or one stacked array);
    for bf16, float arrays are rounded and uint16 arrays are taken as raw bf16 bits.
    """
    tokens = np.asarray(tokens)
    rec = layout_into(buf, fingerprint, len(tokens), dtype)
    if len(k) != rec.fingerprint.n_layer or len(v) != rec.fingerprint.n_layer:
        raise ValueError(f"k and v need {rec.fingerprint.n_layer} layers, got {len(k)} and {len(v)}")
    rec.tokens[:] = tokens
    rec.positions[:] = positions
    if isinstance(k, np.ndarray) and isinstance(v, np.ndarray):  # stacked: one copy call each
        _fill(rec.kv[:, 0], rec.dtype, k)
        _fill(rec.kv[:, 1], rec.dtype, v)
    else:
        for layer in range(rec.fingerprint.n_layer):
            _fill(rec.k(layer), rec.dtype, k[layer])
            _fill(rec.v(layer), rec.dtype, v[layer])
    seal(buf)
    return rec.nbytes


def state_record_size(fingerprint: ModelFingerprint | bytes, n_tokens: int, state_bytes: int) -> int:
    """Bytes a FLAG_LLAMA_STATE record of n_tokens carrying state_bytes of llama.cpp state takes."""
    fp = _as_fingerprint(fingerprint)
    return _layout(fp, len(fp.to_bytes()), n_tokens, DType.F16).kv + state_bytes


def encode_state_record_into(buf, fingerprint: ModelFingerprint | bytes, tokens, state: np.ndarray) -> int:
    """A FLAG_LLAMA_STATE record into buf: the prompt's tokens and llama.cpp's state bytes after them, sealed;
    returns its size."""
    fp = _as_fingerprint(fingerprint)
    fp_bytes = fp.to_bytes()
    tokens = np.asarray(tokens)
    lay = _layout(fp, len(fp_bytes), len(tokens), DType.F16)
    total = lay.kv + state.nbytes
    mv = memoryview(buf).cast("B")
    if mv.nbytes < total:
        raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the {total}-byte record")
    mv[:lay.kv] = bytes(lay.kv)
    _HEADER.pack_into(mv, 0, MAGIC, 0, FORMAT_VERSION, HEADER_SIZE, int(DType.F16), len(tokens), len(fp_bytes),
                      total, FLAG_LLAMA_STATE)
    mv[HEADER_SIZE:HEADER_SIZE + len(fp_bytes)] = fp_bytes
    np.frombuffer(mv, np.int32, len(tokens), lay.tokens)[:] = tokens
    np.frombuffer(mv, np.int32, len(tokens), lay.positions)[:] = np.arange(len(tokens), dtype=np.int32)
    np.frombuffer(mv, np.uint8, state.nbytes, lay.kv)[:] = np.ascontiguousarray(state).reshape(-1).view(np.uint8)
    seal(buf)
    return total


def decode(buf, *, expect: ModelFingerprint | bytes | None = None, verify: bool = True,
           llama_state: bool = False) -> KVRecord:
    """Views onto the record in buf; RecordCorrupt on bad bytes or checksum, FingerprintMismatch on model.
    llama_state: the reader takes FLAG_LLAMA_STATE records (a llama.cpp engine); any other reader refuses them."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise RecordCorrupt(f"{mv.nbytes} bytes is shorter than a record header")
    magic, checksum, version, header_size, dtype_id, n_tokens, fp_len, total, flags = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise RecordCorrupt(f"bad magic {magic!r}")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise RecordCorrupt(f"record format version {version}, this code reads {FORMAT_VERSION}")
    if not HEADER_SIZE <= total <= mv.nbytes:
        raise RecordCorrupt(f"record claims {total} bytes, buffer holds {mv.nbytes}")
    if verify:
        actual = xxhash.xxh3_64_intdigest(mv[_CHECKED_FROM:total])
        if actual != checksum:
            raise RecordCorrupt(f"checksum mismatch: header says {checksum:016x}, bytes hash to {actual:016x}")
    try:
        dtype = DType(dtype_id)
    except ValueError:
        raise RecordCorrupt(f"unknown dtype id {dtype_id}") from None
    if HEADER_SIZE + fp_len > total:
        raise RecordCorrupt("fingerprint runs past the end of the record")
    fp = ModelFingerprint.from_bytes(mv[HEADER_SIZE:HEADER_SIZE + fp_len])
    lay = _layout(fp, fp_len, n_tokens, dtype)
    if flags & FLAG_LLAMA_STATE:
        if not llama_state:
            raise RecordError("a record of llama.cpp's own sequence state: only a llama.cpp engine of the same model "
                              "reads it")
        if total < lay.kv:
            raise RecordCorrupt(f"record size {total} is shorter than its tokens ({lay.kv})")
        lay = _Layout(lay.fp_len, lay.tokens, lay.positions, lay.kv, total)
    elif lay.total != total:
        raise RecordCorrupt(f"record size {total} does not match its shape ({lay.total} expected)")
    if expect is not None:
        want = _as_fingerprint(expect)
        if want != fp:
            raise FingerprintMismatch("KV record is from another model: " + "; ".join(fp.differences(want)))
    if flags & FLAG_LLAMA_STATE:
        rows = _views(mv[:lay.kv], fp, _Layout(lay.fp_len, lay.tokens, lay.positions, lay.kv, lay.kv), 0, dtype,
                      checksum)
        return replace(rows, tokens=np.frombuffer(mv, np.int32, n_tokens, lay.tokens),
                       positions=np.frombuffer(mv, np.int32, n_tokens, lay.positions), nbytes=total,
                       state=np.frombuffer(mv, np.uint8, total - lay.kv, lay.kv))
    return _views(mv[:total], fp, lay, n_tokens, dtype, checksum)
