"""The neutral KV record: layout, zero-copy decode, checksum and fingerprint checks."""

import os

import numpy as np
import pytest

from syshaxd.sdk.kv import record as rec
from syshaxd.sdk.kv.record import DType, FingerprintMismatch, ModelFingerprint, RecordCorrupt
from syshaxd.sdk.kv.ring import HEADER_SIZE, RECORD_HEADER, KVRing, ring_path

FP = ModelFingerprint(arch="llama", n_layer=3, n_head_kv=2, head_dim=8, rope_type="norm", rope_dim=8,
                      rope_freq_base=100000.0, rope_freq_scale=1.0, tensor_table_hash=0x1234_5678_9ABC_DEF0)


def sample(n_tokens=5, seed=0):
    g = np.random.default_rng(seed)
    k = g.standard_normal((FP.n_layer, n_tokens, FP.n_head_kv, FP.head_dim)).astype(np.float32)
    v = g.standard_normal((FP.n_layer, n_tokens, FP.n_head_kv, FP.head_dim)).astype(np.float32)
    return np.arange(100, 100 + n_tokens), np.arange(n_tokens), k, v


@pytest.mark.parametrize("dtype", ["f16", "f32", DType.BF16])
def test_encode_then_decode_gives_views_of_the_same_values(dtype):
    tokens, positions, k, v = sample()
    if DType.parse(dtype) is DType.BF16:
        k, v = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (k, v))  # raw bf16 bits
    size = rec.record_size(FP, len(tokens), dtype)
    buf = bytearray(size + 100)  # a larger buffer, like a ring reservation rounded up
    assert rec.encode_into(buf, FP, tokens, positions, k, v, dtype) == size
    out = rec.decode(memoryview(buf).toreadonly(), expect=FP)
    assert out.fingerprint == FP and out.n_tokens == 5 and out.nbytes == size
    assert out.kv.shape == (3, 2, 5, 2, 8)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.positions, positions)
    for layer in range(3):
        np.testing.assert_array_equal(out.k(layer), k[layer].astype(DType.parse(dtype).numpy))
        np.testing.assert_array_equal(out.v(layer), v[layer].astype(DType.parse(dtype).numpy))
    # views, not copies: they point into buf
    base = np.frombuffer(buf, np.uint8).ctypes.data
    assert base <= out.kv.ctypes.data < base + len(buf)
    assert (out.kv.ctypes.data - base) % 64 == 0
    assert not out.kv.flags.writeable


def test_a_corrupted_byte_is_detected_by_the_checksum():
    tokens, positions, k, v = sample()
    buf = bytearray(rec.record_size(FP, 5, "f16"))
    rec.encode_into(buf, FP, tokens, positions, k, v)
    rec.decode(buf)
    for where in (20, len(buf) // 2, len(buf) - 1):  # header field, a K row, the last V byte
        bad = bytearray(buf)
        bad[where] ^= 0x01
        with pytest.raises(RecordCorrupt, match="checksum mismatch"):
            rec.decode(bad)
    rec.decode(bad, verify=False)  # a caller who already checked can skip the hash


def test_a_record_from_another_model_is_refused_with_the_differences():
    tokens, positions, k, v = sample()
    buf = bytearray(rec.record_size(FP, 5, "f16"))
    rec.encode_into(buf, FP, tokens, positions, k, v)
    other = ModelFingerprint(**{**FP.__dict__, "tensor_table_hash": 1, "rope_freq_base": 10000.0})
    with pytest.raises(FingerprintMismatch, match="rope_freq_base.*tensor_table_hash"):
        rec.decode(buf, expect=other)
    assert rec.decode(buf, expect=FP.to_bytes()).fingerprint == FP


def test_malformed_bytes_raise_record_corrupt():
    with pytest.raises(RecordCorrupt, match="shorter"):
        rec.decode(b"short")
    with pytest.raises(RecordCorrupt, match="bad magic"):
        rec.decode(bytes(200))
    tokens, positions, k, v = sample()
    buf = bytearray(rec.record_size(FP, 5, "f16"))
    rec.encode_into(buf, FP, tokens, positions, k, v)
    with pytest.raises(RecordCorrupt, match="claims"):
        rec.decode(buf[:-1])  # truncated


def test_layout_into_hands_out_writable_views_then_seal_checksums():
    buf = bytearray(rec.record_size(FP, 4, "f32"))
    out = rec.layout_into(buf, FP, 4, "f32")
    out.tokens[:] = [1, 2, 3, 4]
    out.positions[:] = [10, 11, 12, 13]
    out.kv[...] = 0.5
    checksum = rec.seal(buf)
    back = rec.decode(bytes(buf))
    assert back.checksum == checksum
    assert back.positions.tolist() == [10, 11, 12, 13] and float(back.v(2)[3, 1, 7]) == 0.5


def test_fingerprint_round_trips_through_bytes_and_rejects_garbage():
    assert ModelFingerprint.from_bytes(FP.to_bytes()) == FP
    with pytest.raises(RecordCorrupt):
        ModelFingerprint.from_bytes(b"SHFP" + bytes(10))
    with pytest.raises(ValueError, match="dtype='q8_0'"):
        DType.parse("q8_0")


def test_a_record_written_straight_into_a_ring_reservation_and_read_back():
    name = f"test{os.getpid()}-record"
    tokens, positions, k, v = sample(n_tokens=33, seed=3)
    try:
        with KVRing.create(name, 1 << 20) as ring, KVRing.attach(name) as consumer:
            res = ring.reserve(rec.record_size(FP, 33, "f16"))
            rec.encode_into(res.view, FP, tokens, positions, k, v)
            offset = res.commit()
            out = rec.decode(consumer.read(offset), expect=FP)
            np.testing.assert_array_equal(out.k(1), k[1].astype(np.float16))
            # flip one byte of the shared segment itself, as another process's stray write would
            fd = os.open(ring_path(name), os.O_RDWR)
            try:
                where = HEADER_SIZE + offset + RECORD_HEADER + out.nbytes - 10
                os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x80]), where)
            finally:
                os.close(fd)
            with pytest.raises(RecordCorrupt, match="checksum"):
                rec.decode(consumer.read(offset))
            del out
            consumer.release(offset)
    finally:
        ring_path(name).unlink(missing_ok=True)


