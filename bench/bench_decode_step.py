"""What a decode step costs with every query row tiled, against llama.cpp's own attention (issue 20, item 2).

The prefix cache keeps what a request generates only when a decode step gives a token a prompt chunk's bits, and
for that mk/llama-patch.py's llama.cpp tiles every query row (SYSHAX_FA_TILED=1, read once per process). This times
a decode step both ways, in the engine's batch context (one KV stream per slot, flash attention, 8 slots): --seqs
sequences of --context tokens each decode one token a step, and the step's new position is taken back after it, so
that every step sees the same context. Two processes, one per setting, are up at once, and their rounds alternate
(this machine's speed drifts within minutes; both see the drift). Per round and setting: the median step of --steps.

Found on 2026-12-04 (AMD EPYC with AVX-512, 2 threads, SmolLM2-135M q4_0, repacking on), tiled / stock: before
mk/llama-patch.py's change 6, 1.05x at 1 x 128 tokens, 1.10x at 1 x 800 and 8 x 800 (the packed K and V tiles
were stored and loaded again for a tile of 3 rows); with it, 0.97x at 1 x 128 and 1 x 384, 0.91x at 1 x 800, 1.00x
at 8 x 128, 0.97x at 8 x 384, 0.92x at 8 x 800.

    .venv/bin/python bench/bench_decode_step.py [--seqs 1,8] [--context 128,384,800] [--rounds 4] [--repack on]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp")]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
CHUNK = 256
SLOTS = 8
ATTENTION_ENV = "SYSHAX_FA_TILED"  # what mk/llama-patch.py's llama.cpp reads (engine.TILED_ATTENTION_ENV)


def _add(b, token: int, pos: int, seq_id: int) -> None:
    i = b.n_tokens
    b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq_id, True
    b.n_tokens = i + 1


def serve(attention: str, repack: bool, threads: int, conn) -> None:
    """One setting's process: loads the model, then answers (seqs, context, steps) with the median step in ms."""
    os.environ[ATTENTION_ENV] = "1" if attention == "tiled" else "0"
    import llama_cpp as ll

    from syshax_llamacpp.codec import StateBuffer, export_seq, widen_streams

    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = ll.llama_model_load_from_file(str(MODEL).encode(), mparams)

    def context(n_seq: int, n_batch: int, n_ctx: int):
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx * n_seq, n_batch, n_batch, n_seq
        p.kv_unified = False
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type, p.no_perf = 1, True
        return ll.llama_init_from_model(model, p)

    pctx, bctx = context(1, CHUNK, 2048), context(SLOTS, SLOTS, 2048)
    pmem, bmem = ll.llama_get_memory(pctx), ll.llama_get_memory(bctx)
    pbatch, bbatch = ll.llama_batch_init(CHUNK, 0, 1), ll.llama_batch_init(SLOTS, 0, 1)
    scratch = StateBuffer()
    rng = np.random.default_rng(1)
    filled = (0, 0)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        seqs, n_context, steps = job
        if filled != (seqs, n_context):  # every stream gets one prompt's KV, as the engine moves it
            for s in range(SLOTS):
                ll.llama_memory_seq_rm(bmem, s, -1, -1)
            tokens = [int(t) for t in rng.integers(100, 40000, n_context)]
            for start in range(0, n_context, CHUNK):
                pbatch.n_tokens = 0
                for i, t in enumerate(tokens[start:start + CHUNK]):
                    _add(pbatch, t, start + i, 0)
                if ll.llama_decode(pctx, pbatch) != 0:
                    raise RuntimeError("llama_decode of a prompt chunk failed")
            size = ll.llama_state_seq_get_size(pctx, 0)
            buf = scratch.ensure(size + 4 * SLOTS)
            export_seq(pctx, 0, scratch)
            size = widen_streams(buf, size, SLOTS)
            for s in range(seqs):
                if ll.llama_state_seq_set_data(bctx, StateBuffer.pointer(buf), size, s) != size:
                    raise RuntimeError("could not move a prompt's KV into the batch context")
            ll.llama_memory_seq_rm(pmem, 0, -1, -1)
            filled = (seqs, n_context)
        times = []
        for step in range(steps):
            bbatch.n_tokens = 0
            for s in range(seqs):
                _add(bbatch, 1000 + step, n_context, s)
            started = time.perf_counter()
            if ll.llama_decode(bctx, bbatch) != 0:
                raise RuntimeError("llama_decode of a decode step failed")
            times.append(time.perf_counter() - started)
            for s in range(seqs):  # the next step sees the same context
                ll.llama_memory_seq_rm(bmem, s, n_context, -1)
        conn.send(1000 * statistics.median(times))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1,8", help="sequences decoding together, comma-separated (default: 1,8)")
    p.add_argument("--context", default="128,384,800", help="tokens of context each, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="steps timed per round (default: 40)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (default: 4)")
    p.add_argument("--repack", choices=("on", "off"), default="on")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if not all(1 <= s <= SLOTS for s in seqs) or not all(1 <= c < 2048 for c in contexts):
        p.error(f"--seqs: 1 to {SLOTS}; --context: 1 to 2047")
    spawn = multiprocessing.get_context("spawn")
    workers = {}
    for attention in ("stock", "tiled"):
        ours, theirs = spawn.Pipe()
        proc = spawn.Process(target=serve, args=(attention, args.repack == "on", args.threads, theirs), daemon=True)
        proc.start()
        workers[attention] = (proc, ours)
    for _, conn in workers.values():
        if conn.recv() != "ready":
            raise RuntimeError("a worker did not start")
    print(f"a decode step, ms (median of {args.steps} per round; repack {args.repack}, {args.threads} threads)")
    for n in seqs:
        for c in contexts:
            ms = {"stock": [], "tiled": []}
            for r in range(args.rounds):
                order = ("stock", "tiled") if r % 2 == 0 else ("tiled", "stock")
                for attention in order:
                    conn = workers[attention][1]
                    conn.send((n, c, 3))  # fills the streams, and warms up
                    conn.recv()
                    conn.send((n, c, args.steps))
                    ms[attention].append(conn.recv())
            stock, tiled = statistics.median(ms["stock"]), statistics.median(ms["tiled"])
            print(f"  {n} seq x {c} tokens: tiled {tiled:.2f} / stock {stock:.2f} = {tiled / stock:.3f}x  "
                  f"(rounds, tiled/stock: {', '.join(f'{t / s:.3f}' for t, s in zip(ms['tiled'], ms['stock']))})")
    for proc, conn in workers.values():
        conn.send(None)
        proc.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
