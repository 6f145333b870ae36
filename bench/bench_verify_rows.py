"""Can speculative decoding keep greedy output exact on llama.cpp's CPU kernels? (issue 20, item 4)

n-gram / prompt-lookup speculation (llama-server's --spec-type ngram-*, vLLM's [ngram]) guesses the next k tokens
and checks them in one llama_decode of k + 1 rows of one sequence. Its output equals plain decoding only if each of
those rows gets the bits that row gets when it is decoded alone, one token per llama_decode.

This measures that, in-process on the default model, with the engine's context settings (one KV stream per slot,
flash attention): a prompt's KV in stream 0, then its next `--tokens` greedy tokens decoded one row at a time
(the reference: every row's logits); then, from the same prompt KV, the first k + 1 of those very tokens (a perfect
guess) in one llama_decode, for each k. Per k: how many of the k + 1 rows gave the reference's logits bit for bit,
the largest logit difference, whether every row's greedy token is still the reference's, and what the call
costs against one row's: a guess of k tokens pays only where the tokens it gets accepted per call outweigh that.

Found on 2026-12-04 (AMD EPYC with AVX-512, SmolLM2-135M q4_0, repacking on, this repo's llama.cpp build): every
row of a guess up to 39 tokens got the one-row bits (exact; bench_chunk_invariance.py puts the kernels' edge at 64
rows), but the call cost about as much as its rows one by one: 1.7x one row's time for 2 rows, 2.6x for 4,
4.2x for 8. So n-gram speculation can be token-exact here, and it pays only where most guesses are right (over
70 % of them at k = 1); drafting.py is that speculation (issue 38).

On 2026-12-05, every row tiled as the daemon runs it: 1.84x for 2 rows, 2.5x for 3, 3.1 to 3.3x for 8 with the
default model; with bench_real_shape.py's 1.5B-shape model (--model; 29 ms a row) 1.84x, 2.80x and 4.01x, the
same on 2 cores. --room: a step of 4 or 8 sequences takes as long with room for 9 rows of each (0.99x, 1.00x).
--every 8, the default model: 2 to 9 rows 1.67x, 2.11x, 2.42x, 3.12x, 3.46x, 3.85x, 3.15x, 3.88x -- no line: 8 rows
(two groups of four in one pass of the patched gemm) cost less than 7, so the warm-up times every count
(proofs._proves_guessed_rows; its log line prints them).

On 2026-12-06, with llama.cpp patches 0008 (the q4_0 gemv takes up to 4 rows a pass, and a batch under 12 rows
whole) and 0009 (the q8_0 output layer streams once for 2 to 16 rows), every row still with the one-row bits:
--every 12, the default model, 2 to 13 rows 1.26x 1.43x 1.65x 2.02x 2.23x 2.44x 2.69x 3.13x 3.39x 3.63x 4.04x
4.41x; with 0008's groups of 8 rows (AVX-512) the same within this machine's noise (1.31x 1.53x 1.75x 1.96x 2.21x
2.48x 2.76x 3.21x 3.45x 3.72x 4.16x 4.56x; a step of 7 and 8 rows alone 5 % cheaper); the 1.5B shape (--every 8 --tokens 12; 27.7 ms a row) 2 to 9 rows 1.48x 1.89x 2.31x 3.03x 3.37x 3.87x
4.11x 4.96x. Where the time went, by `perf record` of a step of 2 rows before them: a third in the q8_0 output
layer (tinyBLAS's 4-row tiles), a third in the q4_0 gemv (one row a call).
After them, by `perf record` of a step of 8 rows: 40 % in the gemv, which made the weights' signs for every row's
every product. Patches 0010 to 0012 take the weights unsigned and each block's offset back once: --every 12, three
runs, the median per count, 2 to 9 rows 1.29x 1.24x 1.59x 1.76x 1.97x 2.07x 2.30x 2.70x (the lone row 3 % cheaper
too, so the ratios gain less than the milliseconds: bench_step_rows.py).

    .venv/bin/python bench/bench_verify_rows.py [--prompt 200] [--tokens 24] [--model GGUF] [--room] [--every 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp")]
os.environ.setdefault("OMP_NUM_THREADS", "2")

import llama_cpp  # noqa: E402

from syshax_llamacpp.contexts import add_row  # noqa: E402
from syshax_llamacpp.engine import LlamaCppEngine  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.sdk.types import EngineSpec  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens (default: 200)")
    p.add_argument("--tokens", type=int, default=24, help="greedy tokens decoded one at a time (default: 24)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, help="a q4_0 GGUF (default: the prepared default model; bench_real_shape.py "
                   "makes one of a 1.5B shape under models/bench/)")
    p.add_argument("--every", type=int, metavar="K", help="time every guess length from 1 to K (default: 1, 2, 3, "
                   "4, 7, 15 and --tokens - 1): where the kernels change from one row at a time to four")
    p.add_argument("--room", action="store_true", help="also: a step of 4 and of 8 sequences in the engine's batch "
                   "context against a twin with room for 9 rows of each (what room for every sequence's guesses costs)")
    args = p.parse_args()
    # every query row tiled, as the daemon's workers run (tiled_attention = true)
    engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_name="m", n_ctx=2048,
                                       model_path=str(args.model or default_tokenizer_path()), max_batch_size=8,
                                       threads=args.threads, tiled_attention=True))
    engine.warm_up()
    n_vocab = engine.n_vocab
    # the batch context's twin with room for a whole guess in one call
    cparams = engine.batch_params(max(64, args.tokens + 1))
    ctx = llama_cpp.llama_init_from_model(engine.model, cparams)
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(cparams.n_batch, 0, 1)

    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    prompt = list(engine.vocab.tokenize(builder.build(args.prompt, 21).text, add_special=False))
    n = len(prompt)

    def decode(rows: list[tuple[int, int, bool]]) -> float:
        batch.n_tokens = 0
        for token, pos, logits in rows:
            add_row(batch, token, pos, 0, logits)
        started = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, batch) == 0
        return time.perf_counter() - started

    def logits(i: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,)).copy()

    def load_prompt() -> np.ndarray:
        llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
        for start in range(0, n, 64):  # chunks of 64: the prompt's KV the same every time
            batch.n_tokens = 0
            for pos in range(start, min(start + 64, n)):
                add_row(batch, prompt[pos], pos, 0, pos == n - 1)
            assert llama_cpp.llama_decode(ctx, batch) == 0
        return logits(batch.n_tokens - 1)

    first = int(np.argmax(load_prompt()))
    tokens, reference, one_row = [first], [], []
    for j in range(args.tokens):  # one row per llama_decode: plain greedy decoding
        one_row.append(decode([(tokens[j], n + j, True)]))
        reference.append(logits(0))
        tokens.append(int(np.argmax(reference[-1])))
    print(f"{n}-token prompt, {args.tokens} greedy tokens; the first k + 1 of them checked in one llama_decode "
          f"(a perfect guess of k tokens), against one row per call ({1000 * statistics.median(one_row):.2f} ms "
          f"each, median):\n")
    print("| k | rows with the same bits | largest logit difference | greedy tokens unchanged | the call's time / one "
          "row's (median of 5) |")
    print("|---:|---:|---:|---|---:|")
    for k in range(1, args.every + 1) if args.every else (1, 2, 3, 4, 7, 15, args.tokens - 1):
        if k >= args.tokens:
            continue
        times = []
        for _ in range(5):
            load_prompt()
            times.append(decode([(tokens[j], n + j, True) for j in range(k + 1)]))
        got = [logits(j) for j in range(k + 1)]
        same = sum(np.array_equal(g, r) for g, r in zip(got, reference))
        diff = max(float(np.max(np.abs(g - r))) for g, r in zip(got, reference))
        kept = all(int(np.argmax(g)) == tokens[j + 1] for j, g in enumerate(got))
        cost = statistics.median(times) / statistics.median(one_row)
        print(f"| {k} | {same} of {k + 1} | {diff:.3g} | {'yes' if kept else 'no'} | {cost:.2f}x |")
    if args.room:
        room(engine, prompt, cparams)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    engine.close()
    return 0


def room(engine: LlamaCppEngine, prompt: list[int], cparams) -> None:
    """The median time of a decode step of 4 and of 8 sequences (one row each, after the prompt), in the engine's
    batch context (room for its 8 sequences' rows) and in a twin with room for 9 rows of each, alternating."""
    decode = engine.decode
    rooms = {f"engine's ({decode.n_batch} rows)": (decode.ctx, decode.memory, decode.batch, decode.n_batch)}
    twin = engine.batch_params(engine.max_seqs * 9)
    twin_ctx = llama_cpp.llama_init_from_model(engine.model, twin)
    rooms[f"twin ({twin.n_batch} rows)"] = (twin_ctx, llama_cpp.llama_get_memory(twin_ctx),
                                            llama_cpp.llama_batch_init(twin.n_batch, 0, 1), twin.n_batch)
    n = len(prompt)
    for ctx, memory, batch, chunk in rooms.values():  # the prompt's KV in every stream
        for s in range(engine.max_seqs):
            for start in range(0, n, chunk):
                batch.n_tokens = 0
                for pos in range(start, min(start + chunk, n)):
                    add_row(batch, prompt[pos], pos, s, False)
                assert llama_cpp.llama_decode(ctx, batch) == 0
    print("\n| sequences | " + " | ".join(f"step, {name}" for name in rooms) + " | ratio |")
    print("|---:|" + "---:|" * (len(rooms) + 1))
    for seqs in (4, 8):
        times: dict[str, list[float]] = {name: [] for name in rooms}
        for _ in range(40):
            for name, (ctx, memory, batch, _) in rooms.items():
                batch.n_tokens = 0
                for s in range(seqs):
                    add_row(batch, prompt[s], n, s, True)
                started = time.perf_counter()
                assert llama_cpp.llama_decode(ctx, batch) == 0
                times[name].append(time.perf_counter() - started)
                for s in range(seqs):
                    llama_cpp.llama_memory_seq_rm(memory, s, n, -1)
        medians = [statistics.median(t) for t in times.values()]
        print(f"| {seqs} | " + " | ".join(f"{1000 * m:.2f} ms" for m in medians) + f" | {medians[1] / medians[0]:.2f}x |")
    ctx, _, batch, _ = rooms[f"twin ({twin.n_batch} rows)"]
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)


if __name__ == "__main__":
    sys.exit(main())
