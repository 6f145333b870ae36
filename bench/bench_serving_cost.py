"""Where a decode step's time goes at concurrency 8: the engine, or serving it? syshaxd against llama-server (issue 20).

Three figures per server, for 8 unique 128-token prompts decoding 256 tokens each at once:

* the engine's own step: syshaxd's llama.cpp engine in-process (no daemon, pipe or HTTP), the median time of a step
  in which all 8 sequences decode; llama-server's own count, the "eval time" per token its log prints for each
  request (with 8 slots decoding together, one token of each is one step);
* the step as a client sees it, streamed: the median gap between two tokens of a stream (ITL p50). Not TPOT: a
  stream's TPOT also holds the prompt chunks that ran between its tokens, and syshaxd starts decoding a sequence
  while the others' prompts still run (its TTFT is lower for it), where llama-server runs every waiting prompt
  first;
* output tokens/s streamed and not streamed (one JSON answer per request: no per-token HTTP work on either side).

Both servers are up at once and loaded one at a time, alternating, for --rounds rounds, each with prompts of its own
(bench_peers.py's way); the in-process engine runs first, alone. ITL p50 minus the engine's step is what serving
costs per step (llama-server's own count is the wall time between a request's first and last tokens, so what
serving costs it is in that count already). On 2 cores every millisecond of CPU that the daemon (or the client)
spends while the engine computes stalls both of its threads: one waits at the next barrier for the one that was
preempted.

Found on 2026-12-05 (AMD EPYC, 2 cores, SmolLM2-135M q4_0, every query row tiled as the daemon's cpu mode runs it,
mk/patches/0001: 8 rows share a pass over the repacked weights): engine step 19.72 ms against llama-server's 24.89,
ITL p50 22.84 against 25.25, 1.04x streamed (rounds 1.02, 1.06) and 1.11x not (1.07, 1.15): serving costs the
daemon about 3 ms a step.
syshaxd's higher TPOT at c=8 in bench_peers.py is its scheduling, not a slower step:
it decodes the first sequences while the others' prompts still run (TTFT 0.36x), llama-server runs every prompt
first.

    .venv/bin/python bench/bench_serving_cost.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "plugins" / "llamacpp")]

import aiohttp  # noqa: E402

import bench_peers  # noqa: E402
from syshaxd.benchmark.client import StreamingClient, run_level  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder  # noqa: E402
from syshaxd.benchmark.report import level_summary  # noqa: E402

SLOTS, PROMPT, OUT = 8, 128, 256


def engine_step(args, builder: PromptBuilder) -> float:
    """The median time of a step of syshaxd's engine, in-process, in which all SLOTS sequences decode."""
    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.sdk.types import EngineSpec, GenerateRequest, SamplingParams

    engine = LlamaCppEngine(EngineSpec(backend="llamacpp", role="generate", model_path=str(args.model),
                                       model_name="m", n_ctx=args.n_ctx, max_batch_size=SLOTS, threads=args.threads,
                                       tiled_attention=True))  # as syshaxd's cpu mode runs it (keep_generated_tokens)
    engine.warm_up()
    steps = []
    for k in range(SLOTS):
        prompt = engine.vocab.tokenize(builder.build(PROMPT, 9_100 + k).text, add_special=False)
        engine.submit(GenerateRequest(f"r{k}", OUT, SamplingParams(temperature=0.0), prompt_tokens=tuple(prompt),
                                      ignore_eos=True))
    while engine.has_work():
        prompts_left = any(s.pending for s in engine.slots.active.values()) or engine.slots.waiting
        started = time.perf_counter()
        engine.step()
        if not prompts_left and len(engine.slots.active) == SLOTS:
            steps.append(time.perf_counter() - started)
    engine.close()
    return statistics.median(steps)


