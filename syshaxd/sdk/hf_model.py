"""The PyTorch copy of the served model: an HF folder made once from the very q4_0 GGUF the CPU decoder loads.

Torch and vLLM engines read safetensors, llama.cpp reads the GGUF; a KV handoff between them
is only exact when both hold the same weights, so the folder is made from that GGUF itself
(transformers' GGUF loader dequantizes it) and never from another release of the model.
The folder records the GGUF's KV fingerprint, so a prefill engine stamps its records with
exactly what the decoder will expect, and a stale folder (the GGUF changed) is rebuilt.

`syshax model prepare --hf` makes the default model's folder ahead (the first prefill would otherwise).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from syshaxd.sdk.kv.record import ModelFingerprint

log = logging.getLogger(__name__)

MARKER = "syshax.json"  # written last: a folder without it is incomplete
SAVED_DTYPE = "bfloat16"


class HFModelError(RuntimeError):
    """The HF folder cannot be made or read; the message says what is missing."""


# the families whose HF copy hands a decoder llama.cpp's own KV, judged teacher-forced on a model of each
# (tests/plugins/test_families.py: top-1 agreement 90 to 96 %, mean KL at most 0.0015): their dense models only. A mixture of
# experts is refused: transformers rebuilds mixtral's experts wrongly from a GGUF (20 % agreement: garbage) and
# qwen3moe's not at all; sliding-window families (gemma) are refused by the plan before (engine/plan.py)
CODEC_FAMILIES = ("llama", "qwen2", "qwen3", "phi3")


def codec_refusal(gguf: Path) -> str | None:
    """Why a torch or vLLM engine cannot hand `gguf`'s prompts to the llama.cpp decoders (None: it can)."""
    from syshaxd.sdk.gguf.header import read_gguf_header

    meta = read_gguf_header(gguf)[0]
    arch = meta.get("general.architecture")
    if arch not in CODEC_FAMILIES:
        return (f"{Path(gguf).name} is a {arch} model; the KV handoff from a torch or vLLM engine is proven for "
                f"{', '.join(CODEC_FAMILIES)} models only: use the llama.cpp prefill engine "
                '(prefill_engine = "llamacpp"), which hands every family\'s KV on, or cpu mode')
    experts = meta.get(f"{arch}.expert_count") or 0
    if experts:
        return (f"{Path(gguf).name} is a mixture of {experts} experts ({arch}), which the HF copy made from a GGUF "
                'does not compute as llama.cpp does: use the llama.cpp prefill engine (prefill_engine = "llamacpp") '
                "or cpu mode")
    return None


def hf_folder_for(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the HF copy of `gguf` lives: beside it (or in cache_dir), named after it."""
    return Path(cache_dir or gguf.parent) / f"{gguf.stem}.hf"


def read_marker(folder: Path) -> dict:
    try:
        return json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        raise HFModelError(f"{folder} is not an HF folder made by syshax (no {MARKER}); "
                           "make it with `python -m syshaxd.sdk.hf_model GGUF`") from None


def folder_fingerprint(folder: Path) -> ModelFingerprint:
    """The KV fingerprint of the GGUF the folder was made from: what the decoder expects."""
    return ModelFingerprint.from_bytes(bytes.fromhex(read_marker(folder)["fingerprint"]))


def _is_current(folder: Path, fingerprint: ModelFingerprint) -> bool:
    try:
        return folder_fingerprint(folder) == fingerprint
    except (HFModelError, ValueError, KeyError):
        return False


def ensure_hf_folder(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The HF folder for `gguf`, made the first time (about half a minute here) and reused after."""
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf

    gguf = Path(gguf)
    if not gguf.is_file():
        raise HFModelError(f"{gguf} does not exist; the HF folder is made from the GGUF the decoder serves")
    refusal = codec_refusal(gguf)
    if refusal:
        raise HFModelError(refusal)
    fingerprint = fingerprint_from_gguf(gguf)
    folder = hf_folder_for(gguf, cache_dir)
    if _is_current(folder, fingerprint):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # several workers (or a test run and a worker) may start at once: one builds, the others wait
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(folder, fingerprint):
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            _build(gguf, tmp, fingerprint)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("made the HF folder %s from %s", folder, gguf.name)
    return folder


def _build(gguf: Path, out: Path, fingerprint: ModelFingerprint) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise HFModelError(f"making the HF folder needs torch, transformers, gguf and accelerate ({exc}); "
                           'pip install "syshax[torch]"') from None

    # dequantize=True: keep no GGUF blocks, so the state dict holds plain dense weights
    from transformers import GgufConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    config = loaded.config
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    # save_pretrained refuses a model loaded from GGUF: rebuild a plain one and move the weights over
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or {})
    if unexpected or [k for k in missing if k not in tied]:
        raise HFModelError(f"the GGUF's weights do not fit {type(plain).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    plain.to(getattr(torch, SAVED_DTYPE)).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    # vLLM refuses a folder whose config still names a quantization method
    config_path = out / "config.json"
    data = json.loads(config_path.read_text())
    data.pop("quantization_config", None)
    data["torch_dtype"] = data["dtype"] = SAVED_DTYPE
    config_path.write_text(json.dumps(data, indent=2) + "\n")
    (out / MARKER).write_text(json.dumps({
        "source": gguf.name, "source_bytes": gguf.stat().st_size, "fingerprint": fingerprint.to_bytes().hex(),
        "dtype": SAVED_DTYPE, "arch": fingerprint.arch, "rope_type": fingerprint.rope_type,
    }, indent=2) + "\n")
