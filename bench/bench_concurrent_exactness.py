"""Does a prompt keep its alone text when it joins a batch that is already decoding? (issue 20's "concurrent == alone")

The llama.cpp engine, in-process (no daemon, no pipe): each prompt is run alone, greedily; then every pair
(X, A) is run with X submitted first, so that A's prompt runs while X decodes and A then joins X's batch
in the next KV stream; and with A first. Prints, per prompt A, how many partners changed its text.

Found on 2026-12-04 (AMD EPYC AVX-512, SmolLM2-135M q4_0, repacking on, flash attention, no padding row):
prompts under 256 tokens kept their text with every partner; one 305-token prompt lost it (at its second token)
with 7 of 9 partners when it joined second, and both 345-token prompts with 4 of 9 when they started first. The
cause: with one query row and 512 KV cells or more, ggml's CPU flash attention splits the KV among threads
(ops.cpp, use_split_kv_path); with two streams in the ubatch it does not. With a one-token padding row in the
next stream beside a lone sequence past 256 tokens (DecodeBatch.pad_stream), every prompt here keeps its text with
every partner, in both orders.

mk/llama-wheel.sh builds llama.cpp with that split turned off, and the engine's warm-up proves which kind of
llama.cpp it loaded (proofs.WarmUp._proves_lone): the padding row is for a llama.cpp that splits. With the built one, no
padding row, and every prompt here keeps its text with every partner as well. --padding on/off forces the row
either way (off with a stock llama-cpp-python shows the split's effect).

    .venv/bin/python bench/bench_concurrent_exactness.py [--tokens 12] [--padding proved|on|off]
    .venv/bin/python bench/bench_concurrent_exactness.py --step-cost   # what the padding row costs

--step-cost: a lone sequence's decode step time, in-process, over positions 300 to 500, with the padding row
and without it (alternating, 4 requests each): the engine's own per-token time, with no daemon, pipe or HTTP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp"), str(REPO / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "2")

from syshax_llamacpp.engine import LlamaCppEngine  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.sdk.types import Delta, EngineSpec, GenerateRequest, SamplingParams  # noqa: E402

from test_prefix_cache import long_text  # noqa: E402  (the prefix cache test's text, where it was seen)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=12, help="greedy tokens per request (default: 12)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--padding", choices=("proved", "on", "off"), default="proved",
                   help="a lone long sequence's padding row: as the warm-up proved (default), or forced")
    p.add_argument("--step-cost", action="store_true", help="time a lone sequence's steps with and without the "
                   "padding row instead")
    args = p.parse_args()
    engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(default_tokenizer_path()),
                                       model_name="m", n_ctx=2048, max_batch_size=8, threads=args.threads))
    engine.warm_up()
    if args.padding != "proved":
        engine.decode.pad_lone = args.padding == "on"
    print(f"padding row for a lone sequence past 256 tokens: {'on' if engine.decode.pad_lone else 'off'} "
          f"({'forced' if args.padding != 'proved' else 'as the warm-up proved'})")
    if args.step_cost:
        return step_cost(engine)
    text = list(engine.vocab.tokenize(long_text(60), add_special=True))
    questions = (" Which item is blue?", " Where is the violin?")
    tails = [list(engine.vocab.tokenize(q, add_special=True)) for q in questions]
    prompts = [tuple(text[:n] + tail) for n in (144, 176, 208, 300, 340) for tail in tails]

    def run(batch: list[tuple[int, ...]]) -> list[str]:
        outs: dict[str, list[str]] = {f"r{i}": [] for i in range(len(batch))}
        for i, prompt in enumerate(batch):
            engine.submit(GenerateRequest(f"r{i}", args.tokens, SamplingParams(temperature=0.0), prompt_tokens=prompt))
        while engine.has_work():
            for event in engine.step():
                if isinstance(event, Delta):
                    outs[event.request_id].append(event.text)
        return ["".join(outs[f"r{i}"]) for i in range(len(batch))]

    alone = [run([prompt])[0] for prompt in prompts]
    print(f"{len(prompts)} prompts, {args.tokens} greedy tokens; partners that changed a prompt's text:")
    print("| prompt tokens | joining second | starting first |\n|---:|---:|---:|")
    for a, prompt in enumerate(prompts):
        second = sum(run([x, prompt])[1] != alone[a] for j, x in enumerate(prompts) if j != a)
        first = sum(run([prompt, x])[0] != alone[a] for j, x in enumerate(prompts) if j != a)
        print(f"| {len(prompt)} | {second} of {len(prompts) - 1} | {first} of {len(prompts) - 1} |")
    return 0


def step_cost(engine: LlamaCppEngine) -> int:
    """Median step time of a lone 300-token prompt's 200 greedy tokens, padding row on and off in turn."""
    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    medians: dict[str, list[float]] = {"with the padding row": [], "without it": []}
    for k in range(8):
        label = "with the padding row" if k % 2 == 0 else "without it"
        engine.decode.pad_lone = k % 2 == 0  # what the warm-up proved aside: as with a stock llama.cpp, or not
        prompt = engine.vocab.tokenize(builder.build(300, 9000 + k // 2).text, add_special=False)
        engine.submit(GenerateRequest(f"r{k}", 200, SamplingParams(temperature=0.0), prompt_tokens=tuple(prompt)))
        steps = []
        while engine.has_work():
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        medians[label].append(1000 * statistics.median(steps[5:]))  # after the prompt's chunks
    for label, values in medians.items():
        print(f"lone step, positions 300-500, {label}: median {statistics.median(values):.2f} ms "
              f"(per request: {', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
