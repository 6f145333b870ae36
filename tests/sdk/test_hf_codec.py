"""The HF/vLLM codec's sharp edges: the llama-family K interleave, paged-block gathers, fingerprints, dtypes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import MODEL_DIR
from teacher_forced import hf_folder  # noqa: F401  (a fixture)

torch = pytest.importorskip("torch")

from syshaxd.sdk.kv import hf_codec  # noqa: E402
from syshaxd.sdk.kv.record import DType, FingerprintMismatch, ModelFingerprint, decode, record_size  # noqa: E402

LLAMA = ModelFingerprint("llama", n_layer=2, n_head_kv=3, head_dim=8, rope_type="norm", rope_dim=8,
                         rope_freq_base=1e4, rope_freq_scale=1.0, tensor_table_hash=7)
QWEN = dataclasses.replace(LLAMA, arch="qwen2", rope_type="neox")


def test_llama_k_is_interleaved_by_the_documented_index_map():
    hf = np.arange(2 * 3 * 8).reshape(2, 3, 8)
    llama = hf_codec.k_to_llama(hf, LLAMA)
    half = 8 // 2
    for j in range(half):
        for h in (0, 1):
            assert (llama[..., 2 * j + h] == hf[..., h * half + j]).all()  # DESIGN.md: llama 2j+h <- HF h*d/2+j
    assert (hf_codec.k_from_llama(llama, LLAMA) == hf).all()
    t = torch.from_numpy(hf)
    assert torch.equal(hf_codec.k_to_llama(t, LLAMA), torch.from_numpy(np.ascontiguousarray(llama)))


def test_neox_families_map_one_to_one_and_partial_rope_keeps_the_rest():
    hf = np.random.default_rng(0).standard_normal((4, 3, 8))
    assert hf_codec.k_to_llama(hf, QWEN) is hf and not hf_codec.needs_k_permutation(QWEN)
    partial = dataclasses.replace(LLAMA, rope_dim=4)
    out = hf_codec.k_to_llama(hf, partial)
    assert (out[..., 4:] == hf[..., 4:]).all() and (out[..., [0, 1, 2, 3]] == hf[..., [0, 2, 1, 3]]).all()
    assert np.array_equal(hf_codec.k_from_llama(out, partial), hf)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16, DType.F32])
def test_tensors_round_trip_through_a_record(dtype):
    g = torch.Generator().manual_seed(1)
    n = 5
    keys = [torch.randn(n, 3, 8, generator=g) for _ in range(2)]
    values = [torch.randn(n, 3, 8, generator=g) for _ in range(2)]
    buf = bytearray(record_size(LLAMA, n, dtype))
    size, checksum = hf_codec.encode_tensors_into(buf, LLAMA, list(range(n)), keys, values, dtype=dtype)
    rec = decode(buf, expect=LLAMA)
    assert rec.nbytes == size and rec.checksum == checksum and rec.positions.tolist() == list(range(n))
    tol = {DType.F32: 0, DType.F16: 1e-3, DType.BF16: 1e-2}[dtype]
    # the record holds llama.cpp's order; reading it back gives HF's again, [1, heads, tokens, dim]
    assert np.allclose(np.asarray(hf_codec.torch_view(rec.k(0), dtype).float()),
                       hf_codec.k_to_llama(keys[0], LLAMA).numpy(), atol=tol * 4, rtol=tol)
    back_k, back_v = hf_codec.record_to_tensors(rec)
    for layer in range(2):
        assert torch.allclose(back_k[layer][0].transpose(0, 1), keys[layer], atol=tol * 4, rtol=tol)
        assert torch.allclose(back_v[layer][0].transpose(0, 1), values[layer], atol=tol * 4, rtol=tol)


def test_shapes_that_are_not_the_fingerprints_are_refused():
    buf = bytearray(record_size(LLAMA, 2, DType.F16))
    with pytest.raises(hf_codec.LayoutError):
        hf_codec.encode_tensors_into(buf, LLAMA, [1, 2], [torch.zeros(2, 3, 4)] * 2, [torch.zeros(2, 3, 4)] * 2)
    with pytest.raises(FingerprintMismatch):
        hf_codec.check_model(LLAMA, n_layer=2, n_head_kv=4, head_dim=8)


def _paged(layout: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, n_blocks=6, block_size=4):
    """Write K, V [T, H, D] into an empty paged layer the way that backend's kernels do."""
    t, h, d = k.shape
    cache = torch.full((n_blocks, h, block_size, 2 * d), float("nan"))
    flat = cache.view(n_blocks, h, 2 * block_size * d)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, block_size)
        if layout == "cpu":  # K column-major [d, block], then V row-major [block, d]
            flat[b, :, torch.arange(d) * block_size + o] = k[i]
            flat[b, :, block_size * d + o * d: block_size * d + (o + 1) * d] = v[i]
        else:
            cache[b, :, o] = torch.cat([k[i], v[i]], dim=-1)
    return cache


