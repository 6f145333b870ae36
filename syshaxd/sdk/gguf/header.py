"""The header of a GGUF file read without llama.cpp: its metadata, tensor table and KV model fingerprint."""

from __future__ import annotations

import functools
import mmap
import os
import struct
from pathlib import Path

import xxhash

from syshaxd.sdk.kv.record import ModelFingerprint


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands, or lacks a key the fingerprint needs."""


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# llama.cpp's rope type per architecture (llama_model_rope_type), for the families we expect
_ROPE_TYPES = {"llama": "norm", "mistral": "norm", "granite": "norm", "qwen2": "neox", "qwen3": "neox",
               "qwen2moe": "neox", "qwen3moe": "neox", "phi3": "neox", "gemma": "neox", "gemma2": "neox",
               "gemma3": "neox", "olmo2": "neox", "falcon": "neox", "stablelm": "neox"}


def _gguf_value(mv, pos: int, vtype: int):
    if vtype == _GGUF_STRING:
        (n,) = struct.unpack_from("<Q", mv, pos)
        return bytes(mv[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n
    if vtype == _GGUF_ARRAY:
        etype, count = struct.unpack_from("<IQ", mv, pos)
        pos += 12
        if etype in _GGUF_SCALARS:  # numbers: skip in one step, keep only short arrays
            fmt = "<" + _GGUF_SCALARS[etype]
            size = struct.calcsize(fmt) * count
            values = list(struct.iter_unpack(fmt, mv[pos:pos + size])) if count <= 1024 else None
            return values and [v[0] for v in values], pos + size
        # short ones are kept (a classifier's output labels); long ones (the vocabulary) are not needed
        items: list | None = [] if count <= 64 else None
        for _ in range(count):
            item, pos = _gguf_value(mv, pos, etype)
            if items is not None:
                items.append(item)
        return items, pos
    fmt = "<" + _GGUF_SCALARS[vtype]
    return struct.unpack_from(fmt, mv, pos)[0], pos + struct.calcsize(fmt)


def read_gguf_header(path: str | os.PathLike) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    """The metadata (long arrays left out) and the tensor table (name, shape, ggml type) of a GGUF file;
    GGUFError when the file is not one (too short, cut off, an unknown value type). Read once per version of the
    file (about 50 ms: the vocabulary is walked): the start-up asks it several things. The caller must not change
    what it returns."""
    st = os.stat(path)
    return _cached_header(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    try:
        return _read_header(path)
    except GGUFError:
        raise
    except (struct.error, KeyError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise GGUFError(f"{path}: not a readable GGUF header ({exc})") from None


def _read_header(path: str | os.PathLike) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mv = memoryview(mm)
        try:
            if bytes(mv[:4]) != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file (a GGUF starts with the bytes GGUF; convert other formats "
                                "with llama.cpp's convert_hf_to_gguf.py)")
            magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", mv, 0)
            if version < 2:
                raise GGUFError(f"{path}: a GGUF v{version} file; llama.cpp reads v2 and later")
            pos, meta = 24, {}
            for _ in range(n_kv):
                key, pos = _gguf_value(mv, pos, _GGUF_STRING)
                (vtype,) = struct.unpack_from("<I", mv, pos)
                meta[key], pos = _gguf_value(mv, pos + 4, vtype)
            tensors = []
            for _ in range(n_tensors):
                name, pos = _gguf_value(mv, pos, _GGUF_STRING)
                (n_dims,) = struct.unpack_from("<I", mv, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", mv, pos + 4)
                ttype, _ = struct.unpack_from("<IQ", mv, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                tensors.append((name, dims, ttype))
        finally:
            mv.release()
    return meta, tensors


def n_vocab_from_gguf(path: str | os.PathLike) -> int:
    """Rows of the token embedding: the logits one evaluated token yields."""
    _, tensors = read_gguf_header(path)
    dims = {name: shape for name, shape, _ in tensors}.get("token_embd.weight")
    if not dims or len(dims) < 2:
        raise GGUFError(f"{Path(path).name}: no token_embd.weight tensor to read the vocabulary size from")
    return dims[1]


def fingerprint_from_gguf(path: str | os.PathLike) -> ModelFingerprint:
    """The model fingerprint of a GGUF file; any engine loading weights made from it can compute it."""
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{Path(path).name}: no general.architecture in the GGUF metadata")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{Path(path).name}: no {arch}.{key} in the GGUF metadata")
        if isinstance(value, list):  # per-layer values: the widest layer decides the row size
            value = max(value)
        return value

    n_head = get("attention.head_count")
    # a recurrent-only model (mamba, RWKV) has no attention heads: its KV rows are empty
    head_dim = get("attention.key_length", get("embedding_length") // n_head if n_head else 0)
    scale = meta.get(f"{arch}.rope.scaling.factor") or 1.0
    table = xxhash.xxh3_64()
    for name, dims, ttype in tensors:
        table.update(f"{name}:{','.join(map(str, dims))}:{ttype};".encode())
    return ModelFingerprint(
        arch=arch, n_layer=get("block_count"), n_head_kv=get("attention.head_count_kv", n_head),
        head_dim=head_dim, rope_type=_ROPE_TYPES.get(arch, "arch-default"),
        rope_dim=get("rope.dimension_count", head_dim), rope_freq_base=float(get("rope.freq_base", 10000.0)),
        rope_freq_scale=1.0 / float(scale), tensor_table_hash=table.intdigest())
