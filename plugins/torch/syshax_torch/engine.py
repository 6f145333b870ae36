"""The transformers/torch prefill engine: runs a prompt on cuda, npu or cpu and writes its KV into the ring."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from syshaxd.sdk.types import (Accepted, EngineSpec, EngineStats, Fallback, GenerateRequest, Handling, KVHandle,
                                  Prefilled, Rejected, SamplingParams)
from syshaxd.sdk.gguf.quantize import resolve_gguf
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.kv.hf_codec import check_model, encode_tensors_into, hf_config_shape, past_key_values_layers
from syshaxd.sdk.kv.record import DType, record_size

log = logging.getLogger(__name__)

RECORD_DTYPE = DType.F16  # the llama.cpp decoder's KV cache type: its import copies rows as they are


def pick_device(kind: str) -> torch.device:
    """cuda when asked for "auto" and present, else cpu; "npu" needs torch_npu imported first."""
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers the npu device with torch)

        return torch.device("npu", 0)
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if kind == "cuda":
        raise RuntimeError("the torch backend was asked for cuda, and torch sees no CUDA device")
    return torch.device("cpu")


def sample_first(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The first completion token from the prompt's last logits, with the request's sampling."""
    if params.greedy:
        return int(torch.argmax(logits))
    # penalties need history; llama.cpp's sampler has none yet at the first token either
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, 0) - ordered < params.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, index[keep], ordered[keep])
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs.cpu() / probs.sum(), 1, generator=generator))


@dataclass(eq=False)
class _Prompt:
    request: GenerateRequest
    tokens: list[int]


class TorchPrefillEngine:
    """Prefill role: one prompt per step through a transformers model, its KV out as one ring record."""

    def __init__(self, spec: EngineSpec, device: str = "auto") -> None:
        from transformers import AutoModelForCausalLM

        from syshaxd.sdk.hf_model import ensure_hf_folder, folder_fingerprint

        if spec.role != "prefill":
            raise ValueError(f"the torch backend only prefills (role {spec.role!r} asked)")
        if not spec.ring:
            raise ValueError("the torch prefill engine needs a KV ring (hetero mode)")
        self.spec = spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = pick_device(device)
        # float32 on CPU: exact against the bf16 folder and faster than bf16 without AMX here
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.gguf = resolve_gguf(spec)
        self.folder = ensure_hf_folder(self.gguf, Path(spec.cache_dir) if spec.cache_dir else None)
        self.fingerprint = folder_fingerprint(self.folder)
        started = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=self.dtype)
        # transformers wraps Module.to with functools.wraps, which typeshed types as the unbound function
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        check_model(self.fingerprint, **hf_config_shape(self.model.config))
        self.vocab = Vocab(self.gguf)
        self.n_ctx = min(spec.n_ctx, self.vocab.n_ctx_train)
        from syshaxd.sdk.kv.ring import KVRing

        self.ring: KVRing | None = KVRing.attach(spec.ring)
        self._pinned = _pin_for_device(self.ring, self.device)
        self.waiting: deque[_Prompt] = deque()
        self.counters = {"prompt_tokens": 0, "finished": 0}
        log.info("torch prefill engine ready: %s on %s (%s), fingerprint %s/%d layers, loaded in %.1fs",
                 self.folder.name, self.device, str(self.dtype).removeprefix("torch."), self.fingerprint.arch,
                 self.fingerprint.n_layer, time.monotonic() - started)

    # --- Engine protocol ------------------------------------------------------------------

    def info(self) -> dict:
        return {"backend": self.spec.backend, "role": "prefill", "model_path": str(self.gguf),
                "hf_folder": str(self.folder), "model_name": self.spec.model_name, "n_ctx": self.n_ctx,
                "n_vocab": self.vocab.n_vocab, "max_batch_size": 1, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "threads": torch.get_num_threads()}

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> list:
        # no logprobs and no grammar here (its plugin declares none): the daemon refused such a request already
        fitted = fit_prompt(self.vocab, request, self.n_ctx)
        if isinstance(fitted, Rejected):
            return [fitted]
        prompt, max_tokens = fitted
        self.waiting.append(_Prompt(request, prompt))
        return [Accepted(request.request_id, len(prompt), max_tokens)]

    def cancel(self, request_id: str) -> list:
        for p in list(self.waiting):
            if p.request.request_id == request_id:
                self.waiting.remove(p)
        return []

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list:
        p = self.waiting.popleft()
        event = self._prefill(p)
        self.counters["prompt_tokens"] += len(p.tokens)
        self.counters["finished"] += 1
        return [event]

    def stats(self) -> EngineStats:
        return EngineStats(waiting=len(self.waiting), free_slots=1, max_batch_size=1, n_ctx=self.n_ctx,
                           **self.counters)

    def close(self) -> None:
        if self.ring is not None:
            _unpin(self._pinned)
            self.ring.close()
            self.ring = None
        self.vocab.close()

    # --- internals ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, object]:
        """The prompt's last-position logits and its past_key_values."""
        ids = torch.tensor([tokens], device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.past_key_values

    def _prefill(self, p: _Prompt) -> Prefilled:
        from syshaxd.sdk.kv.ring import RingError

        rid = p.request.request_id
        logits, past = self.forward(p.tokens)
        sampling = p.request.sampling
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        first = sample_first(logits, sampling, generator)
        try:
            handle = self.export(p.tokens, past, first)
        except RingError as exc:
            log.warning("%s: KV record not written (%s); the decoder will recompute the prompt", rid, exc)
            return Prefilled(rid, None, Fallback.of_export(exc))
        return Prefilled(rid, handle)

    def export(self, tokens: list[int], past, first_token: int, *, permute: bool = True) -> KVHandle:
        """Write past_key_values as one neutral record into the ring; RingFull when no room frees in time."""
        if self.ring is None:  # closed: nothing exports after close()
            raise RuntimeError("the torch engine was closed; it has no KV ring to export into")
        keys, values = past_key_values_layers(past)
        size = record_size(self.fingerprint, len(tokens), RECORD_DTYPE)
        res = self.ring.reserve(size, self.spec.handoff_timeout)
        try:
            _, checksum = encode_tensors_into(res.view, self.fingerprint, tokens, keys, values,
                                              dtype=RECORD_DTYPE, permute=permute)
        except BaseException:
            res.abort()
            raise
        offset = res.commit()
        return KVHandle(offset, size, res.seq, checksum, len(tokens), first_token, time.time())


def _pin_for_device(ring, device: torch.device):
    """On CUDA, page-lock the ring mapping so device -> record copies go at full DMA speed."""
    if device.type != "cuda":
        return None
    import ctypes

    import numpy as np

    view = np.frombuffer(ring._view, np.uint8)  # the whole mapped segment
    addr, size = view.ctypes.data, view.nbytes
    try:
        err = torch.cuda.cudart().cudaHostRegister(ctypes.c_void_p(addr).value, size, 0)
    except Exception as exc:  # not fatal: copies are pageable then, slower
        log.warning("could not pin the KV ring for CUDA copies (%s); copies stay pageable", exc)
        return None
    if int(err) != 0:
        log.warning("cudaHostRegister on the KV ring failed (%s); copies stay pageable", err)
        return None
    return addr


def _unpin(addr) -> None:
    if addr is not None:
        try:
            import ctypes

            torch.cuda.cudart().cudaHostUnregister(ctypes.c_void_p(addr).value)
        except Exception:
            pass