@pytest.mark.parametrize("layout", ["cpu", "channels"])
def test_paged_blocks_are_gathered_including_the_partial_last_one(layout):
    g = torch.Generator().manual_seed(2)
    n = 10  # blocks of 4: two full ones and half of a third
    k, v = torch.randn(n, 3, 8, generator=g), torch.randn(n, 3, 8, generator=g)
    block_ids = [4, 1, 3]  # scattered, as the block pool hands them out
    slots = hf_codec.slot_indices(block_ids, 4, n)
    assert slots.tolist()[:5] == [16, 17, 18, 19, 4] and slots.tolist()[-1] == 13
    got_k, got_v = hf_codec.gather_paged(_paged(layout, k, v, slots), slots, layout)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # the kernel may split the scheduler's blocks (8 tokens here) into its own (4): slots address
    # tokens, so both views agree
    slots = hf_codec.slot_indices([2, 0], 8, n)
    got_k, got_v = hf_codec.gather_paged(_paged(layout, k, v, slots), slots, layout)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    with pytest.raises(hf_codec.LayoutError):
        hf_codec.slot_indices(block_ids, 4, 13)  # three blocks of 4 cannot hold 13 tokens


def test_unknown_paged_layouts_are_refused_not_guessed():
    assert hf_codec.paged_layout("CPU_ATTN", "vec") == "cpu"
    assert hf_codec.paged_layout("FLASH_ATTN") == "channels"
    with pytest.raises(hf_codec.LayoutError, match="amx"):
        hf_codec.paged_layout("CPU_ATTN", "amx")
    with pytest.raises(hf_codec.LayoutError, match="FLASHINFER"):
        hf_codec.paged_layout("FLASHINFER")


def test_hf_folder_is_the_q4_0_ggufs_and_vllm_ready(default_model, hf_folder):
    from syshaxd.sdk.hf_model import folder_fingerprint
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf

    fp = folder_fingerprint(hf_folder)
    assert fp == fingerprint_from_gguf(default_model)
    assert fp != fingerprint_from_gguf(MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf")  # other weights, same shape
    config = json.loads((hf_folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (hf_folder / "model.safetensors").stat().st_size > 200e6


def test_a_torch_record_is_refused_by_a_decoder_of_other_weights(default_model, hf_folder):
    from syshaxd.sdk.hf_model import folder_fingerprint
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf

    fp = folder_fingerprint(hf_folder)
    n = 3
    zeros = [torch.zeros(n, fp.n_head_kv, fp.head_dim)] * fp.n_layer
    buf = bytearray(record_size(fp, n, DType.F16))
    hf_codec.encode_tensors_into(buf, fp, [1, 2, 3], zeros, zeros)
    with pytest.raises(FingerprintMismatch, match="tensor_table_hash"):
        decode(buf, expect=fingerprint_from_gguf(MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_hf_k_rows_match_llamacpps_only_through_the_map(default_model, hf_folder):
    """DESIGN.md's measurement: per-layer correlation 0.9998-1.0 with the map, under 0.1 without."""
    import llama_cpp
    from transformers import AutoModelForCausalLM

    from syshaxd.sdk.hf_model import folder_fingerprint
    from syshax_llamacpp.codec import export_seq, parse_seq_state
    from teacher_forced import Decoder

    fp = folder_fingerprint(hf_folder)
    dec = Decoder(default_model)
    try:
        tokens = dec.tokenize("The quick brown fox jumps over the lazy dog because")
        dec._decode(tokens, 0, 0)
        state = parse_seq_state(export_seq(dec.ctx, 0), fp)
        model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
        with torch.inference_mode():
            past = model(torch.tensor([tokens]), use_cache=True).past_key_values
        keys, _ = hf_codec.past_key_values_layers(past)
        corr = lambda a, b: float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])  # noqa: E731
        mapped = [corr(hf_codec.k_to_llama(keys[i], fp).numpy(), state.k[i].astype(np.float32)) for i in range(fp.n_layer)]
        plain = [corr(keys[i].numpy(), state.k[i].astype(np.float32)) for i in range(fp.n_layer)]
    finally:
        llama_cpp.llama_memory_seq_rm(dec.memory, 0, -1, -1)
        dec.close()
    print(f"\nK rows, HF vs llama.cpp: {min(mapped):.4f}..{max(mapped):.4f} with the map, "
          f"{min(plain):.3f}..{max(plain):.3f} without")
    assert min(mapped) > 0.999 and max(plain) < 0.2
