"""Codec between PyTorch KV tensors (transformers' past_key_values, vLLM's paged blocks) and the neutral record.

The record holds K and V as llama.cpp keeps them, `[token, kv_head, head_dim]` per layer.
V rows are the same on both sides. K rows are too, except for one thing:

* llama-family models (rope type "norm"): the GGUF converter permuted each head's Q/K
  projection rows, so llama.cpp rotates adjacent pairs (2j, 2j+1) where transformers rotates
  halves (j, j + d/2). llama.cpp's rotated K is HF's rotated K with each head's rotary dims
  interleaved: llama index `2*j + h` holds HF index `h*rope_dim/2 + j` (h in {0, 1}).
  Measured on SmolLM2-135M: per-layer correlation of the rows 0.9997-1.0 with the map,
  0.03-0.06 without it.
* NEOX-rope families (qwen2, ...): the converter permutes nothing; the rows map one to one.

vLLM's paged cache holds a layer as `[num_blocks, kv_heads, block_size, 2 * head_dim]`, and
backends disagree on what the last two dims hold (see `PAGED_LAYOUTS`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .record import DType, FingerprintMismatch, KVRecord, ModelFingerprint, layout_into, seal

# rope types (llama_codec._ROPE_TYPES) whose GGUF conversion permuted Q/K
_PERMUTED_ROPE = ("norm",)

# How a vLLM attention backend lays out a layer's [num_blocks, kv_heads, block_size, 2 * head_dim]
# (read from vLLM 0.32's backends and csrc/cpu/cpu_attn_*.hpp, and checked on the CPU build):
# "cpu": per block and head, K as [head_dim, block_size] (column per token: the kernels' QK tile),
# then V as [block_size, head_dim]; "channels": each token's row is K then V (GPU backends split
# the last dim). Other backends, and the CPU's AMX kernels (VNNI-packed bf16), are refused
# rather than guessed: the decoder then recomputes the prompt.
PAGED_LAYOUTS = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "channels",
    "TRITON_ATTN": "channels",
    "FLEX_ATTENTION": "channels",
}
CPU_ISAS = ("vec", "vec16", "neon", "vsx", "vxe", "rvv")  # kernels sharing the layout above


class LayoutError(ValueError):
    """The tensors do not have the shape the fingerprint describes, or the layout is unknown."""


def needs_k_permutation(fp: ModelFingerprint) -> bool:
    """Whether HF K rows must be re-interleaved for llama.cpp (llama-family rope) or map as they are."""
    return fp.rope_type in _PERMUTED_ROPE


def k_to_llama(k, fp: ModelFingerprint):
    """HF-order K [..., head_dim] -> llama.cpp order (a view where possible; torch or numpy)."""
    if not needs_k_permutation(fp):
        return k
    return _interleave(k, fp.rope_dim)


def k_from_llama(k, fp: ModelFingerprint):
    """llama.cpp-order K [..., head_dim] -> HF order."""
    if not needs_k_permutation(fp):
        return k
    return _deinterleave(k, fp.rope_dim)


def _cat(parts, like):
    if isinstance(like, np.ndarray):
        return np.concatenate(parts, axis=-1)
    import torch

    return torch.cat(parts, dim=-1)


def _swap_last(a):
    return a.swapaxes(-1, -2) if isinstance(a, np.ndarray) else a.transpose(-1, -2)


def _interleave(k, rope_dim: int):
    # [..., (h, j)] -> [..., (j, h)] over the rotary dims; the rest (partial rotary) stays
    rot, rest = k[..., :rope_dim], k[..., rope_dim:]
    out = _swap_last(rot.reshape(*rot.shape[:-1], 2, rope_dim // 2)).reshape(rot.shape)
    return out if rest.shape[-1] == 0 else _cat([out, rest], k)


def _deinterleave(k, rope_dim: int):
    rot, rest = k[..., :rope_dim], k[..., rope_dim:]
    out = _swap_last(rot.reshape(*rot.shape[:-1], rope_dim // 2, 2)).reshape(rot.shape)
    return out if rest.shape[-1] == 0 else _cat([out, rest], k)


def check_model(fp: ModelFingerprint, *, n_layer: int, n_head_kv: int, head_dim: int) -> None:
    """Refuse a torch model whose KV shape is not the fingerprint's (another model than the GGUF's)."""
    got = {"n_layer": n_layer, "n_head_kv": n_head_kv, "head_dim": head_dim}
    bad = [f"{k}: {v} != {getattr(fp, k)}" for k, v in got.items() if v != getattr(fp, k)]
    if bad:
        raise FingerprintMismatch("the torch model is not the one the fingerprint describes: " + "; ".join(bad))


def hf_config_shape(config) -> dict:
    """n_layer, n_head_kv, head_dim of a transformers config (what check_model compares)."""
    n_head = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    return {"n_layer": config.num_hidden_layers, "n_head_kv": getattr(config, "num_key_value_heads", None) or n_head,
            "head_dim": head_dim}


def torch_view(array: np.ndarray, dtype: DType):
    """A torch tensor over a record's numpy view (shared memory, no copy); bf16 is viewed from its bits."""
    import torch

    t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype is DType.BF16 else t


