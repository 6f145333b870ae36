"""Does a change to the llama.cpp engine cost time? This tree's engine against another commit's, in-process, in turns.

For a change that should not touch speed (a restructuring, issue 54's owners), or one that should gain it. Each turn
runs one engine in a child process of its own (llama.cpp reads its attention setting once per process), from this
tree or from a worktree of --against made for the run and removed after it, with this venv's packages: the default
model, cpu mode's settings (every query row tiled), --slots unique prompts of --prompt tokens submitted at once,
each decoding --out tokens greedily. The child uses only the Engine protocol (submit, step, has_work), so any two
commits compare. Per engine: the median time of a step that gives every sequence a token (all --slots decoding, the
prompts done), and the tokens per second of the whole load, prompts included. Turns alternate which engine goes
first; the ratios are this tree's over the other's, each turn's and their median. Run it alone: on two cores a
build or the test suite beside it makes the ratios noise.

    .venv/bin/python bench/bench_engine_ab.py --against 6bf17a9 [--rounds 3] [--slots 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PLUGIN_DIRS = ("plugins/llamacpp", "plugins/torch", "plugins/vllm")

CHILD = r"""
import json, statistics, sys, time
from syshax_llamacpp.engine import LlamaCppEngine
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder
from syshaxd.sdk.types import Delta, EngineSpec, GenerateRequest, SamplingParams

model, slots, prompt_len, out, threads, seed = sys.argv[1], *map(int, sys.argv[2:7])
builder = PromptBuilder(GGUFTokenizer(model))
engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=model, model_name="m",
                                   n_ctx=1024, max_batch_size=slots, threads=threads, tiled_attention=True))
engine.warm_up()
for k in range(slots):
    tokens = engine.vocab.tokenize(builder.build(prompt_len, seed + k).text, add_special=False)
    engine.submit(GenerateRequest(f"r{k}", out, SamplingParams(temperature=0.0), prompt_tokens=tuple(tokens),
                                  ignore_eos=True))
steps, generated, started, first = [], 0, time.perf_counter(), set()
while engine.has_work():
    t = time.perf_counter()
    deltas = [e for e in engine.step() if isinstance(e, Delta)]
    took = time.perf_counter() - t
    generated += sum(d.n_tokens for d in deltas)
    fresh = {d.request_id for d in deltas} - first  # a sequence's first token: its prompt ran in this step
    first |= fresh
    if len(deltas) == slots and not fresh:
        steps.append(took)
wall = time.perf_counter() - started
engine.close()
print(json.dumps({"step_ms": 1000 * statistics.median(steps), "steps": len(steps), "tok_s": generated / wall}))
"""


def run_child(tree: Path, args, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *(str(tree / d) for d in PLUGIN_DIRS)]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(args.model), str(args.slots), str(args.prompt),
                           str(args.out), str(args.threads), str(seed)], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the engine of {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from syshaxd.benchmark.prompts import default_tokenizer_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, metavar="REV", help="the commit to compare this tree with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=8, help="sequences decoding together (default: 8)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens each (default: 128)")
    p.add_argument("--out", type=int, default=256, help="greedy tokens each (default: 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    args = p.parse_args()
    args.model = Path(args.model) if args.model else default_tokenizer_path()
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    other = Path(tempfile.mkdtemp(prefix="bench-engine-ab-")) / rev
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), rev], cwd=REPO, check=True)
    trees = {"this tree": REPO, rev: other}
    seen: dict[str, list[dict]] = {label: [] for label in trees}
    try:
        print(f"{args.slots} sequences, {args.prompt}-token prompts, {args.out} greedy tokens each, {args.threads} "
              f"threads, {args.model.name}")
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for label, tree in order:
                seen[label].append(run_child(tree, args, seed=7_000 + 100 * r))
                got = seen[label][-1]
                print(f"  round {r + 1}, {label}: step {got['step_ms']:.2f} ms (median of {got['steps']}), "
                      f"{got['tok_s']:.1f} tok/s", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPO, check=False)
    ours, theirs = seen["this tree"], seen[rev]
    step = [a["step_ms"] / b["step_ms"] for a, b in zip(ours, theirs)]
    rate = [a["tok_s"] / b["tok_s"] for a, b in zip(ours, theirs)]
    print(f"this tree / {rev}: step time {statistics.median(step):.3f}x (rounds {', '.join(f'{x:.3f}' for x in step)}),"
          f" tok/s {statistics.median(rate):.3f}x (rounds {', '.join(f'{x:.3f}' for x in rate)})")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO)]
    sys.exit(main())