def peer_eval_per_token(log: Path, skip: int) -> float | None:
    """The median of llama-server's own per-token decode time over the requests its log reports after `skip`."""
    values = [float(m.group(1)) for m in re.finditer(r"\|\s+eval time =\s+[\d.]+ ms /\s+\d+ tokens \(\s*([\d.]+) ms "
                                                     r"per token", log.read_text(errors="replace"))]
    return statistics.median(values[skip:]) / 1000 if values[skip:] else None


async def unstreamed(session, url: str, model: str, prompts, concurrency: int) -> float:
    """Output tokens/s of requests answered in one JSON body each."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt) -> int:
        async with gate:
            body = {"model": model, "prompt": prompt.text, "max_tokens": OUT, "temperature": 0, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                answer = await r.json()
                return answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - started)


async def served(args, builder: PromptBuilder) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="bench_serving_cost-"))
    servers = {bench_peers.PEER: await bench_peers.start_peer(args, args.binary, log_dir)}
    figures = {label: {"itl": [], "streamed": [], "unstreamed": []} for label in (bench_peers.PEER, bench_peers.OURS)}
    try:
        servers[bench_peers.OURS] = await bench_peers.start_ours(args, log_dir)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            for server in servers.values():
                await bench_peers.warm_up(server, session, [builder.build(32, 1), builder.build(32, 2)])
            peer_warm = len(re.findall(r"\|\s+eval time", Path(servers[bench_peers.PEER].info["log"]).read_text()))
            for r in range(args.rounds):
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for label, server in order:
                    prompts = [builder.build(PROMPT, 10_000 * (r + 1) + k) for k in range(2 * SLOTS)]
                    run = await run_level(StreamingClient(server.url, server.info["model"], OUT), session, prompts,
                                          SLOTS, output_len=OUT)
                    summary = level_summary(run, OUT, None)
                    figures[label]["itl"].append(summary["itl_s"]["median"])
                    figures[label]["streamed"].append(summary["output_throughput_tok_s"])
                    prompts = [builder.build(PROMPT, 10_000 * (r + 1) + 500 + k) for k in range(2 * SLOTS)]
                    figures[label]["unstreamed"].append(await unstreamed(session, server.url, server.info["model"],
                                                                         prompts, SLOTS))
                    print(f"  round {r + 1}, {label}: {figures[label]['streamed'][-1]:.1f} tok/s streamed, "
                          f"{figures[label]['unstreamed'][-1]:.1f} not", flush=True)
    finally:
        for server in servers.values():
            await server.stop()
    figures[bench_peers.PEER]["engine_step"] = peer_eval_per_token(
        Path(servers[bench_peers.PEER].info["log"]), peer_warm)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", dest="binary", metavar="PATH")
    args = p.parse_args()
    args.model = bench_peers.default_tokenizer_path()
    args.n_ctx, args.repack = 2048, "auto"
    args.binary = bench_peers.find_llama_server(args.binary)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    builder = PromptBuilder(GGUFTokenizer(args.model))
    step = engine_step(args, builder)
    figures = asyncio.run(served(args, builder))
    figures[bench_peers.OURS]["engine_step"] = step
    print(f"\n{SLOTS} unique {PROMPT}-token prompts at once, {OUT} tokens each, {args.threads} threads; medians over "
          f"{args.rounds} rounds:\n")
    print("| server | engine step ms | ITL p50 streamed ms | serving per step ms | tok/s streamed "
          "| tok/s not streamed |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, f in figures.items():
        itl = statistics.median(f["itl"])
        engine = f["engine_step"]
        print(f"| {label} | {1000 * engine:.2f} | {1000 * itl:.2f} | {1000 * (itl - engine):.2f} | "
              f"{statistics.median(f['streamed']):.1f} | {statistics.median(f['unstreamed']):.1f} |")
    ours, peer = figures[bench_peers.OURS], figures[bench_peers.PEER]
    for key in ("streamed", "unstreamed"):
        ratios = [o / q for o, q in zip(ours[key], peer[key])]
        print(f"\nsyshaxd / llama-server, {key}: {statistics.median(ratios):.2f}x (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios)})", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
