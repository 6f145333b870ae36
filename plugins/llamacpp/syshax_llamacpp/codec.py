"""Codec between llama.cpp sequence-state bytes (llama-cpp-python 0.3.36) and the neutral KV record.

Layout of `llama_state_seq_get_data` for one sequence, all little-endian (llama-context.cpp
state_seq_get_data, llama-kv-cache.cpp state_write / state_write_meta / state_write_data):

    u32 magic 0xAF143CD8, i32 source seq_id
    u32 n_stream                          1 for a unified cache or a 1-sequence context, else n_seq_max
    per stream: u32 cell_count            0 for every stream but the sequence's own, then nothing more
      per cell: i32 pos, u32 n_seq_id (1), [12-byte cell ext: M-RoPE/PLE models only], i32 seq_id
      u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row_bytes, K[cell_count][n_head_kv * head_dim]
      v_trans=0, per layer: i32 v_type, u64 v_row_bytes, V[cell_count][n_head_kv * head_dim]
      v_trans=1, per layer: i32 v_type, u32 v_elem_bytes, u32 n_embd_v_gqa, V[n_embd_v_gqa][cell_count]

After the KV caches' parts, a model with a recurrent state (hybrid: Qwen 3.5, LFM2, the mamba hybrids; recurrent:
mamba, RWKV) writes that state, one cell per sequence and no stream count (llama-memory-recurrent.cpp state_write):

    u32 cell_count (1), per cell: i32 pos, u32 n_seq_id (0)
    u32 s_trans (0), u32 n_layer, then per recurrent layer its conv rows, then its SSM rows

A K row of a cell is already `[kv_head, head_dim]`, so K and untransposed V map to the record's
`[token, kv_head, head_dim]` rows one to one. v_trans is fixed when the context is created:
`v_trans = flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED` (auto counts as flash attention then).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from syshaxd.sdk.kv.record import DType, KVRecord, ModelFingerprint, convert_into, layout_into, seal
from syshaxd.sdk.types import ModelNotServable

STATE_MAGIC = 0xAF143CD8
_FLASH_ATTN_DISABLED = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED


class StateFormatError(ModelNotServable, ValueError):
    """The state bytes are not the single-sequence layout this codec knows: the model's layout (MLA's compressed
    KV, a KV cache type it cannot carry), not the kernels' doing, so a warm-up that meets it fails as it is."""


class StateImportError(RuntimeError):
    """llama.cpp refused the state (no free cells, layout or type mismatch); see its log."""


def v_trans_for(flash_attn_type: int) -> bool:
    """Whether a context created with this flash_attn_type keeps V transposed."""
    return flash_attn_type == _FLASH_ATTN_DISABLED


@dataclass(frozen=True)
class StateShape:
    """How llama.cpp writes one sequence's state for a model: what widen_streams and state_sections must know of it
    beyond the bytes themselves (shape_of reads it off a loaded model)."""

    kv_caches: int | None = None  # the KV caches' parts before a recurrent state; None: every part is a KV cache's
    cell_ext: bool = False  # each KV cell carries a 12-byte extension (M-RoPE's 2D position and token: Qwen 3.5)
    recurrent: bool = False  # a recurrent state follows the KV caches' parts

    @property
    def cell_meta(self) -> int:
        """Bytes of one KV cell's metadata in a one-sequence state: pos, n_seq_id (1), [ext], seq_id."""
        return 24 if self.cell_ext else 12

    @property
    def plain(self) -> bool:
        """The layout parse_seq_state reads (KV records: the handoff, the prefix cache)."""
        return not (self.cell_ext or self.recurrent)


# llama.cpp's rope types whose KV cells carry 2D positions (llama_kv_cache::has_cell_ext: n_pos_per_embd() > 1)
_CELL_EXT_ROPE_TYPES = (8, 24, 40)  # LLAMA_ROPE_TYPE_MROPE, _VISION, _IMROPE


