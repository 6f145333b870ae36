"""The llama.cpp objects an engine owns: the model, loaded with the kernels chosen for this CPU, and the
parameters of its two contexts (the batch context that decodes, the prompt context that runs prompts).

Apart from the engine because each setting here is a measured promise -- tiled attention, one KV stream per
slot, flash attention, a prompt context of one sequence -- that keeps a request's tokens the ones it gets
alone, and because loading refuses, with the reason, a model the engine cannot serve.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from syshax_llamacpp import kernels
from syshax_llamacpp.codec import StateShape, shape_of
from syshaxd.sdk.gguf.header import GGUFError
from syshaxd.sdk.gguf.layout import kv_layout
from syshaxd.sdk.gguf.quantize import ensure_quantized
from syshaxd.sdk.types import EngineSpec

log = logging.getLogger("syshax_llamacpp.engine")

# What mk/llama-wheel.sh's llama.cpp reads, once per process, to take every query row's attention in tiles, a decode
# step's too, where llama.cpp tiles only prompt chunks of 64 tokens or more (EngineSpec.tiled_attention): then a
# chunk of any size, and a decode step, give a token the same bits (bench/bench_decode_kv.py), which the warm-up
# proves (proofs.WarmUp._proves_decode_kv).
TILED_ATTENTION_ENV = "SYSHAX_FA_TILED"

# K-quant and IQ weights that are not repacked (a Q4_K_M's Q6_K layers and output, Q5_K, IQ4_XS, ...): llama.cpp
# multiplies 8 rows and more with its tiled kernels (ggml-cpu/tiled) and fewer with vec_dot, which sum a row in
# other orders, so a row's bits depend on how many rows share its step. vec_dot's arithmetic for every row count
# (llama.cpp's own switch, read once per process) gives a row the same bits alone, in a decode batch and in a prompt
# chunk; mk/patches 0015 computes Q6_K's 2 rows and more that way with each block unpacked once, 0013 makes repacked
# Q4_K so, 0014 F16 and BF16, 0001 and 0008 to 0012 q4_0 and q8_0. Measured at the 1.5B shape in Q4_K_M
# (bench/bench_kquant_rows.py): a decode step of 1 row costs what llama.cpp's own choice costs, of 8 and 16 rows
# 0.82x and 0.90x, a prompt's chunk of 512 tokens 1.16x; the tiled kernels for every row count instead cost a lone
# row 1.71x.
ONE_KERNEL_PER_TYPE = {"GGML_CPU_TILED_MM": "0"}


def _meta(model, key: bytes) -> str:
    """A metadata string of a loaded model ("" when it has none)."""
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_model_meta_val_str(model, key, buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n > 0 else ""


@dataclass(frozen=True)
class LoadedModel:
    """What load_model made and chose; the engine frees `model` at its close."""

    path: Path  # the GGUF file loaded (the quantized copy, where the spec asks for one)
    model: object  # llama_model_p
    kernels: kernels.KernelChoice
    tiled_attention: bool  # every query row's attention tiled (TILED_ATTENTION_ENV)
    attention_why: str  # why it is not ("" where it is)
    arch: str
    sliding_window: bool  # sliding-window layers: a second KV cache, which the prefix cache's blocks do not carry
    state: StateShape  # how llama.cpp writes a sequence's state: its KV caches, their cells, a recurrent state
    whole_state: bool = False  # its KV records carry llama.cpp's whole state, not K and V rows (handoff.KVPort)


def load_model(spec: EngineSpec) -> LoadedModel:
    """Set the attention for this process, choose the kernels and load the model; RuntimeError when it cannot
    load or this engine cannot serve it."""
    flags = kernels.read_cpu_flags()
    # every row's attention tiled where asked for and cheap on this CPU (else llama.cpp's own attention: nothing
    # generated is kept and a resume is not exact); set before the first graph: llama.cpp reads it once per process
    # (a process's engines share one setting)
    tiled_attention = spec.tiled_attention and kernels.tiles_decode_cheaply(flags)
    attention_why = ("" if tiled_attention else kernels.why_not_tiled(flags) if spec.tiled_attention
                     else "tiled_attention = false in the config")
    if spec.tiled_attention and not tiled_attention:
        log.info("tiled_attention: %s; llama.cpp's own attention runs, so nothing generated is kept and a resumed "
                 "request may part from its undisturbed text at a near-tie", attention_why)
    os.environ[TILED_ATTENTION_ENV] = "1" if tiled_attention else "0"
    os.environ.update(ONE_KERNEL_PER_TYPE)
    llama_cpp.llama_backend_init()
    path = Path(spec.model_path)
    if spec.quantize:
        path = ensure_quantized(path, spec.quantize, Path(spec.cache_dir or path.parent))
    try:
        extra = kernels.extra_buffer_types()
    except (OSError, AttributeError) as exc:  # another llama-cpp-python layout: llama.cpp decides alone
        log.warning("could not list llama.cpp's CPU buffer types (%s)", exc)
        extra = None
    choice = kernels.choose(spec.repack, extra, flags)
    log.info("CPU kernels: %s (%s)", choice.kernels, choice.why)
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = choice.use_extra_bufts
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if model is None:
        raise RuntimeError(f"llama.cpp could not load {path}")
    arch = _meta(model, b"general.architecture") or "this model"
    # a recurrent state (hybrid and recurrent models), sliding-window layers (llama.cpp's iswa cache: gemma, gpt-oss),
    # MLA's compressed KV (deepseek2) or M-RoPE's cells are not K and V rows per head of one cache: the engine moves
    # such a sequence's whole state between its contexts, and its KV records carry that state (FLAG_LLAMA_STATE),
    # which only a llama.cpp engine of this model reads; the plan refuses other engines on the way at start
    state = shape_of(model)
    sliding_window = llama_cpp.llama_model_n_swa(model) > 0
    try:
        plain = kv_layout(path).plain
    except (GGUFError, OSError):
        plain = not (state.recurrent or sliding_window)
    return LoadedModel(path, model, choice, tiled_attention, attention_why, arch, sliding_window, state,
                       whole_state=not (plain and state.plain))


def add_row(b, token: int, pos: int, seq_id: int, logits: bool) -> int:
    """Append one token's row to llama_batch b; its row index (the engine's batches, the draft model's, the benches')."""
    i = b.n_tokens
    b.token[i] = token
    b.pos[i] = pos
    b.n_seq_id[i] = 1
    b.seq_id[i][0] = seq_id
    b.logits[i] = logits
    b.n_tokens = i + 1
    return i


def free_context(ctx, batch) -> None:
    """Free a llama context and its batch (the prompt context's, the decode batch's, the draft model's); None for
    either: never made, or freed already. The owner forgets both after."""
    if batch is not None:
        llama_cpp.llama_batch_free(batch)
    if ctx is not None:
        llama_cpp.llama_free(ctx)


def batch_params(spec: EngineSpec, seq_ctx: int, max_seqs: int, n_batch: int):
    """The batch context's parameters: max_seqs streams of seq_ctx cells, room for n_batch tokens per
    llama_decode."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = seq_ctx * max_seqs
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = max_seqs
    # One KV stream per slot, each of n_ctx cells. In a unified cache a finished sequence
    # leaves holes that the others' next tokens fill, so a sequence's cells stop being in
    # position order and the attention sums round differently than for the request alone
    # (measured: 9 of 16 staggered requests kept their alone-text unified, 16 of 16 split;
    # decode speed is the same once prompts run in their own context, below).
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = spec.threads
    cparams.no_perf = True
    # Flash attention walks a sequence's own cells in order; the plain path sums over all
    # cells of the batch, so neighbours change the rounding (measured: 16 prompts batched
    # 8 at a time kept 16/16 of their alone-text with it, 7/16 without).
    cparams.flash_attn_type = 1
    return cparams


def prompt_params(spec: EngineSpec, seq_ctx: int, chunk: int, flash_attn_type: int):
    """The prompt context's parameters: one sequence of seq_ctx cells, a chunk of tokens per llama_decode.

    Prompts run in a 1-sequence context of their own, one chunk per step, exactly as if the
    request were alone; the finished KV then moves into the sequence's stream of the batch
    context -- the same import a KV record from another engine takes in hetero mode. Mixed
    into the batch, a prompt would make llama.cpp split it into one ubatch per stream."""
    pparams = llama_cpp.llama_context_default_params()
    pparams.n_ctx = seq_ctx
    pparams.n_batch = pparams.n_ubatch = chunk
    pparams.n_seq_max = 1
    pparams.n_threads = pparams.n_threads_batch = spec.threads
    pparams.flash_attn_type = flash_attn_type
    pparams.no_perf = True
    return pparams
