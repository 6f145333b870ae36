"""What one sequence's step of k rows costs, in milliseconds, on the installed llama.cpp and on other builds of it,
alternating (llama.cpp patches 0008 to 0012: their commit messages' figures, and the closing notes' AVX2 ones); or
a prompt's chunk of k rows (--chunk).

bench_verify_rows.py gives a step's cost relative to one row's within one build; this compares builds. Each build
is a llama_cpp package folder (its lib/ holding the libggml-cpu.so under test), put first on PYTHONPATH of a child
process, since a process loads one libggml-cpu. Per row count and build: the median of --steps steps of k rows of
one sequence after a 200-token prompt (the rows' KV taken back after each), the engine's context settings (tiled
attention, repacking); the least of --rounds such medians, the builds alternating round by round.

To make a build: a copy of the sdist's vendor/llama.cpp with the series applied up to the patch under test
(mk/llama-patches.sh TREE DIR, DIR holding those patches), then
    cmake -S TREE -B TREE/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \\
          -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" && cmake --build TREE/build --target ggml-cpu
(NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16", as mk/llama-wheel.sh; for AVX2 alone: -DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF); then a copy of the venv's site-packages/llama_cpp
with TREE/build/bin/libggml-cpu.so.0.25.3 copied over its lib/libggml-cpu.so*: that copy's folder is the DIR.

Found on 2026-12-06 (AMD EPYC with AVX-512, 2 threads, the default model): a build for AVX2 alone with 0001 to 0007
against one with 0001 to 0009: 1 row 5.59 against 5.55 ms, 2 rows 9.01 against 7.51, 4 rows 12.62 against 10.23,
8 rows 21.23 against 18.73. Later that day, the installed 0001 to 0012 against a build with 0001 to 0009 (the least
/ the median of 4 medians): a step of 1 row 5.75 / 6.34 against 6.31 / 7.21 ms, 2 rows 6.38 / 6.76 against 6.85 /
7.49, 4 rows 7.71 / 7.80 against 8.82 / 9.90, 8 rows 13.49 / 15.14 against 14.36 / 17.22; a prompt's chunk
(--chunk, 3 medians of 10) of 64 rows 54.3 / 54.7 against 68.6 / 69.5 ms, of 256 rows 182 / 211 against 260 / 260;
builds for AVX2 alone, 0001 to 0012 against 0001 to 0009, a chunk of 256 rows 294.5 / 343.7 against 371.5 / 435.3.

    .venv/bin/python bench/bench_step_rows.py [--rows 1 2 4 8] [--build NAME=DIR ...]   # the installed one: "installed"
    .venv/bin/python bench/bench_step_rows.py --chunk --rows 64 256 --steps 10 [--build NAME=DIR ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, statistics, sys, time
sys.path[1:1] = [sys.argv[1], sys.argv[1] + "/plugins/llamacpp"]
import llama_cpp
from syshax_llamacpp.contexts import add_row
from syshax_llamacpp.engine import LlamaCppEngine
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path
from syshaxd.sdk.types import EngineSpec

rows, steps, chunk = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "chunk"
engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_name="m", n_ctx=2048,
                                   model_path=str(default_tokenizer_path()), max_batch_size=8, threads=2,
                                   tiled_attention=True))
engine.warm_up()
cparams = engine.batch_params(max(64, rows))
cparams.n_ubatch = cparams.n_batch  # a chunk of `rows` rows in one ubatch
ctx = llama_cpp.llama_init_from_model(engine.model, cparams)
memory = llama_cpp.llama_get_memory(ctx)
batch = llama_cpp.llama_batch_init(cparams.n_batch, 0, 1)
prompt = list(engine.vocab.tokenize(PromptBuilder(GGUFTokenizer(default_tokenizer_path())).build(200 + rows, 21).text,
                                    add_special=False))
n = 0 if chunk else 200  # a chunk: a prompt's first rows, its last one's logits; a step: after 200 tokens
for start in range(0, n, 64):
    batch.n_tokens = 0
    for pos in range(start, min(start + 64, n)):
        add_row(batch, prompt[pos], pos, 0, pos == n - 1)
    assert llama_cpp.llama_decode(ctx, batch) == 0
times = []
for _ in range(steps):
    batch.n_tokens = 0
    for j in range(rows):
        add_row(batch, prompt[n + j], n + j, 0, not chunk or j == rows - 1)
    started = time.perf_counter()
    assert llama_cpp.llama_decode(ctx, batch) == 0
    times.append(time.perf_counter() - started)
    llama_cpp.llama_memory_seq_rm(memory, 0, n, -1)
print(1000 * statistics.median(times))
"""


def step_ms(build: str | None, rows: int, steps: int, chunk: bool) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="2", SYSHAX_FA_TILED="1")
    if build:
        env["PYTHONPATH"] = os.pathsep.join([build, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(rows), str(steps),
                          "chunk" if chunk else "step"], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"build {build or 'installed'}, {rows} rows: {run.stderr[-1500:]}")
    return float(run.stdout.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="row counts (default: 1 2 4 8)")
    p.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                   help="a llama_cpp package folder to compare (repeat); the installed one is always run")
    p.add_argument("--steps", type=int, default=300, help="steps per median (default: 300)")
    p.add_argument("--rounds", type=int, default=3, help="medians per row count and build (default: 3)")
    p.add_argument("--chunk", action="store_true", help="a prompt's chunk of that many rows (its first tokens, the "
                   "last row's logits: the q4_0 gemm from 12 rows), not a decode step's rows after a prompt")
    args = p.parse_args()
    builds = {"installed": None, **dict(b.split("=", 1) for b in args.build)}
    print(f"{'a prompt chunk' if args.chunk else 'a step'} of k rows, ms: the least and the median of "
          f"{args.rounds} medians of {args.steps}\n")
    print("| rows | " + " | ".join(f"{name} ms" for name in builds) + " |")
    print("|---:|" + "---:|" * len(builds))
    for rows in args.rows:
        medians: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.rounds):  # builds alternate round by round: both see the machine's drift
            for name, path in builds.items():
                medians[name].append(step_ms(path, rows, args.steps, args.chunk))
        print(f"| {rows} | " + " | ".join(f"{min(m):.2f} / {statistics.median(m):.2f}" for m in medians.values())
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
