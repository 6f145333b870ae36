"""Does llama.cpp give the same bits for a prompt however it was cut into chunks? (issue 20, item 1)

A prefix cache hit must return exactly the tokens a miss returns. With blocks of prefill_chunk_size (256) tokens
a prompt resumed after its cached blocks runs the very chunks it would have run from the start. A finer block
(vLLM's 16 tokens, what the prefix cache keeps on the strength of this measurement and each worker's warm-up proof,
plugins/llamacpp/syshax_llamacpp/prefix.py) lets a shorter shared prefix hit, but then a prompt resumes mid-chunk:
its KV for the first h tokens came from another prompt's run (that prompt's first chunk held other tokens after
them), and its own chunks start at h, not at multiples of 256. This measures whether that changes any bit.

For each h = 16·k below the prompt's length: run a different prompt that shares the first h tokens (its first
chunk of 256), keep the KV of those h tokens, run our prompt from h in chunks of 256 ("free"), or in a first chunk
up to the next multiple of 256 and plain chunks after it ("aligned"), and compare the last token's
logits and the sequence's whole KV state, byte for byte, with the plain run (chunks at 0, 256, 512, ...). With the
engine's context settings (flash attention, n_batch = n_ubatch = the chunk, one thread), repacked kernels on and off.

    .venv/bin/python bench/bench_chunk_invariance.py [--tokens 700] [--step 16]

Prints, per kernel setting, how many offsets gave identical logits and KV, and the largest logit difference;
writes bench/results/bench_chunk_invariance.json.

Found on 2026-12-04 (llama.cpp of llama-cpp-python 0.3.36, AMD EPYC with AVX-512, SmolLM2-135M q4_0, repacking on
and off alike): every token computed in a chunk of 64 tokens or more gets the same bits whatever the chunk's start
and size; a chunk of 63 or fewer gives other bits (logits up to ~1.2 apart, another greedy token). So a hit at any
16-token boundary h is exact when the chunk it resumes with (aligned: up to the next multiple of 256, or the end of
the prompt) holds at least 64 tokens, and the miss path's own chunk there does too; `--offsets 630-646` shows the
edge (a last chunk of 64 tokens matches, 63 does not). Other CPUs and kernels may put the edge elsewhere: a worker
that relies on it should prove it at warm-up, as it proves its kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
CHUNK = 256


class Context:
    """One sequence's context, set up as the llama.cpp engine sets up its prompt context."""

    def __init__(self, llama_cpp, model, n_ctx: int) -> None:
        self.ll = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = CHUNK
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = 1
        params.flash_attn_type = 1
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(CHUNK, 0, 1)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.memory, True)

    def keep(self, n: int) -> None:
        """Drop every cell from position n on."""
        self.ll.llama_memory_seq_rm(self.memory, 0, n, -1)

    def run(self, tokens, start: int, aligned: bool = False) -> np.ndarray:
        """Decode tokens[start:] in chunks of CHUNK starting at start (aligned: the first chunk ends at the next
        multiple of CHUNK, so every later chunk is one of the plain run's); the last token's logits."""
        pos = start
        while pos < len(tokens):
            end = (pos // CHUNK + 1) * CHUNK if aligned else pos + CHUNK
            piece = tokens[pos:end]
            b = self.batch
            b.n_tokens = len(piece)
            for i, t in enumerate(piece):
                b.token[i] = t
                b.pos[i] = pos + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = i == len(piece) - 1
            if self.ll.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            pos += len(piece)
        ptr = self.ll.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def state(self) -> bytes:
        size = self.ll.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = self.ll.llama_state_seq_get_data(self.ctx, buf, size, 0)
        return bytes(buf[:n])


def measure(repack: bool, n_tokens: int, step: int, aligned: bool, offsets: list[int] | None = None) -> dict:
    import llama_cpp

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(str(MODEL).encode(), mparams)
    ctx = Context(llama_cpp, model, 2048)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, 40000, n_tokens)]
    other = [int(t) for t in rng.integers(100, 40000, n_tokens)]
    ctx.clear()
    plain_logits = ctx.run(tokens, 0)
    plain_state = ctx.state()
    rows = []
    for h in offsets or range(step, n_tokens, step):
        if h % CHUNK == 0:
            continue  # a whole-chunk boundary: today's blocks, identical by construction
        ctx.clear()
        ctx.run(tokens[:h] + other[h:h + CHUNK], 0)  # another prompt sharing the first h tokens: its first chunks
        ctx.keep(h)
        logits = ctx.run(tokens, h, aligned)
        state = ctx.state()
        rows.append({"h": h, "logits_equal": bool(np.array_equal(logits, plain_logits)),
                     "max_logit_diff": float(np.max(np.abs(logits - plain_logits))),
                     "argmax_equal": int(np.argmax(logits)) == int(np.argmax(plain_logits)),
                     "kv_equal": state == plain_state})
    llama_cpp.llama_free(ctx.ctx)
    llama_cpp.llama_model_free(model)
    return {"repack": repack, "aligned": aligned, "tokens": n_tokens, "offsets": len(rows),
            "logits_identical": sum(r["logits_equal"] for r in rows),
            "kv_identical": sum(r["kv_equal"] for r in rows),
            "argmax_identical": sum(r["argmax_equal"] for r in rows),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=700)
    p.add_argument("--step", type=int, default=16)
    p.add_argument("--schedules", default="free,aligned",
                   help="free: the hit runs chunks of 256 from h; aligned: its first chunk ends at the next multiple "
                   "of 256 (default: both)")
    p.add_argument("--offsets", help="h values to try instead of every --step, e.g. 628-644 (the last chunk's size "
                   "is then tokens - h)")
    args = p.parse_args()
    offsets = None
    if args.offsets:
        low, _, high = args.offsets.partition("-")
        offsets = list(range(int(low), int(high or low) + 1))
    results = [measure(repack, args.tokens, args.step, schedule == "aligned", offsets)
               for schedule in args.schedules.split(",") for repack in (True, False)]
    for r in results:
        print(f"{'aligned' if r['aligned'] else 'free'} chunks, repack {'on ' if r['repack'] else 'off'}: {r['tokens']}-token prompt, {r['offsets']} offsets h=16k: "
              f"logits identical {r['logits_identical']}, KV identical {r['kv_identical']}, argmax identical "
              f"{r['argmax_identical']}; largest logit difference {r['max_logit_diff']:.3g}")
        differing = [row["h"] for row in r["rows"] if not (row["logits_equal"] and row["kv_equal"])]
        if differing:
            print(f"    differing at h = {differing[:20]}{' ...' if len(differing) > 20 else ''}")
    out = REPO / "bench" / "results" / "bench_chunk_invariance.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
