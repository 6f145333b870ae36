"""What the engine's choice of one kernel per weight type costs on a user's K-quant or F16 file, against llama.cpp's
own choice, and whether each gives a row its bits whatever else shares its step.

llama.cpp picks a K-quant's kernel by the rows of a step: its tiled kernels from 8 rows, vec_dot below. The two sum a
row in other orders, so a token's logits and KV depend on how many rows shared its step, and the warm-up's proofs
fail (speculation off, a padding row beside a lone sequence, hetero not cpu mode's tokens). The engine takes vec_dot
for every row count (syshax_llamacpp.contexts.ONE_KERNEL_PER_TYPE); repacked Q4_K, F16 and BF16 are made exact by
mk/patches 0013 and 0014. Settings compared, each in a child process (llama.cpp reads them once per process):

  syshax     the engine's settings (ONE_KERNEL_PER_TYPE), with the installed wheel
  llama.cpp  llama.cpp's own choice (tiled from 8 rows), with the installed wheel
  tiled      the tiled kernels for every row count (GGML_CPU_TILED_MM_FORCE=1), the other way to one kernel

and, with --build NAME=DIR, another build's libggml-cpu under the engine's settings (a copy of the venv's llama_cpp
package with that build's library, as bench_step_rows.py describes: 0001 to 0012 alone measures 0013 and 0014).

Per setting: a decode step of 1, 2, 4, 8 and 16 sequences (one row each, after a prompt each), a prompt's chunk of
--chunk tokens (the median of --rounds), and the rows check of tests/plugins/test_llama_patch.py (16 sequences decoded in
batches of 16 down to 2 against each alone: rows whose logits differ). Tiled attention as the engine runs it.

    .venv/bin/python bench/bench_kquant_rows.py                         # the 1.5B shape in Q4_K_M (made once)
    .venv/bin/python bench/bench_kquant_rows.py --model F.gguf [--model G.gguf] [--build NAME=DIR]

Found on 2026-12-06 (AMD EPYC, AVX-512, 2 threads, the 1.5B shape in Q4_K_M: Q4_K repacked, Q6_K output and half
the ffn_down and attn_v), with patches 0001 to 0015; syshax against llama.cpp's own choice: a decode step of 1 row
56.2 against 57.3 ms, 2 rows 80.3 against 81.9, 4 rows 76.8 against 78.2, 8 rows 132.7 against 162.7, 16 rows 179.7
against 200.8; a 512-token chunk 5.21 against 4.50 s (1.16x: the Q6_K layers by vec_dot's arithmetic, not the tiled
kernels). Rows differing from their lone run: syshax 0 at every batch size, llama.cpp's own choice 16, 12, 11, 9 and
16 of 16 in batches of 16, 12, 11, 9 and 8 (the tiled kernels against vec_dot). Before 0015 (0001 to 0014): 8 rows
144.0 against 157.7 ms, 16 rows 199.3 against 181.3, the chunk 5.05 against 4.17 s; the tiled kernels for every row
count: 1 row 99.0 ms against 57.8 (1.71x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "plugins" / "llamacpp")]

from syshax_llamacpp.contexts import ONE_KERNEL_PER_TYPE  # noqa: E402

SETTINGS = {"syshax": ONE_KERNEL_PER_TYPE, "llama.cpp": {}, "tiled": {"GGML_CPU_TILED_MM_FORCE": "1"}}
STEP_ROWS = (1, 2, 4, 8, 16)

CHILD = r"""
import json, statistics, sys, time
import numpy as np
import llama_cpp as ll

path, chunk, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
S, PROMPT = 16, 64
ll.llama_backend_init()
mp = ll.llama_model_default_params()
mp.use_extra_bufts = True  # repacked weights, as the engine loads them (repack = "auto")
model = ll.llama_model_load_from_file(path.encode(), mp)
n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))


def context(n_seq, n_batch, n_ctx):
    p = ll.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = n_ctx * n_seq, n_batch, n_batch, n_seq, False
    p.n_threads = p.n_threads_batch = 2
    p.flash_attn_type, p.no_perf = 1, True
    return ll.llama_init_from_model(model, p)


batch = ll.llama_batch_init(max(chunk, 64), 0, 1)
rng = np.random.default_rng(3)


def add(token, pos, seq, logits=True):
    i = batch.n_tokens
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, pos, 1, seq, logits
    batch.n_tokens = i + 1


# a prompt's chunk, alone in its context (as the engine's prompt context runs it)
pctx = context(1, chunk, chunk + 8)
tokens = [int(t) for t in rng.integers(100, 30000, chunk)]
chunk_s = []
for _ in range(rounds):
    ll.llama_memory_seq_rm(ll.llama_get_memory(pctx), 0, -1, -1)
    batch.n_tokens = 0
    for i, t in enumerate(tokens):
        add(t, i, 0, i == chunk - 1)
    t0 = time.perf_counter()
    assert ll.llama_decode(pctx, batch) == 0
    chunk_s.append(time.perf_counter() - t0)