def shape_of(model) -> StateShape:
    """The state shape of a loaded llama_model: its KV caches (two for sliding-window layers, none for a recurrent
    model), whether its cells carry M-RoPE's extension, and whether a recurrent state follows."""
    import llama_cpp

    recurrent = bool(llama_cpp.llama_model_is_recurrent(model))
    hybrid = bool(llama_cpp.llama_model_is_hybrid(model))
    caches = 0 if recurrent else (2 if llama_cpp.llama_model_n_swa(model) > 0 else 1)
    return StateShape(caches if recurrent or hybrid else None,
                      llama_cpp.llama_model_rope_type(model) in _CELL_EXT_ROPE_TYPES, recurrent or hybrid)


@dataclass(frozen=True)
class SeqState:
    """Numpy views into parsed state bytes (no copies)."""

    src_seq_id: int
    n_stream: int
    positions: np.ndarray  # int32 [n_tokens]
    dtype: DType
    v_trans: bool
    k: list  # per layer [n_tokens, n_head_kv, head_dim]
    v: list  # per layer, same shape; a transposed (strided) view when v_trans
    nbytes: int

    @property
    def n_tokens(self) -> int:
        return len(self.positions)


class _Reader:
    def __init__(self, buf):
        self.mv = memoryview(buf).cast("B")
        self.pos = 0

    def take(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.mv, self.pos)
        except struct.error:
            raise StateFormatError(f"state ends early at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return values

    def array(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        end = self.pos + dtype.itemsize * count
        if end > self.mv.nbytes:
            raise StateFormatError(f"state ends early: {end} bytes needed, {self.mv.nbytes} present")
        a = np.frombuffer(self.mv, dtype, count, self.pos)
        self.pos = end
        return a


def _ggml_dtype(type_id: int, what: str) -> DType:
    try:
        return DType(type_id)
    except ValueError:
        raise StateFormatError(f"{what} cache type {type_id} (ggml) is not f32/f16/bf16: "
                               "quantized KV caches cannot be carried") from None


def parse_seq_state(buf, fingerprint: ModelFingerprint) -> SeqState:
    """Split one sequence's state bytes into positions and per-layer K, V views."""
    fp = fingerprint
    r = _Reader(buf)
    magic, src_seq = r.take("<Ii")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"bad sequence-state magic 0x{magic:08x}")
    (n_stream,) = r.take("<I")
    found = None
    for _ in range(n_stream):
        (cells,) = r.take("<I")
        if cells == 0:
            continue
        if found is not None:
            raise StateFormatError("cells in more than one stream: not a single-sequence state")
        found = _parse_stream(r, fp, cells)
    if found is None:  # an empty sequence
        empty = np.zeros((0, fp.n_head_kv, fp.head_dim), np.float16)
        found = (np.zeros(0, np.int32), DType.F16, False, [empty] * fp.n_layer, [empty] * fp.n_layer)
    positions, dtype, v_trans, k, v = found
    return SeqState(src_seq, n_stream, positions, dtype, v_trans, k, v, r.pos)


def _parse_stream(r: _Reader, fp: ModelFingerprint, n: int):
    meta = r.array(np.int32, 3 * n).reshape(n, 3)
    v_trans, n_layer = r.take("<II")
    if not (meta[:, 1] == 1).all() or v_trans > 1 or n_layer != fp.n_layer:
        raise StateFormatError(
            f"unexpected cell table (v_trans={v_trans}, n_layer={n_layer}, fingerprint says "
            f"{fp.n_layer}): a whole-context state, another model, or cell extensions (M-RoPE)")
    width = fp.n_head_kv * fp.head_dim
    shape = (n, fp.n_head_kv, fp.head_dim)
    dtype = None
    k = []
    for layer in range(n_layer):
        type_id, row = r.take("<iQ")
        dtype = _check_type(dtype, _ggml_dtype(type_id, "K"), layer)
        if row != width * dtype.numpy.itemsize:
            raise StateFormatError(f"layer {layer}: K row of {row} bytes, fingerprint gives {width} elements")
        k.append(r.array(dtype.numpy, n * width).reshape(shape))
    v = []
    for layer in range(n_layer):
        if v_trans:
            type_id, elem, n_embd = r.take("<iII")
            dtype = _check_type(dtype, _ggml_dtype(type_id, "V"), layer)
            if n_embd != width or elem != dtype.numpy.itemsize:
                raise StateFormatError(f"layer {layer}: transposed V of {n_embd} x {elem}-byte elements")
            v.append(r.array(dtype.numpy, width * n).reshape(width, n).T.reshape(shape))
        else:
            type_id, row = r.take("<iQ")
            dtype = _check_type(dtype, _ggml_dtype(type_id, "V"), layer)
            if row != width * dtype.numpy.itemsize:
                raise StateFormatError(f"layer {layer}: V row of {row} bytes")
            v.append(r.array(dtype.numpy, n * width).reshape(shape))
    return meta[:, 0], dtype, bool(v_trans), k, v


def _check_type(seen: DType | None, got: DType, layer: int) -> DType:
    if seen is not None and seen != got:
        raise StateFormatError(f"layer {layer}: cache type {got.name} differs from {seen.name}")
    return got


def seq_state_size(fingerprint: ModelFingerprint, n_tokens: int, dtype: DType | str, *,
                   n_stream: int = 1) -> int:
    """Bytes of the state that write_seq_state produces (the same with or without v_trans)."""
    size = 12 + 4 * n_stream
    if n_tokens:
        rows = n_tokens * fingerprint.n_head_kv * fingerprint.head_dim * DType.parse(dtype).numpy.itemsize
        size += 12 * n_tokens + 8 + 2 * fingerprint.n_layer * (12 + rows)
    return size


class RecordRows(Protocol):
    """What write_seq_state reads of a record: a KVRecord, or prefix.BlockChain's blocks read as one."""

    @property
    def fingerprint(self) -> ModelFingerprint: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def positions(self) -> np.ndarray: ...
    def k(self, layer: int) -> np.ndarray: ...
    def v(self, layer: int) -> np.ndarray: ...


def write_seq_state(buf, record: RecordRows, *, v_trans: bool, seq_id: int = 0, n_stream: int = 1,
                    cache_dtype: DType | str | None = None) -> int:
    """Write the record as llama.cpp state bytes into buf (one copy of the payload); returns the size.

    v_trans, n_stream and cache_dtype describe the destination context, not the record's source.
    """
    fp, n = record.fingerprint, record.n_tokens
    dtype = DType.parse(cache_dtype) if cache_dtype is not None else record.dtype
    size = seq_state_size(fp, n, dtype, n_stream=n_stream)
    mv = memoryview(buf).cast("B")
    if mv.nbytes < size:
        raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the {size}-byte state")
    struct.pack_into("<IiII", mv, 0, STATE_MAGIC, seq_id, n_stream, n)
    # the cells go in the first stream; llama.cpp puts them in seq_id's own stream whichever it was.
    # Each stream's count is followed by its cells, so the other (empty) streams' counts come last.
    mv[size - 4 * (n_stream - 1):size] = bytes(4 * (n_stream - 1))
    if not n:
        return size
    pos = 16
    meta = np.frombuffer(mv, np.int32, 3 * n, pos).reshape(n, 3)
    meta[:, 0] = record.positions
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    pos += 12 * n
    struct.pack_into("<II", mv, pos, int(v_trans), fp.n_layer)
    pos += 8
    width = fp.n_head_kv * fp.head_dim
    item = dtype.numpy.itemsize
    for layer in range(fp.n_layer):
        struct.pack_into("<iQ", mv, pos, int(dtype), width * item)
        pos += 12
        dst: np.ndarray = np.frombuffer(mv, dtype.numpy, n * width, pos).reshape(n, fp.n_head_kv, fp.head_dim)
        convert_into(dst, dtype, record.k(layer), record.dtype)
        pos += n * width * item
    for layer in range(fp.n_layer):
        if v_trans:
            struct.pack_into("<iII", mv, pos, int(dtype), item, width)
            pos += 12
            dst = np.frombuffer(mv, dtype.numpy, n * width, pos).reshape(width, n).T
            convert_into(dst, dtype, record.v(layer).reshape(n, width), record.dtype)
        else:
            struct.pack_into("<iQ", mv, pos, int(dtype), width * item)
            pos += 12
            dst = np.frombuffer(mv, dtype.numpy, n * width, pos).reshape(n, fp.n_head_kv, fp.head_dim)
            convert_into(dst, dtype, record.v(layer), record.dtype)
        pos += n * width * item
    assert pos == size - 4 * (n_stream - 1)
    return size


def encode_state_into(buf, fingerprint: ModelFingerprint, state: SeqState, tokens,
                      dtype: DType | str | None = None) -> int:
    """Write parsed state as a neutral record into buf (e.g. a ring reservation); returns its size."""
    tokens = np.asarray(tokens)
    if len(tokens) != state.n_tokens:
        raise ValueError(f"{len(tokens)} token ids for a state of {state.n_tokens} cells")
    dtype = DType.parse(dtype) if dtype is not None else state.dtype
    rec = layout_into(buf, fingerprint, state.n_tokens, dtype)
    rec.tokens[:] = tokens
    rec.positions[:] = state.positions
    for layer in range(fingerprint.n_layer):
        convert_into(rec.k(layer), dtype, state.k[layer], state.dtype)
        convert_into(rec.v(layer), dtype, state.v[layer], state.dtype)
    seal(buf)
    return rec.nbytes


class StateBuffer:
    """A reusable, page-aligned scratch buffer for state bytes, handed to llama.cpp by pointer."""

    def __init__(self, nbytes: int = 0):
        self._mm: mmap.mmap | None = None
        self._array = np.empty(0, np.uint8)
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> np.ndarray:
        if nbytes > len(self._array):
            size = max(nbytes, 2 * len(self._array))
            size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            self._array = np.empty(0, np.uint8)  # drop the export before the old map goes
            self._mm = mm = mmap.mmap(-1, size)
            self._array = np.frombuffer(mm, np.uint8)
        return self._array[:nbytes]

    @property
    def capacity(self) -> int:
        """Bytes it holds now: ensure() up to this many keeps what is in it."""
        return len(self._array)

    @staticmethod
    def pointer(array: np.ndarray):
        return ctypes.cast(array.ctypes.data, ctypes.POINTER(ctypes.c_uint8))


def export_seq(ctx, seq_id: int, scratch: StateBuffer | None = None) -> np.ndarray:
    """Copy sequence seq_id's state out of a llama context into scratch; returns those bytes (a view)."""
    import llama_cpp

    scratch = StateBuffer() if scratch is None else scratch
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    out = scratch.ensure(size)
    got = llama_cpp.llama_state_seq_get_data(ctx, StateBuffer.pointer(out), size, seq_id)
    if got != size:
        raise StateFormatError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
    return out


def import_record(ctx, seq_id: int, record: RecordRows, *, v_trans: bool, scratch: StateBuffer | None = None,
                  n_stream: int = 1, cache_dtype: DType | str | None = None) -> int:
    """Load a record into sequence seq_id of a llama context; returns the bytes llama.cpp read.

    The record's K and V are copied once, into scratch, in the destination's layout; llama.cpp
    reads scratch through a pointer. Whatever seq_id held before is replaced.
    """
    import llama_cpp

    scratch = StateBuffer() if scratch is None else scratch
    dtype = DType.parse(cache_dtype) if cache_dtype is not None else record.dtype
    buf = scratch.ensure(seq_state_size(record.fingerprint, record.n_tokens, dtype, n_stream=n_stream))
    size = write_seq_state(buf, record, v_trans=v_trans, seq_id=seq_id, n_stream=n_stream,
                           cache_dtype=dtype)
    got = llama_cpp.llama_state_seq_set_data(ctx, StateBuffer.pointer(buf), size, seq_id)
    if got != size:
        raise StateImportError(f"llama_state_seq_set_data took {got} of {size} bytes for sequence {seq_id}")
    return got


def widen_streams(buf: np.ndarray, size: int, n_stream: int, shape: StateShape = StateShape()) -> int:
    """Re-address a one-stream state in place for a context with n_stream KV streams; returns its new size.

    A 1-sequence context exports one stream; a non-unified context with N sequences has N
    streams and refuses any other count. Only the count changes, and the other streams'
    (empty) cell counts follow the data, so buf needs 4 * (n_stream - 1) spare bytes per KV cache
    in the state: one for most models, two for a model with sliding-window layers (gemma 2 and 3:
    llama.cpp's iswa cache writes its full cache, then its window cache), see state_sections. A recurrent
    state after them has no streams: its one cell goes to whichever sequence the state is set into.
    """
    head = np.frombuffer(buf, np.uint32, 3)
    if head[0] != STATE_MAGIC or (shape.kv_caches != 0 and head[2] != 1):
        raise StateFormatError("not a one-stream sequence state")
    extra = 4 * (n_stream - 1)
    sections = state_sections(buf, size, shape)
    if len(buf) < size + extra * len(sections):
        raise ValueError(f"need {size + extra * len(sections)} bytes of buffer, have {len(buf)}")
    if not sections:  # a recurrent model's state alone: nothing to re-address
        return size
    if len(sections) == 1 and sections[0][1] == size:  # the common case: no copy
        np.frombuffer(buf, np.uint32, 3)[2] = n_stream
        buf[size:size + extra] = 0
        return size + extra
    parts = [buf[:8].copy()]
    for start, end in sections:
        body = buf[start:end].copy()
        body[:4] = np.frombuffer(np.uint32(n_stream).tobytes(), np.uint8)
        parts += [body, np.zeros(extra, np.uint8)]
    parts.append(buf[sections[-1][1]:size].copy())  # the recurrent state, as it is
    out = np.concatenate(parts)
    buf[:len(out)] = out
    return len(out)


def state_sections(buf, size: int, shape: StateShape = StateShape()) -> list[tuple[int, int]]:
    """Where each KV cache's part of a one-stream sequence state starts (its stream count) and ends: one part for
    most models, two for llama.cpp's iswa cache (full-attention layers, then sliding-window layers), none for a
    recurrent model. A part whose K rows end the state has no V rows: MLA's cache (deepseek2) keeps only its
    compressed rows, in K's place. With shape.recurrent, the recurrent state follows the shape's KV caches and
    ends the state; it is checked, not listed."""
    mv = memoryview(buf).cast("B")[:size]
    pos, sections = 8, list[tuple[int, int]]()
    try:
        while pos < size and (shape.kv_caches is None or len(sections) < shape.kv_caches):
            start = pos
            (streams,) = struct.unpack_from("<I", mv, pos)
            pos += 4
            for _ in range(streams):
                (cells,) = struct.unpack_from("<I", mv, pos)
                pos += 4
                if not cells:
                    continue
                pos += shape.cell_meta * cells  # pos, n_seq_id (1), [ext] and the seq id per cell
                v_trans, n_layer = struct.unpack_from("<II", mv, pos)
                pos += 8
                for _ in range(n_layer):  # K rows
                    _, row = struct.unpack_from("<iQ", mv, pos)
                    pos += 12 + row * cells
                if pos == size:  # no V: MLA keeps one compressed row per token and layer (deepseek2), read as K
                    continue
                for _ in range(n_layer):  # V rows, or V transposed
                    if v_trans:
                        _, elem, n_embd = struct.unpack_from("<iII", mv, pos)
                        pos += 12 + elem * n_embd * cells
                    else:
                        _, row = struct.unpack_from("<iQ", mv, pos)
                        pos += 12 + row * cells
            sections.append((start, pos))
        if shape.recurrent:
            cells, = struct.unpack_from("<I", mv, pos)
            s_trans, = struct.unpack_from("<I", mv, pos + 4 + 8 * cells)
            if cells > 1 or s_trans != 0:
                raise StateFormatError(f"a recurrent state of {cells} cells (s_trans {s_trans}) at byte {pos}: not one "
                                       "sequence's")
            pos = size
    except struct.error:
        raise StateFormatError(f"state ends early at byte {pos}") from None
    if pos != size:
        raise StateFormatError(f"a state of {size} bytes has parts ending at byte {pos}")
    return sections
