"""The vLLM engine in a syshax worker: gpu mode (it generates) or prefill (its connector hands KV to the ring).

vLLM's v1 LLMEngine runs in this process with its engine core in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, uniproc executor): the worker loop's submit / step /
cancel map onto add_request / step / abort_request, and the KV connector's worker half
reports its records through a dict in the same process.

Prompts are tokenized with the GGUF's own vocabulary (llama.cpp) and given to vLLM as token
ids, and text comes out through the same SequenceOutput as the llama.cpp engine's: usage counts,
stop strings and end-of-generation behave as in cpu mode, and a record's token ids are the
decoder's own.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from syshaxd.sdk.gguf.quantize import resolve_gguf
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.rate import TokenRate
from syshaxd.sdk.types import (Accepted, Delta, EngineSpec, EngineStats, Fallback, GenerateRequest, Handling, KVHandle,
                                  Prefilled, Refusal, Rejected, TokenLogprob)

log = logging.getLogger(__name__)


def _prepare_environment(spec: EngineSpec) -> None:
    """vLLM reads these at import: set them before the first `import vllm`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here: the connector's outbox is shared
    if spec.threads and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG" if logging.getLogger().level <= logging.DEBUG else "WARNING"


@dataclass(eq=False)
class _Live:
    request: GenerateRequest
    prompt: list[int]
    out: SequenceOutput  # text, stop strings and finish reasons, as every engine decides them
    internal_id: str = ""
    handoff: bool = False  # the prompt alone, its KV into the ring (prefill role, or offloaded in auto mode)
    counted: bool = False  # its prompt's cached tokens are counted (at its first output)

    @property
    def n_generated(self) -> int:
        return self.out.n_generated


def _logprob(position, token: int, k: int) -> TokenLogprob:
    """vLLM's {token: Logprob(logprob, rank)} for one position: the chosen token and the k best, best first."""
    best = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k),
                  key=lambda item: item[1].rank)
    return TokenLogprob(int(token), float(position[token].logprob), tuple((int(t), float(lp.logprob))
                                                                           for t, lp in best[:k]))


