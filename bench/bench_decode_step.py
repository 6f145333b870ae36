"""What a decode step costs with every query row tiled, against llama.cpp's own attention (issue 20, item 2).

The prefix cache keeps what a request generates only when a decode step gives a token a prompt chunk's bits, and
for that mk/patches/'s llama.cpp tiles every query row (SYSHAX_FA_TILED=1, read once per process). This times
a decode step both ways, in the engine's batch context (one KV stream per slot, flash attention, 8 slots): --seqs
sequences of --context tokens each decode one token a step, and the step's new position is taken back after it, so
that every step sees the same context. Two processes, one per setting, are up at once, and their rounds alternate
(this machine's speed drifts within minutes; both see the drift). Per round and setting: the median step of --steps.

Found on 2026-12-04 (AMD EPYC with AVX-512, 2 threads, SmolLM2-135M q4_0, repacking on), tiled / stock: before
mk/patches/0007 (a few rows' products from the halves), 1.05x at 1 x 128 tokens, 1.10x at 1 x 800 and 8 x 800 (the packed K and V tiles
were stored and loaded again for a tile of 3 rows); with it, in two runs of the command below, 0.97x and 1.00x at
1 x 128, 0.97x at 1 x 384, 0.90x to 0.91x at 1 x 800, 1.00x and 1.02x at 8 x 128, 0.97x at 8 x 384, 0.92x at 8 x 800.
On 2026-12-05, with the transposes inlined (and mk/patches/0001, which both settings share): 0.97x at 1 x 128,
0.95x at 1 x 384, 0.86x at 1 x 800, 0.99x at 8 x 128, 0.93x at 8 x 384, 0.85x at 8 x 800; a step of 8 x 128 took
19.8 ms tiled, where it took 21.2 to 21.4 before.

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
sys.path[:0] = [str(REPO / "bench"), str(REPO), str(REPO / "plugins" / "llamacpp")]

# the in-process engine's settings and helpers, shared with the bench that checks these bits
from bench_decode_kv import ATTENTION_ENV, CHUNK, SEQS as SLOTS, _add, _prefill, context, load_model, \
    move_into_streams  # noqa: E402


def serve(attention: str, repack: bool, threads: int, conn) -> None:
    """One setting's process: loads the model, then answers (seqs, context, steps) with the median step in ms."""
    os.environ[ATTENTION_ENV] = "1" if attention == "tiled" else "0"
    import llama_cpp as ll

    from syshax_llamacpp.codec import StateBuffer

    model = load_model(ll, repack)
    pctx, bctx = context(ll, model, 1, CHUNK, threads), context(ll, model, SLOTS, SLOTS, threads)
    bmem = ll.llama_get_memory(bctx)
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
            _prefill(ll, pctx, pbatch, [int(t) for t in rng.integers(100, 40000, n_context)])
            move_into_streams(ll, pctx, bctx, scratch, range(seqs))
            filled = (seqs, n_context)
        times = []
        for step in range(steps):
            bbatch.n_tokens = 0
            for s in range(seqs):
                _add(bbatch, 1000 + step, n_context, s, True)
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
