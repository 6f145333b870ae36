"""What a prompt chunk costs beside the decoding rows: in its own context after the decode step (syshaxd), or mixed
into the decode step's llama_decode (llama-server's update_slots) -- issue 20, item 3.

The llama.cpp engine in-process, on the default model. R sequences decode (each a 128-token prompt's KV in its own
stream), and one prompt chunk of C tokens runs:

* separate (what the engine does): one llama_decode of the R rows in the batch context, then one of the C tokens in
  the 1-sequence prompt context;
* mixed: one llama_decode of the R rows and the C tokens (in stream R) in a context like the batch context (one KV
  stream per slot, non-unified) but with room for R + C tokens per call.

Per (R, C): the median wall time of each, over --repeats, the ratio mixed / separate, and how many graphs (ubatches)
the mixed call ran: llama.cpp gives each stream's tokens a ubatch of their own when the streams' rows differ in
number, which is what the ratio pays for.

    .venv/bin/python bench/bench_mixed_step.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp")]
os.environ.setdefault("OMP_NUM_THREADS", "2")

import llama_cpp  # noqa: E402

from syshax_llamacpp.codec import StateBuffer, export_seq, widen_streams  # noqa: E402
from syshax_llamacpp.contexts import add_row  # noqa: E402
from syshax_llamacpp.engine import LlamaCppEngine, _graph_observer  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.sdk.types import EngineSpec  # noqa: E402

SLOTS = 8
PROMPT = 128


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    graphs = [0]
    engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(default_tokenizer_path()),
                                       model_name="m", n_ctx=2048, max_batch_size=SLOTS, threads=args.threads))
    engine.warm_up()
    chunks = (64, 128, 256)
    observer = _graph_observer(lambda: graphs.__setitem__(0, graphs[0] + 1))

    def twin(cb_eval=None):
        """The batch context's twin with room for a chunk beside the rows (a graph counter costs a Python call per
        graph node: it goes on a twin of its own, whose calls are not timed)."""
        cparams = engine.batch_params(SLOTS + max(chunks))
        if cb_eval is not None:
            cparams.cb_eval = cb_eval
        ctx = llama_cpp.llama_init_from_model(engine.model, cparams)
        return ctx, llama_cpp.llama_get_memory(ctx)

    mixed_ctx, mixed_memory = twin()
    count_ctx, count_memory = twin(observer)
    mixed_batch = llama_cpp.llama_batch_init(SLOTS + max(chunks), 0, 1)

    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    prompt = list(engine.vocab.tokenize(builder.build(PROMPT, 11).text, add_special=False))[:PROMPT]
    chunk_tokens = list(engine.vocab.tokenize(builder.build(max(chunks), 12).text, add_special=False))
    # the prompt's KV, once, into every stream of both decoding contexts
    b = engine.prompt.batch
    b.n_tokens = 0
    for pos, token in enumerate(prompt):
        add_row(b, token, pos, 0, pos == len(prompt) - 1)
    assert llama_cpp.llama_decode(engine.prompt.ctx, b) == 0
    state = StateBuffer()
    size = llama_cpp.llama_state_seq_get_size(engine.prompt.ctx, 0)
    buf = state.ensure(size + 4 * SLOTS)
    export_seq(engine.prompt.ctx, 0, state)
    llama_cpp.llama_memory_seq_rm(engine.prompt.memory, 0, -1, -1)
    size = widen_streams(buf, size, SLOTS)

    def load(ctx, streams) -> None:
        for s in streams:
            assert llama_cpp.llama_state_seq_set_data(ctx, StateBuffer.pointer(buf), size, s) == size

    def trim(memory, rows: int) -> None:
        for s in range(rows):
            llama_cpp.llama_memory_seq_rm(memory, s, PROMPT, -1)

    def timed(ctx, batch) -> float:
        started = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, batch) == 0
        return time.perf_counter() - started

    print(f"{PROMPT}-token prompts decoding, one chunk of C prompt tokens; median of {args.repeats}, "
          f"{args.threads} threads, repack {engine.kernels.kernels}\n")
    print("| R rows | C tokens | separate: decode + chunk ms | mixed ms | mixed / separate "
          "| graphs in the mixed call |")
    print("|---:|---:|---:|---:|---:|---:|")
    def fill_mixed(rows: int, c: int) -> None:
        mixed_batch.n_tokens = 0
        for s in range(rows):
            add_row(mixed_batch, prompt[s], PROMPT, s, True)
        for pos in range(c):
            add_row(mixed_batch, chunk_tokens[pos], pos, rows, pos == c - 1)

    for rows in (1, 4, 7):
        load(engine.decode.ctx, range(rows))
        load(mixed_ctx, range(rows))
        load(count_ctx, range(rows))
        for c in chunks:
            fill_mixed(rows, c)
            graphs[0] = 0
            assert llama_cpp.llama_decode(count_ctx, mixed_batch) == 0
            n_graphs = graphs[0]
            trim(count_memory, rows)
            llama_cpp.llama_memory_seq_rm(count_memory, rows, -1, -1)
            separate, mixed = [], []
            for _ in range(args.repeats):
                batch = engine.decode.batch
                batch.n_tokens = 0
                for s in range(rows):
                    add_row(batch, prompt[s], PROMPT, s, True)
                t = timed(engine.decode.ctx, batch)
                b.n_tokens = 0
                for pos in range(c):
                    add_row(b, chunk_tokens[pos], pos, 0, pos == c - 1)
                t += timed(engine.prompt.ctx, b)
                separate.append(t)
                trim(engine.decode.memory, rows)
                llama_cpp.llama_memory_seq_rm(engine.prompt.memory, 0, -1, -1)

                fill_mixed(rows, c)
                mixed.append(timed(mixed_ctx, mixed_batch))
                trim(mixed_memory, rows)
                llama_cpp.llama_memory_seq_rm(mixed_memory, rows, -1, -1)
            sep, mix = 1000 * statistics.median(separate), 1000 * statistics.median(mixed)
            print(f"| {rows} | {c} | {sep:.2f} | {mix:.2f} | {mix / sep:.2f} | {n_graphs} |")
        for s in range(rows):
            for memory in (engine.decode.memory, mixed_memory, count_memory):
                llama_cpp.llama_memory_seq_rm(memory, s, -1, -1)
    llama_cpp.llama_batch_free(mixed_batch)
    for ctx in (mixed_ctx, count_ctx):
        llama_cpp.llama_free(ctx)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
