"""Is a token's KV computed while decoding the same bits as the KV a prompt chunk computes for it? (issue 20)

llama-server keeps what a slot generated in its KV and reuses it when the client sends the answer back (a chat's
next turn). The prefix cache can keep generated tokens too, but only if a hit still gives the tokens a miss gives:
the miss evaluates the whole history as a prompt, in chunks of 256, so the generated tokens' KV, computed one row
a step in the batch context beside other sequences, must be the very bits those chunks compute.

This decodes a prompt's continuation in the engine's batch context (non-unified streams, flash attention), beside
other sequences, exports the sequence's KV, evaluates the prompt plus everything generated but the last token as
one prompt in the engine's prompt context (chunks of 256), and compares K and V of every position, and the next
token's logits, byte for byte, with repacked kernels on and off, and with each of the two ways the llama.cpp of
mk/llama-wheel.sh can take a decode step's attention (SYSHAX_FA_TILED, read once per process, so each runs in a
process of its own): "stock" (llama.cpp's own: prompt chunks of 64 tokens or more in tiles of 64 query rows, other
rows one at a time) and "tiled" (every query row in tiles, mk/patches/).

    .venv/bin/python bench/bench_decode_kv.py [--prompt 300] [--generate 120] [--beside 3]
    .venv/bin/python bench/bench_decode_kv.py --speed   # also: prompt tokens/s, and a decode step's time

Prints, per setting, how many positions hold identical K and V, the first that does not, and whether the next
token's logits are identical; with --speed, prompt tokens/s at 128 to 2000 tokens and a decode step of 8 sequences
at 800 tokens, tiled / stock (the two run one after the other: repeat it, this machine drifts by 10 % and more);
writes bench/results/bench_decode_kv.json.

Found on 2026-12-04 (AMD EPYC, AVX-512, 2 threads, SmolLM2-135M q4_0, --generate 60): stock, the positions of the
prompt's first whole chunk agree and every later one differs (a decoded token, and a prompt token in a chunk under
64 tokens, get other bits: logits up to 0.7 apart); tiled, all 360 positions and the logits agree, repacking on and
off. Speed, one run: a decode step 1.14x tiled (39.31 against 34.44 ms) with repacking on, 0.99x (38.48 against
38.79) with it off; prompts 0.98x to 1.09x with repacking off and 0.80x to 0.85x with it on, though prompt chunks of
64 tokens or more take the same code either way (the settings run one after the other: repeat it before reading a
prompt difference). Before mk/patches/'s 0003 and 0006 (K packed a scalar at a time, every head alone) a
decode step took about twice as long tiled.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "plugins" / "llamacpp"))
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
CHUNK = 256
SEQS = 8
SPEED_LENGTHS = (128, 256, 512, 1024, 2000)
DECODE_CONTEXT = 800
ATTENTION_ENV = "SYSHAX_FA_TILED"  # what mk/llama-wheel.sh's llama.cpp reads (contexts.TILED_ATTENTION_ENV)


def _add(b, token: int, pos: int, seq_id: int, logits: bool) -> None:
    i = b.n_tokens
    b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq_id, logits
    b.n_tokens = i + 1


def _prefill(ll, ctx, batch, tokens: list[int]) -> None:
    """tokens into sequence 0 of ctx from position 0, in chunks of CHUNK."""
    for start in range(0, len(tokens), CHUNK):
        batch.n_tokens = 0
        piece = tokens[start:start + CHUNK]
        for i, t in enumerate(piece):
            _add(batch, t, start + i, 0, start + i == len(tokens) - 1)
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode of a prompt chunk failed")


def load_model(ll, repack: bool):
    """The default model, its weights repacked or not (llama-server's --repack)."""
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    mparams.use_extra_bufts = repack
    return ll.llama_model_load_from_file(str(MODEL).encode(), mparams)


def context(ll, model, n_seq: int, n_batch: int, threads: int, n_ctx: int = 2048):
    """A context as the engine makes them: one KV stream of n_ctx cells per sequence, flash attention."""
    p = ll.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx * n_seq, n_batch, n_batch, n_seq
    p.kv_unified = False
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type, p.no_perf = 1, True
    return ll.llama_init_from_model(model, p)


def move_into_streams(ll, pctx, bctx, scratch, streams) -> None:
    """Sequence 0 of the 1-sequence prompt context into these streams of the batch context, as the engine moves a
    prompt's KV; the prompt context is left empty."""
    from syshax_llamacpp.codec import StateBuffer, export_seq, widen_streams

    size = ll.llama_state_seq_get_size(pctx, 0)
    buf = scratch.ensure(size + 4 * SEQS)
    export_seq(pctx, 0, scratch)
    size = widen_streams(buf, size, SEQS)
    for s in streams:
        if ll.llama_state_seq_set_data(bctx, StateBuffer.pointer(buf), size, s) != size:
            raise RuntimeError("could not move a prompt's KV into the batch context")
    ll.llama_memory_seq_rm(ll.llama_get_memory(pctx), 0, -1, -1)


def measure(attention: str, repack: bool, n_prompt: int, n_generate: int, beside: int, threads: int,
            speed: bool) -> dict:
    """In a process of its own, spawned with ATTENTION_ENV set for `attention` before llama.cpp's first graph."""
    import llama_cpp as ll
    from syshax_llamacpp.codec import StateBuffer, export_seq, parse_seq_state
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf

    model = load_model(ll, repack)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    fp = fingerprint_from_gguf(MODEL)
    pctx, bctx = context(ll, model, 1, CHUNK, threads), context(ll, model, SEQS, SEQS, threads)
    pmem, bmem = ll.llama_get_memory(pctx), ll.llama_get_memory(bctx)
    pbatch, bbatch = ll.llama_batch_init(CHUNK, 0, 1), ll.llama_batch_init(SEQS, 0, 1)
    scratch = StateBuffer()
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(100, 40000, n_prompt + 17 * s)] for s in range(1 + beside)]
    # each prompt runs alone in the prompt context, and its KV moves into a stream of the batch context, as the
    # engine does it
    nexts, lengths = [], []
    for s, prompt in enumerate(prompts):
        _prefill(ll, pctx, pbatch, prompt)
        nexts.append(int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(pctx, -1), (n_vocab,)))))
        move_into_streams(ll, pctx, bctx, scratch, [s])
        lengths.append(len(prompt))
    generated = [nexts[0]]
    for _ in range(n_generate):  # greedy, every sequence one row a step
        bbatch.n_tokens = 0
        for s in range(len(prompts)):
            _add(bbatch, nexts[s], lengths[s], s, True)
            lengths[s] += 1
        if ll.llama_decode(bctx, bbatch) != 0:
            raise RuntimeError("llama_decode of a decode step failed")
        nexts = [int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(bctx, s), (n_vocab,))))
                 for s in range(len(prompts))]
        generated.append(nexts[0])
    decoded_logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(bctx, 0), (n_vocab,)).copy()
    decoded = parse_seq_state(export_seq(bctx, 0, scratch).copy(), fp)
    # the same tokens as one prompt: the prompt and all it generated but the last token (never fed back)
    history = prompts[0] + generated[:-1]
    _prefill(ll, pctx, pbatch, history)
    prompted_logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(pctx, -1), (n_vocab,)).copy()
    prompted = parse_seq_state(export_seq(pctx, 0, scratch).copy(), fp)
    ll.llama_memory_seq_rm(pmem, 0, -1, -1)
    if not (np.array_equal(decoded.positions, prompted.positions) and len(decoded.positions) == len(history)):
        raise RuntimeError("the two runs hold other positions")
    same = np.ones(len(history), bool)
    for layer in range(fp.n_layer):
        for a, b in ((decoded.k[layer], prompted.k[layer]), (decoded.v[layer], prompted.v[layer])):
            same &= (a.reshape(len(history), -1).view(np.uint16) == b.reshape(len(history), -1).view(np.uint16)).all(1)
    differing = np.flatnonzero(~same)
    row = {"attention": attention, "repack": repack, "prompt": n_prompt, "generated": n_generate, "beside": beside,
           "positions": len(history), "identical": int(same.sum()),
           "first_differing": int(differing[0]) if len(differing) else None,
           "generated_identical": int(same[n_prompt:].sum()),
           "logits_identical": bool(np.array_equal(decoded_logits, prompted_logits)),
           "max_logit_diff": float(np.max(np.abs(decoded_logits - prompted_logits)))}
    if speed:  # prompt tokens a second in chunks of CHUNK, the median of 5 runs of each length
        row["prefill_tokens_per_s"] = {}
        for n in SPEED_LENGTHS:
            tokens = [int(t) for t in rng.integers(100, 40000, n)]
            times = []
            for _ in range(5):
                started = time.perf_counter()
                _prefill(ll, pctx, pbatch, tokens)
                times.append(time.perf_counter() - started)
                ll.llama_memory_seq_rm(pmem, 0, -1, -1)
            row["prefill_tokens_per_s"][n] = round(n / statistics.median(times), 1)
        # a decode step of SEQS sequences with DECODE_CONTEXT tokens each: the median of 20 steps
        for s in range(SEQS):
            ll.llama_memory_seq_rm(bmem, s, -1, -1)
        _prefill(ll, pctx, pbatch, [int(t) for t in rng.integers(100, 40000, DECODE_CONTEXT)])
        move_into_streams(ll, pctx, bctx, scratch, range(SEQS))
        times = []
        for step in range(20):
            bbatch.n_tokens = 0
            for s in range(SEQS):
                _add(bbatch, 1000 + step, DECODE_CONTEXT + step, s, True)
            started = time.perf_counter()
            if ll.llama_decode(bctx, bbatch) != 0:
                raise RuntimeError("llama_decode of a decode step failed")
            times.append(time.perf_counter() - started)
        row["decode_step_ms"] = round(1000 * statistics.median(times), 2)
    ll.llama_batch_free(pbatch)
    ll.llama_batch_free(bbatch)
    ll.llama_free(pctx)
    ll.llama_free(bctx)
    ll.llama_model_free(model)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens (default: 300)")
    p.add_argument("--generate", type=int, default=120, help="tokens decoded after it (default: 120)")
    p.add_argument("--beside", type=int, default=3, help="other sequences decoding in the same steps (default: 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed", action="store_true", help="also time prompts of 128 to 2000 tokens in chunks of 256, "
                   f"and a decode step of {SEQS} sequences at {DECODE_CONTEXT} tokens")
    args = p.parse_args()
    if not 0 <= args.beside < SEQS:
        p.error(f"--beside: 0 to {SEQS - 1}")
    rows = []
    for attention in ("stock", "tiled"):
        os.environ[ATTENTION_ENV] = "1" if attention == "tiled" else "0"  # the child inherits it
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            rows += pool.starmap(measure, [(attention, repack, args.prompt, args.generate, args.beside, args.threads,
                                            args.speed) for repack in (True, False)])
    for r in rows:
        print(f"{r['attention']}, repack {'on ' if r['repack'] else 'off'}: {r['positions']} positions ({r['prompt']} "
              f"prompt, {r['positions'] - r['prompt']} decoded beside {r['beside']}): K and V identical at "
              f"{r['identical']} (decoded ones: {r['generated_identical']}), first differing {r['first_differing']}; "
              f"next token's logits identical {r['logits_identical']} (largest difference {r['max_logit_diff']:.3g})")
    if args.speed:
        print(f"speed, tiled / stock (prompt tokens/s in chunks of {CHUNK}; a decode step of {SEQS} sequences at "
              f"{DECODE_CONTEXT} tokens, ms):")
        for repack in (True, False):
            stock, tiled = (next(r for r in rows if r["attention"] == a and r["repack"] == repack)
                            for a in ("stock", "tiled"))
            print(f"  repack {'on ' if repack else 'off'}: " + ", ".join(
                f"{n}: {tiled['prefill_tokens_per_s'][n]:.0f} / {stock['prefill_tokens_per_s'][n]:.0f} = "
                f"{tiled['prefill_tokens_per_s'][n] / stock['prefill_tokens_per_s'][n]:.2f}x" for n in SPEED_LENGTHS)
                  + f"; decode step {tiled['decode_step_ms']} / {stock['decode_step_ms']} ms = "
                  f"{tiled['decode_step_ms'] / stock['decode_step_ms']:.2f}x")
    out = REPO / "bench" / "results" / "bench_decode_kv.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