ll.llama_free(pctx)

# decode steps of k sequences, one row each, after a prompt of their own
ctx = context(S, 64, 256)
memory = ll.llama_get_memory(ctx)
for s in range(S):
    batch.n_tokens = 0
    for i, t in enumerate(rng.integers(100, 30000, PROMPT)):
        add(int(t), i, s, False)
    assert ll.llama_decode(ctx, batch) == 0
following = [int(t) for t in rng.integers(100, 30000, S)]


def step(first, rows):
    batch.n_tokens = 0
    for s in range(first, first + rows):
        add(following[s], PROMPT, s)
    t0 = time.perf_counter()
    assert ll.llama_decode(ctx, batch) == 0
    took = time.perf_counter() - t0
    out = [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, j), (n_vocab,)).copy() for j in range(rows)]
    for s in range(first, first + rows):
        ll.llama_memory_seq_rm(memory, s, PROMPT, -1)
    return took, out


steps = {}
for rows in %(step_rows)s:
    step(0, rows)  # a first step of this size: its compute buffers
    steps[rows] = statistics.median(step(0, rows)[0] for _ in range(5 * rounds))
alone = [step(s, 1)[1][0] for s in range(S)]
differing = {}
for rows in (16, 12, 11, 9, 8, 7, 6, 5, 4, 3, 2):
    n = 0
    for first in range(0, S, rows):
        _, out = step(first, min(rows, S - first))
        n += sum(int((o.view(np.uint32) != alone[first + j].view(np.uint32)).any()) for j, o in enumerate(out))
    differing[rows] = n
print(json.dumps({"chunk_ms": 1000 * statistics.median(chunk_s), "step_ms": {k: 1000 * v for k, v in steps.items()},
                  "differing": differing}))
""" % {"step_rows": STEP_ROWS}


def run(model: Path, env: dict, pythonpath: str | None, chunk: int, rounds: int) -> dict:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED")} | env
    child_env["SYSHAX_FA_TILED"] = "1"
    if pythonpath:
        child_env["PYTHONPATH"] = pythonpath + os.pathsep + child_env.get("PYTHONPATH", "")
    got = subprocess.run([sys.executable, "-c", CHILD, str(model), str(chunk), str(rounds)], capture_output=True,
                         text=True, env=child_env, timeout=3600)
    if got.returncode != 0:
        raise SystemExit(f"the child failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def default_model(out_dir: Path) -> Path:
    from families import make_shape_model

    return make_shape_model("qwen2-1.5b-shape", out_dir, quant="q4_k_m")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", action="append", type=Path, default=[],
                   help="a GGUF to measure (repeatable; default: the 1.5B shape in Q4_K_M, made once in --out-dir)")
    p.add_argument("--setting", action="append", choices=sorted(SETTINGS), default=[],
                   help="the kernel settings to compare (repeatable; default: all three)")
    p.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                   help="a llama_cpp package folder with another build's libggml-cpu, run with the engine's settings")
    p.add_argument("--chunk", type=int, default=512, help="a prompt chunk's tokens (default: 512)")
    p.add_argument("--rounds", type=int, default=3, help="chunks timed per setting; steps: 5x (default: 3)")
    p.add_argument("--out-dir", type=Path, default=REPO / "models" / "bench", help="where the default model is kept")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "bench_kquant_rows.json", help="the results")
    args = p.parse_args()
    models = args.model or [default_model(args.out_dir)]
    runs = [(name, SETTINGS[name], None) for name in (args.setting or list(SETTINGS))]
    for spec in args.build:
        name, _, folder = spec.partition("=")
        if not (Path(folder) / "llama_cpp").is_dir() and not re.search(r"llama_cpp/?$", folder):
            raise SystemExit(f"--build {spec}: {folder} is not a llama_cpp package folder (or its parent)")
        runs.append((name, ONE_KERNEL_PER_TYPE, str(Path(folder).parent if folder.rstrip("/").endswith("llama_cpp")
                                                      else folder)))
    results = []
    for model in models:
        print(f"\n{model.name}")
        print(f"{'setting':<12} {'chunk ms':>9} " + " ".join(f"{f'{k} row' + ('s' if k > 1 else ''):>9}" for k in STEP_ROWS)
              + "   rows differing (batches of 16 .. 2)")
        for name, env, pythonpath in runs:
            got = run(model, env, pythonpath, args.chunk, args.rounds)
            steps = " ".join(f"{got['step_ms'][str(k)]:>9.2f}" for k in STEP_ROWS)
            differing = " ".join(str(v) for v in got["differing"].values())
            print(f"{name:<12} {got['chunk_ms']:>9.1f} {steps}   {differing}", flush=True)
            results.append({"model": model.name, "setting": name, **got})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