def test_bf16_conversions_round_to_nearest_and_widen_exactly():
    x = np.array([1.0, -2.5, 3.14159265, 1e-3, 60000.0], np.float32)
    bf = np.empty(5, np.uint16)
    rec.convert_into(bf, DType.BF16, x, DType.F32)
    back = np.empty(5, np.float32)
    rec.convert_into(back, DType.F32, bf, DType.BF16)
    np.testing.assert_allclose(back, x, rtol=2 ** -8)
    assert back[0] == 1.0 and back[1] == -2.5
    half = np.empty(5, np.float16)
    rec.convert_into(half, DType.F16, bf, DType.BF16)
    np.testing.assert_array_equal(half, back.astype(np.float16))


def test_a_record_of_llama_cpps_whole_state_is_read_only_by_a_reader_that_takes_it():
    """FLAG_LLAMA_STATE: the prompt's tokens and llama.cpp's own state bytes (a model whose KV is not rows per head of
    one cache), checksummed like any record; a reader that takes K and V rows (torch, vLLM) refuses it by name."""
    state = np.random.default_rng(1).integers(0, 256, 1001, dtype=np.uint8)  # any length, not a multiple of 64
    size = rec.state_record_size(FP, 5, state.nbytes)
    buf = bytearray(size + 64)
    assert rec.encode_state_record_into(buf, FP, [7, 8, 9, 10, 11], state) == size
    out = rec.decode(memoryview(buf).toreadonly(), expect=FP, llama_state=True)
    assert out.n_tokens == 5 and out.nbytes == size and out.tokens.tolist() == [7, 8, 9, 10, 11]
    np.testing.assert_array_equal(out.state, state)
    assert out.kv.size == 0 and not out.state.flags.writeable
    with pytest.raises(rec.RecordError, match="llama.cpp's own sequence state"):
        rec.decode(buf, expect=FP)
    bad = bytearray(buf)
    bad[size - 1] ^= 0x01  # the state's last byte
    with pytest.raises(RecordCorrupt, match="checksum mismatch"):
        rec.decode(bad, llama_state=True)
    other = ModelFingerprint(**{**FP.__dict__, "n_layer": 4})
    with pytest.raises(FingerprintMismatch):
        rec.decode(buf, expect=other, llama_state=True)
    # a rows record reads as rows (no state) with the flag allowed
    tokens, positions, k, v = sample()
    rows = bytearray(rec.record_size(FP, 5, "f16"))
    rec.encode_into(rows, FP, tokens, positions, k, v)
    assert rec.decode(rows, llama_state=True).state is None
