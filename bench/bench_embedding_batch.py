"""Why the embedding engine runs one input a pass: 8 inputs in one llama.cpp pass against each alone, in one shared
KV cache and in a stream each, on an embedding GGUF (default: Qwen3-Embedding-0.6B's shape in Q8_0, made once into
models/bench): the time of the pass against the 8 alone, and how far each vector moved (its length 1, the largest
relative difference and the smallest cosine). Prints one line per cache layout.

    .venv/bin/python bench/bench_embedding_batch.py     # about 1 minute
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402


def measure(model, unified: bool, inputs: list[list[int]], threads: int) -> tuple[float, float, float, float]:
    cp = llama_cpp.llama_context_default_params()
    cp.n_seq_max = len(inputs)
    cp.n_ctx = cp.n_batch = 512 * len(inputs)
    cp.n_ubatch = 512 * len(inputs)  # the whole pass in one ubatch, as the engine takes a whole input
    cp.embeddings, cp.kv_unified, cp.flash_attn_type = True, unified, 1
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    n_embd = llama_cpp.llama_model_n_embd(model)
    batch = llama_cpp.llama_batch_init(cp.n_batch, 0, 1)

    def run(seqs: list[list[int]]) -> tuple[list[np.ndarray], float]:
        batch.n_tokens = 0
        for s, ids in enumerate(seqs):
            for pos, token in enumerate(ids):
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
                batch.seq_id[i][0] = s
                batch.n_tokens = i + 1
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        started = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, batch) == 0
        elapsed = time.perf_counter() - started
        return [np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_seq(ctx, s), shape=(n_embd,)).copy()
                for s in range(len(seqs))], elapsed

    run(inputs[:1])  # a first pass to warm the caches
    alone, alone_s = [], 0.0
    for ids in inputs:
        vectors, seconds = run([ids])
        alone.append(vectors[0])
        alone_s += seconds
    together, together_s = run(inputs)
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(a)) for a, b in zip(alone, together))
    cos = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(alone, together))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return alone_s, together_s, rel, cos


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an embedding GGUF (default: Qwen3-Embedding-0.6B's shape in Q8_0)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.model:
        path = Path(args.model)
    else:
        import families

        path = families.make_shape_model("qwen3-embedding-0.6b-shape", REPO / "models" / "bench", quant="q8_0")
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    rng = np.random.default_rng(0)  # 8 inputs of 40 to 160 tokens
    inputs = [list(map(int, rng.integers(100, 40000, size=int(n)))) for n in rng.integers(40, 160, size=8)]
    for unified, name in ((True, "one shared KV cache"), (False, "a KV stream each")):
        alone_s, together_s, rel, cos = measure(model, unified, inputs, args.threads)
        print(f"{name}: 8 alone {alone_s:.2f} s, together {together_s:.2f} s; a vector moved up to {rel:.2%} of its "
              f"length (cosine at least {cos:.5f})")
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