def fill_layer(record: KVRecord, layer: int, k, v, *, permute: bool = True) -> None:
    """Copy one layer's K and V ([n_tokens, kv_heads, head_dim] torch tensors, any device) into the record.

    permute=False leaves K in HF order: only a test's control wants that (it must decode badly).
    """
    fp = record.fingerprint
    want = (record.n_tokens, fp.n_head_kv, fp.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise LayoutError(f"layer {layer}: K {tuple(k.shape)} and V {tuple(v.shape)}, the record holds {want}")
    dst_k, dst_v = torch_view(record.k(layer), record.dtype), torch_view(record.v(layer), record.dtype)
    # convert on the device (one pass), then one copy into the mapped record
    dst_k.copy_((k_to_llama(k, fp) if permute else k).to(dst_k.dtype))
    dst_v.copy_(v.to(dst_v.dtype))


def encode_tensors_into(buf, fp: ModelFingerprint, tokens, keys: Sequence, values: Sequence, *,
                        dtype: DType | str = DType.F16, permute: bool = True) -> tuple[int, int]:
    """Write a whole record (per-layer [n_tokens, kv_heads, head_dim] K and V in HF order) into buf.

    Returns (size, checksum). buf is typically a ring reservation's view.
    """
    tokens = np.asarray(tokens, np.int32)
    if len(keys) != fp.n_layer or len(values) != fp.n_layer:
        raise LayoutError(f"{len(keys)} K and {len(values)} V layers, the fingerprint says {fp.n_layer}")
    rec = layout_into(buf, fp, len(tokens), dtype)
    rec.tokens[:] = tokens
    rec.positions[:] = np.arange(len(tokens), dtype=np.int32)
    for layer in range(fp.n_layer):
        fill_layer(rec, layer, keys[layer], values[layer], permute=permute)
    return rec.nbytes, seal(buf)


def past_key_values_layers(past) -> tuple[list, list]:
    """Per-layer K and V as [n_tokens, kv_heads, head_dim] views of a batch-1 transformers cache."""
    if hasattr(past, "layers"):  # transformers >= 4.56: Cache.layers[i].keys / .values
        pairs = [(layer.keys, layer.values) for layer in past.layers]
    elif hasattr(past, "key_cache"):
        pairs = list(zip(past.key_cache, past.value_cache))
    else:  # the legacy tuple of (k, v)
        pairs = [(k, v) for k, v in past]
    keys, values = [], []
    for k, v in pairs:
        if k.shape[0] != 1:
            raise LayoutError(f"a KV record holds one sequence; the cache has a batch of {k.shape[0]}")
        keys.append(k[0].transpose(0, 1))  # [1, H, T, D] -> [T, H, D]
        values.append(v[0].transpose(0, 1))
    return keys, values


def record_to_tensors(record: KVRecord, device="cpu", dtype=None) -> tuple[list, list]:
    """Per-layer K and V in HF order as [1, kv_heads, n_tokens, head_dim] tensors (what a DynamicCache holds)."""
    import torch

    dtype = dtype or torch.float32
    keys, values = [], []
    for layer in range(record.fingerprint.n_layer):
        k = torch_view(np.ascontiguousarray(record.k(layer)), record.dtype).to(device=device, dtype=dtype)
        v = torch_view(np.ascontiguousarray(record.v(layer)), record.dtype).to(device=device, dtype=dtype)
        keys.append(k_from_llama(k, record.fingerprint).transpose(0, 1).unsqueeze(0).contiguous())
        values.append(v.transpose(0, 1).unsqueeze(0).contiguous())
    return keys, values


# -- vLLM's paged cache ------------------------------------------------------------------------


def paged_layout(backend_name: str, isa: str | None = None) -> str:
    """The paged layout of a vLLM attention backend (and, on CPU, kernel ISA); LayoutError if unknown."""
    layout = PAGED_LAYOUTS.get(backend_name)
    if layout is None:
        raise LayoutError(f"vLLM attention backend {backend_name!r}: its paged KV layout is not known to "
                          f"this codec (known: {', '.join(PAGED_LAYOUTS)})")
    if layout == "cpu" and isa not in CPU_ISAS:
        raise LayoutError(f"vLLM's CPU attention with the {isa!r} kernels: its K layout is not known to this "
                          f"codec (known: {', '.join(CPU_ISAS)})")
    return layout


def slot_indices(block_ids: Sequence[int], block_size: int, n_tokens: int):
    """The cache slot (block_id * block_size + offset) of each of a request's first n_tokens tokens.

    block_ids are the scheduler's (logical) blocks of block_size tokens; the last may be partial.
    """
    import torch

    if len(block_ids) * block_size < n_tokens:
        raise LayoutError(f"{len(block_ids)} blocks of {block_size} cannot hold {n_tokens} tokens")
    pos = torch.arange(n_tokens)
    return torch.as_tensor(list(block_ids), dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def gather_paged(layer_cache, slots, layout: str) -> tuple:
    """K and V [n_tokens, kv_heads, head_dim] of one layer, gathered from vLLM's paged blocks.

    layer_cache: the layer's [num_blocks, kv_heads, block_size, 2 * head_dim] tensor. Its block
    size may be the kernel's, smaller than the scheduler's: slots address tokens, so both agree.
    """
    if layer_cache.dim() != 4:
        raise LayoutError(f"expected a [blocks, kv_heads, block_size, 2*head_dim] layer, got {tuple(layer_cache.shape)}")
    n_blocks, n_heads, block_size, width = layer_cache.shape
    head_dim = width // 2
    slots = slots.to(layer_cache.device)
    blocks, offsets = slots // block_size, slots % block_size
    if layout == "cpu":
        halves = layer_cache.reshape(n_blocks, n_heads, 2, block_size * head_dim)
        k = halves[:, :, 0].view(n_blocks, n_heads, head_dim, block_size)[blocks, :, :, offsets]
        v = halves[:, :, 1].view(n_blocks, n_heads, block_size, head_dim)[blocks, :, offsets]
    elif layout == "channels":
        tok = layer_cache[blocks, :, offsets]  # [T, H, 2D]
        k, v = tok[..., :head_dim], tok[..., head_dim:]
    else:
        raise LayoutError(f"unknown paged layout {layout!r}")
    return k, v