class VllmEngine:
    def __init__(self, spec: EngineSpec) -> None:
        _prepare_environment(spec)
        from syshax_vllm.build import cpu_build

        from syshaxd.sdk.hf_model import ensure_hf_folder, folder_fingerprint

        if spec.role not in ("generate", "prefill"):
            raise ValueError(f"the vllm backend generates or prefills; role {spec.role!r} asked")
        gpu = spec.gpu
        if spec.ring and gpu.tensor_parallel_size != 1:
            raise ValueError("handing KV on with tensor_parallel_size > 1 would split the KV heads across ranks; "
                             "the ring connector takes one rank's cache: set tensor_parallel_size = 1")
        if gpu.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode {gpu.preemption_mode!r}: vLLM's v1 engine only recomputes")
        if spec.role == "prefill" and not spec.ring:
            raise ValueError("the vllm prefill engine needs a KV ring (hetero mode)")
        self.spec = spec
        self.on_cpu = cpu_build()
        self.gguf = resolve_gguf(spec)
        self.folder = ensure_hf_folder(self.gguf, Path(spec.cache_dir) if spec.cache_dir else None)
        self.fingerprint = folder_fingerprint(self.folder)
        self.vocab = Vocab(self.gguf)
        self.n_ctx = min(spec.n_ctx, self.vocab.n_ctx_train)
        self.max_seqs = gpu.max_num_seqs  # sequences it generates at once (the daemon's slots for it)
        # auto mode's GPU engine also runs the prompts of offloaded requests; room for as many again beside a
        # full batch, or such a prompt would wait in vLLM's queue for a whole generation to end
        self.handoff_room = self.max_seqs if spec.ring and spec.role == "generate" else 0
        self.held: deque[tuple[_Live, list[int], object]] = deque()  # generations waiting for one of max_seqs
        started = time.monotonic()
        self.llm = self._build(gpu)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._SamplingParams, self._TokensPrompt, self._DELTA = SamplingParams, TokensPrompt, RequestOutputKind.DELTA
        self._StructuredOutputsParams = StructuredOutputsParams
        if spec.ring:
            from syshax_vllm import connector

            self.outbox = connector.OUTBOX
            self._export_args = connector.EXPORT_PARAMS
        self.live: dict[str, _Live] = {}  # our request id -> request, while vLLM holds it
        self.by_internal: dict[str, str] = {}  # vLLM's request id -> ours
        # cached_tokens: prompt tokens vLLM's own prefix cache held (its num_cached_tokens), what prefix-aware
        # placement across a pool of these engines wins (engine/prefix_routing.py)
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished": 0, "cached_tokens": 0}
        self._rate = TokenRate()
        log.info("vLLM engine ready (%s, role %s): %s, n_ctx=%d, max_num_seqs=%d, in %.1fs",
                 "CPU build" if self.on_cpu else "CUDA", spec.role, self.folder.name, self.n_ctx, self.max_seqs,
                 time.monotonic() - started)

    def _build(self, gpu):
        from vllm import EngineArgs, LLMEngine

        kw = dict(model=str(self.folder), tokenizer=str(self.folder), max_model_len=self.n_ctx,
                  max_num_seqs=self.max_seqs + self.handoff_room, tensor_parallel_size=gpu.tensor_parallel_size, seed=0,
                  disable_log_stats=True,
                  # as the llama.cpp engine feeds prompts: at most prefill_chunk_size tokens of one per step
                  long_prefill_token_threshold=self.spec.prefill_chunk_size)
        if self.on_cpu:
            # float32: 5x faster than bf16 on CPUs without AMX (0.5 s against 2.7 s for ~100 tokens here).
            # KV space sized for max_num_seqs full contexts: gpu_memory_utilization would reserve that
            # fraction of the host's memory.
            per_token = self.fingerprint.n_layer * 2 * self.fingerprint.n_head_kv * self.fingerprint.head_dim * 4
            kw.update(dtype="float32", enforce_eager=True,
                      kv_cache_memory_bytes=per_token * ((self.max_seqs + self.handoff_room) * self.n_ctx + 1024))
        else:
            kw.update(dtype="bfloat16", gpu_memory_utilization=gpu.gpu_memory_utilization)
        if self.spec.ring:  # prefill role, or auto mode's GPU engine, which hands some prompts on
            from vllm.config import KVTransferConfig

            from syshax_vllm.connector import CONNECTOR_NAME

            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector=CONNECTOR_NAME, kv_connector_module_path="syshax_vllm.connector",
                kv_role="kv_producer" if self.spec.role == "prefill" else "kv_both",
                kv_connector_extra_config={"ring": self.spec.ring, "fingerprint": self.fingerprint.to_bytes().hex(),
                                           "handoff_timeout": self.spec.handoff_timeout})
        return LLMEngine.from_engine_args(EngineArgs(**kw))

    # --- Engine protocol ------------------------------------------------------------------

    def info(self) -> dict:
        return {"backend": self.spec.backend, "role": self.spec.role, "model_path": str(self.gguf),
                "hf_folder": str(self.folder), "model_name": self.spec.model_name, "n_ctx": self.n_ctx,
                "n_vocab": self.vocab.n_vocab, "max_batch_size": self.max_seqs,
                "device": "cpu" if self.on_cpu else "cuda", "chat_template": self.vocab.template.source}

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> list:
        handoff = self.spec.role == "prefill" or handling.handoff
        # a handed-on prompt's logprobs do not travel with vLLM's KV record: the plugin declares so, and the daemon
        # refuses (hetero) or keeps such a request on the CPU (auto)
        if request.grammar:  # checked here: vLLM raises on a grammar it cannot compile, in add_request
            try:
                import xgrammar

                xgrammar.Grammar.from_ebnf(request.grammar)
            except Exception as exc:  # noqa: BLE001  (xgrammar raises RuntimeError and others)
                return [Rejected(request.request_id, Refusal.INVALID, "vLLM's grammar engine (xgrammar) could not "
                                 f"compile the grammar built from '{request.grammar_field}' ({exc}); check a grammar's "
                                 "syntax, or simplify a schema.", "unsupported_schema", request.grammar_field)]
        fitted = fit_prompt(self.vocab, request, self.n_ctx)
        if isinstance(fitted, Rejected):
            return [fitted]
        prompt, max_tokens = fitted
        rid = request.request_id
        if handoff and not self.spec.ring:
            return [Rejected(rid, Refusal.FAILED, "this engine has no KV ring to hand the prompt on through",
                             "engine_error")]
        prompt += handling.resume_tokens  # a decode moved here continues after what it generated
        out = SequenceOutput.for_request(request, max_tokens, self.vocab.is_eog, self.vocab.piece_bytes,
                                         handling.resume_tokens)
        live = _Live(request, prompt, out, handoff=handoff)
        s = request.sampling
        params = self._SamplingParams(
            n=1, temperature=max(s.temperature, 0.0), top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            # generate: end-of-generation and stop strings are decided here, as the llama.cpp engine does
            max_tokens=1 if handoff else max_tokens, ignore_eos=True, detokenize=False,
            output_kind=self._DELTA, extra_args=dict(self._export_args) if handoff else None,
            # vLLM's default logprobs_mode is raw_logprobs: the model's distribution, as the llama.cpp engine's
            logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs,
            # the daemon's grammar (GBNF, which xgrammar reads); a handed-on prompt's one token obeys it too
            structured_outputs=self._StructuredOutputsParams(grammar=request.grammar) if request.grammar else None)
        self.live[rid] = live
        self.counters["prompt_tokens"] += len(prompt)
        if not handoff and (self.held or self._generating() >= self.max_seqs):
            self.held.append((live, prompt, params))  # FIFO behind the others waiting for a slot
        else:
            self._add(live, prompt, params)
        return [Accepted(rid, len(prompt), max_tokens)]

    def _add(self, live: _Live, prompt: list[int], params) -> None:
        live.internal_id = self.llm.add_request(live.request.request_id, self._TokensPrompt(prompt_token_ids=prompt),
                                                params)
        self.by_internal[live.internal_id] = live.request.request_id

    def _generating(self) -> int:
        return sum(1 for x in self.live.values() if x.internal_id and not x.handoff)

    def _release_held(self) -> None:
        while self.held and self._generating() < self.max_seqs:
            self._add(*self.held.popleft())

    def cancel(self, request_id: str) -> list:
        live = self.live.get(request_id)
        if live is None:
            return []
        self.held = deque(h for h in self.held if h[0] is not live)
        self._drop(live, abort=True)
        exported = self.outbox.pop(live.internal_id, None) if live.handoff else None
        if exported is not None and not exported.reason:
            # written before the request went: reported like any record, so the daemon's ledger frees it
            return [self._prefilled(live, exported, first_token=-1)]
        return []

    def has_work(self) -> bool:
        return self.llm.has_unfinished_requests() or bool(self.held)

    def step(self) -> list:
        self._release_held()
        outputs = self.llm.step()
        self.counters["steps"] += 1
        events: list = []
        for out in outputs:
            rid = self.by_internal.get(out.request_id, out.request_id)
            live = self.live.get(rid)
            if live is None:
                continue  # cancelled meanwhile
            if not live.counted:
                live.counted = True
                self.counters["cached_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
            if live.handoff:
                if out.finished:
                    events.append(self._hand_on(live, out))
            else:
                events += self._deltas(live, out)
        self._count(sum(isinstance(e, Delta) for e in events))
        return events

    def stats(self) -> EngineStats:
        scheduler = self._vllm_scheduler()
        if scheduler is not None:  # vLLM's own view: what auto mode's decider should see (the seed read it too)
            running, waiting = len(scheduler.running), len(scheduler.waiting) + len(self.held)
            kv_usage = float(scheduler.kv_cache_manager.usage)
        else:  # an estimate from what this engine holds
            n_live = len(self.live)
            running, waiting = min(n_live, self.max_seqs), max(0, n_live - self.max_seqs)
            kv_usage = sum(len(x.prompt) + x.n_generated for x in self.live.values()) / (self.n_ctx * self.max_seqs)
        return EngineStats(running=running, waiting=waiting, free_slots=max(0, self.max_seqs - self._generating()),
                           max_batch_size=self.max_seqs, n_ctx=self.n_ctx, kv_usage=kv_usage,
                           tokens_per_second=self._rate.per_second(), **self.counters)

    def _vllm_scheduler(self):
        """vLLM's scheduler, reachable because its engine core runs in this process; None if this vLLM hides it."""
        try:
            return self.llm.engine_core.engine_core.scheduler
        except AttributeError:
            return None

    def close(self) -> None:
        for live in list(self.live.values()):
            self._drop(live, abort=True)
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.engine_core.shutdown()
            except Exception:  # best effort: the worker process is going away
                pass
        self.vocab.close()

    # --- internals ------------------------------------------------------------------------

    def _deltas(self, live: _Live, out) -> list:
        rid = live.request.request_id
        deltas = []
        k = live.request.logprobs
        sampled = out.outputs[0].logprobs if out.outputs and k is not None else None
        prompt_lp = None
        if live.request.prompt_logprobs is not None and out.prompt_logprobs is not None:  # the first output's
            prompt_lp = tuple(None if d is None else _logprob(d, t, live.request.prompt_logprobs)
                              for d, t in zip(out.prompt_logprobs, live.prompt))
        for i, token in enumerate(out.outputs[0].token_ids if out.outputs else ()):
            text, finish = live.out.token(token)
            # the end-of-generation token that ends the text is not part of it: no logprob entry
            ended = finish == "stop" and self.vocab.is_eog(token) and not live.request.ignore_eos
            lp = (_logprob(sampled[i], token, k),) if sampled is not None and k is not None and not ended else ()
            deltas.append(Delta(rid, text, 1, finish, tokens=(int(token),), logprobs=lp,
                                prompt_logprobs=prompt_lp if i == 0 else None))
            if finish is not None:
                self._drop(live, abort=not out.finished)
                self.counters["finished"] += 1
                return deltas
        if out.finished:  # vLLM ended it (aborted or failed): say so rather than hang the client
            self._drop(live, abort=False)
            deltas.append(Delta(rid, live.out.flush(), 0, "error", f"vLLM finished the request early "
                                f"({out.outputs[0].finish_reason if out.outputs else 'no output'})"))
        return deltas

    def _hand_on(self, live: _Live, out) -> Prefilled:
        rid = live.request.request_id
        exported = self.outbox.pop(live.internal_id, None)
        self._drop(live, abort=False)
        self.counters["finished"] += 1
        tokens = out.outputs[0].token_ids if out.outputs else []
        if exported is None or exported.reason or not tokens:
            reason = (exported.reason if exported is not None else "") or Fallback.EXPORT_FAILED
            log.warning("%s: no KV record (%s); the decoder will recompute the prompt", rid, reason)
            return Prefilled(rid, None, reason)
        return self._prefilled(live, exported, int(tokens[0]))

    @staticmethod
    def _prefilled(live: _Live, exported, first_token: int) -> Prefilled:
        return Prefilled(live.request.request_id, KVHandle(exported.offset, exported.length, exported.seq,
                                                           exported.checksum, exported.n_tokens, first_token,
                                                           time.time()))

    def _drop(self, live: _Live, abort: bool) -> None:
        self.live.pop(live.request.request_id, None)
        self.by_internal.pop(live.internal_id, None)
        if abort and self.llm is not None and live.internal_id:
            self.llm.abort_request([live.internal_id], internal=True)

    def _count(self, n: int) -> None:
        self._rate.add(n)
        self.counters["generated_tokens"] += n
