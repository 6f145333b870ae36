"""Quantize a GGUF with llama.cpp's own quantizer once, and reuse the cached result."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from syshaxd.sdk.types import EngineSpec

log = logging.getLogger(__name__)

# llama.cpp's LLAMA_FTYPE_MOSTLY_* values for the types syshax offers
FTYPES = {"q4_0": 2}
_QUANT_SUFFIX = re.compile(r"\.(?:[QqFf]|BF|bf|IQ|iq)[0-9][0-9A-Za-z_]*$")


def quantized_path(source: Path, qtype: str, cache_dir: Path) -> Path:
    """Where the `qtype` copy of `source` lives: its name with the old quant tag swapped."""
    stem = _QUANT_SUFFIX.sub("", source.stem)
    return cache_dir / f"{stem}.{qtype}.gguf"


def gguf_file_type(path: Path) -> int | None:
    """general.file_type of a GGUF (llama.cpp ftype), read without loading the model."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if model is None:
        raise ValueError(f"{path} is not a GGUF model llama.cpp can read")
    try:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        return int(buf.value.decode()) if n > 0 else None
    finally:
        llama_cpp.llama_model_free(model)


def ensure_quantized(source: Path, qtype: str, cache_dir: Path) -> Path:
    """Return a `qtype` GGUF for `source`: itself if it already is one, else a cached copy."""
    if qtype not in FTYPES:
        raise ValueError(f'quantize: unsupported type {qtype!r}; supported: {", ".join(FTYPES)}')
    if gguf_file_type(source) == FTYPES[qtype]:
        return source
    target = quantized_path(source, qtype, cache_dir)
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # several workers may start at once: one quantizes, the others wait and reuse
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
            return target
        _quantize(source, target, FTYPES[qtype])
    return target


def _quantize(source: Path, target: Path, ftype: int) -> None:
    import llama_cpp

    log.info("quantizing %s to %s (first load; cached for next time)", source.name, target.name)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the embedded model ships as Q4_1
    params.nthread = len(os.sched_getaffinity(0))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} (error {rc})")
    os.replace(tmp, target)


def resolve_gguf(spec: "EngineSpec") -> Path:
    """The GGUF the CPU decoders load for this spec (quantized as they quantize it)."""
    path = Path(spec.model_path)
    if spec.quantize:
        path = ensure_quantized(path, spec.quantize, Path(spec.cache_dir or path.parent))
    return path
