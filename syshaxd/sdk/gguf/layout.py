"""What a model keeps per sequence beside one KV cache of full-attention layers, read from its GGUF header as
llama.cpp reads it: sliding-window layers (a second KV cache), a recurrent state (SSM, RWKV, delta-net, short
convolution) and MLA's compressed KV. The KV record carries the plain layout only; the plan (engine/plan.py)
refuses at start, by name, what the engines cannot carry, and the llama.cpp engine checks the loaded model again."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from syshaxd.sdk.gguf.header import GGUFError, read_gguf_header

# llama.cpp's llm_arch_is_recurrent and llm_arch_is_hybrid (src/llama-arch.cpp of the pinned 0.3.36): a state per
# sequence beside the KV cache, or instead of it
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen3next",
    "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})
# the metadata of a recurrent state (gguf-py's Keys.SSM, WKV, KDA, ShortConv, Attention.RECURRENT_LAYERS), for an
# architecture newer than the lists above
_STATE_KEYS = (".ssm.", ".wkv.", ".kda.", ".shortconv.", ".attention.recurrent_layers")
# a window llama.cpp takes when the file names none (src/models/gemma2.cpp: Gemma 2's 4096; llama4.cpp: chunks of
# 8192 unless the file says 0)
_WINDOW_DEFAULTS = {"gemma2": 4096, "llama4": 8192}
# a window in the file that llama.cpp does not use (phi3.cpp: "Phi SWA is currently disabled", as Phi-3-mini-4k's
# 2047; deepseek2ocr: its decoder runs full attention; deepseek4: its own compressed cache, whose window
# llama_model_n_swa reports as 0)
_WINDOW_IGNORED = frozenset({"phi3", "deepseek2ocr", "deepseek4"})


@dataclass(frozen=True)
class KVLayout:
    """A model's per-sequence state as llama.cpp keeps it."""

    arch: str  # general.architecture
    sliding_window: int  # tokens a sliding-window layer attends to (llama_model_n_swa); 0: no such layers
    recurrent: bool  # a recurrent state beside or instead of the KV cache (llama_model_is_recurrent / _is_hybrid)
    mla: bool  # multi-head latent attention: one compressed row per token and layer ({arch}.attention.kv_lora_rank)

    @property
    def plain(self) -> bool:
        """One KV cache of K and V rows per head for every layer: what the KV record carries."""
        return not (self.sliding_window or self.recurrent or self.mla)


def _number(value) -> int:
    """A metadata number, or the largest of a per-layer array's (0 when absent)."""
    if isinstance(value, list):
        return max((int(v) for v in value), default=0)
    return int(value or 0)


def layout_of(meta: dict) -> KVLayout:
    """The layout a GGUF's metadata gives (read_gguf_header's first part); GGUFError without an architecture."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError("no general.architecture in the GGUF metadata")
    window = 0
    if arch not in _WINDOW_IGNORED:
        # a per-layer pattern ({arch}.attention.sliding_window_pattern) says which layers slide; without a window
        # llama.cpp reads none of it, so the window decides
        window = _number(meta.get(f"{arch}.attention.sliding_window", _WINDOW_DEFAULTS.get(arch, 0)))
    prefix = f"{arch}."
    state_keys = any(key.startswith(prefix) and any(part in key[len(arch):] for part in _STATE_KEYS)
                     for key in meta)
    recurrent = arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS or state_keys
    mla = _number(meta.get(f"{arch}.attention.kv_lora_rank")) > 0
    return KVLayout(arch, max(window, 0), recurrent, mla)


def kv_layout(path: str | os.PathLike) -> KVLayout:
    """The layout of the GGUF at path; GGUFError (or OSError) when it cannot be read."""
    meta, _ = read_gguf_header(path)
    try:
        return layout_of(meta)
    except GGUFError as exc:
        raise GGUFError(f"{Path(path).name}: {exc}") from None
