"""syshax's vLLM KV connector: the forward pass that completes a prompt copies its paged KV into a ring record.

vLLM builds the connector twice from `kv_transfer_config` (kv_connector_module_path points
here): a scheduler half, which sees the blocks each request holds, and a worker half, which
sees the layers' paged caches during the forward pass.

* Scheduler half (`build_connector_meta`): for every request that asked for it (its sampling
  params carry ``extra_args={"kv_transfer_params": {"syshax_export": True}}``: every request of
  a prefill engine, only the offloaded ones of auto mode's generating engine) and whose last
  prompt token is computed in this step, name its token ids and *all* its block ids, the
  partial last block included (vLLM's example connector stores whole blocks only).
* Worker half (`save_kv_layer`, called after each attention layer): on the first layer,
  reserve the record in the ring; on every layer, gather that layer's K and V rows out of the
  blocks, convert them to the neutral layout (K re-interleaved for llama-family rope, f16)
  and write them straight into the reservation; `wait_for_save` seals and commits it.

The worker half reports each record in OUTBOX, which VllmEngine reads after the step. That
is a plain dict because syshax runs vLLM's engine core in-process (uniproc executor): both
halves and the engine share this module. With tensor parallelism the KV heads would be split
across ranks; the prefill role refuses tensor_parallel_size > 1.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from syshaxd.sdk.types import Fallback
from syshaxd.sdk.kv.hf_codec import LayoutError, fill_layer, gather_paged, paged_layout, slot_indices
from syshaxd.sdk.kv.record import DType, ModelFingerprint, layout_into, record_size, seal

log = logging.getLogger(__name__)

CONNECTOR_NAME = "SyshaxRingConnector"
EXPORT_PARAMS = {"kv_transfer_params": {"syshax_export": True}}  # SamplingParams.extra_args of a request to export
RECORD_DTYPE = DType.F16  # the llama.cpp decoder's KV cache type
_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Exported:
    """What the worker half did with one request's prompt: a committed record, or why not."""

    offset: int = -1
    length: int = 0
    seq: int = -1
    checksum: int = 0
    n_tokens: int = 0
    reason: Fallback | str = ""  # "" when written; else why not


OUTBOX: dict[str, Exported] = {}


@dataclass
class StoreRequest:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class SyshaxRingMetadata(KVConnectorMetadata):
    stores: list[StoreRequest] = field(default_factory=list)


@dataclass
class _Writer:
    """One record being filled during a forward pass."""

    store: StoreRequest
    reservation: Any
    record: Any
    slots: torch.Tensor
    layers_done: set = field(default_factory=set)


class SyshaxRingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self._prompts: dict[str, tuple[list[int], list[int]]] = {}  # scheduler: req_id -> (tokens, blocks)
        self._export: set[str] = set()  # scheduler: the requests whose prompt KV goes into the ring
        self.ring = None
        if role == KVConnectorRole.WORKER:
            from syshaxd.sdk.kv.ring import KVRing

            self.fingerprint = ModelFingerprint.from_bytes(bytes.fromhex(extra["fingerprint"]))
            self.timeout = float(extra.get("handoff_timeout", 2.0))
            self.ring = KVRing.attach(extra["ring"])
            self._writers: dict[str, _Writer] = {}
            self._layer_index: dict[str, int] = {}
            self._layout: dict[str, str] = {}

    # --- scheduler half ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if (request.kv_transfer_params or {}).get("syshax_export"):
            self._export.add(request.request_id)
        return 0, False  # a producer: it never loads KV from outside

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = SyshaxRingMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._export:
                continue  # a request this engine generates itself
            tokens = list(new.prompt_token_ids or [])
            self._prompts[new.req_id] = (tokens, list(new.block_ids[0]))
            self._maybe_store(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._prompts:
                continue  # its prompt was already handed on: now decoding (generate) or finishing
            tokens, blocks = self._prompts[req_id]
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                # a request resumed after preemption gets its whole block list anew
                blocks = list(new_blocks[0]) if req_id in cached.resumed_req_ids else blocks + list(new_blocks[0])
                self._prompts[req_id] = (tokens, blocks)
            self._maybe_store(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_store(self, meta: SyshaxRingMetadata, req_id: str, computed_after_step: int) -> None:
        tokens, blocks = self._prompts[req_id]
        if tokens and computed_after_step >= len(tokens):
            n_blocks = -(-len(tokens) // self.block_size)
            meta.stores.append(StoreRequest(req_id, tokens, blocks[:n_blocks]))
            del self._prompts[req_id]
            self._export.discard(req_id)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._prompts.pop(request.request_id, None)
        self._export.discard(request.request_id)
        return False, None  # the record was written during the forward pass: the blocks may go

    # --- worker half ------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SyshaxRingMetadata) or not meta.stores:
            return
        for store in meta.stores:
            if store.req_id in OUTBOX:
                continue  # already failed this step
            try:
                writer = self._writers.get(store.req_id) or self._open(store)
                layer = self._layer_of(layer_name)
                k, v = gather_paged(kv_layer, writer.slots, self._layout_of(layer_name))
                fill_layer(writer.record, layer, k, v)
                writer.layers_done.add(layer)
            except Exception as exc:  # never take the engine down: the decoder recomputes instead
                self._fail(store.req_id, exc)

    def wait_for_save(self) -> None:
        for req_id, w in list(self._writers.items()):
            del self._writers[req_id]
            if len(w.layers_done) != self.fingerprint.n_layer:
                w.reservation.abort()
                OUTBOX[req_id] = Exported(reason=Fallback.EXPORT_FAILED)
                log.warning("%s: %d of %d layers seen; record dropped", req_id, len(w.layers_done),
                            self.fingerprint.n_layer)
                continue
            checksum = seal(w.reservation.view)
            offset = w.reservation.commit()
            OUTBOX[req_id] = Exported(offset, w.reservation.length, w.reservation.seq, checksum,
                                      len(w.store.token_ids))

    def shutdown(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    # --- internals --------------------------------------------------------------------------

    def _open(self, store: StoreRequest) -> _Writer:
        from syshaxd.sdk.kv.ring import RingFull

        if self.ring is None:  # only the worker side, which attached the ring, stores; a store elsewhere is a bug
            raise RuntimeError("the KV connector was asked to store a prompt's KV, but its worker has no ring")
        n = len(store.token_ids)
        size = record_size(self.fingerprint, n, RECORD_DTYPE)
        try:
            res = self.ring.reserve(size, self.timeout)
        except RingFull:
            OUTBOX[store.req_id] = Exported(reason=Fallback.RING_FULL)
            raise
        record = layout_into(res.view, self.fingerprint, n, RECORD_DTYPE)
        record.tokens[:] = store.token_ids
        record.positions[:] = range(n)
        writer = _Writer(store, res, record, slot_indices(store.block_ids, self.block_size, n))
        self._writers[store.req_id] = writer
        return writer

    def _fail(self, req_id: str, exc: Exception) -> None:
        writer = self._writers.pop(req_id, None)
        if writer is not None:
            writer.reservation.abort()
        if req_id not in OUTBOX:
            OUTBOX[req_id] = Exported(reason=Fallback.EXPORT_FAILED)
            log.warning("%s: KV record not written (%s: %s)", req_id, type(exc).__name__, exc)

    def _layer_of(self, layer_name: str) -> int:
        index = self._layer_index.get(layer_name)
        if index is None:
            found = _LAYER_NUMBER.search(layer_name)
            if found is None:
                raise LayoutError(f"cannot tell the layer number of {layer_name!r}")
            index = self._layer_index[layer_name] = int(found.group(1))
        return index

    def _layout_of(self, layer_name: str) -> str:
        layout = self._layout.get(layer_name)
        if layout is None:
            from vllm.forward_context import get_forward_context

            layer = get_forward_context().no_compile_layers[layer_name]
            layout = self._layout[layer_name] = paged_layout(layer.attn_backend.get_name(), getattr(layer, "isa", None))
        return layout


__all__ = ["CONNECTOR_NAME", "EXPORT_PARAMS", "OUTBOX", "Exported", "SyshaxRingConnector"]
