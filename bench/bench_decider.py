"""Decider v2 (decider = "measured") against sysHAX 0.2.0's thresholds, on the seed's three scenarios at once.

One auto daemon per decider, the same config otherwise: a llama.cpp "GPU" engine on CPU 0 (max_num_seqs 4) and a CPU
decoder on CPU 1 (8 slots). The load mixes the seed article's scenarios, shortened to fit 2 cores (in/out tokens):
short 128/64, medium 512/128, long 1536/96, arriving staggered (a seeded Poisson process) so that requests start and
finish at scattered times. A warm-up of the same shape runs first (so that v2 has measured both sides). Prints
output tok/s, TTFT and TPOT p50/p99, and where each decider sent the requests; writes bench/results/bench_decider.json.

    .venv/bin/python bench/bench_decider.py                  # about 4 minutes on 2 quiet cores
    .venv/bin/python bench/bench_decider.py --rate 1.0 --requests 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.client import StreamingClient  # noqa: E402
from syshaxd.benchmark.daemon import start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.benchmark.resources import describe_machine, save_figures  # noqa: E402

SCENARIOS = {"short": (128, 64), "medium": (512, 128), "long": (1536, 96)}
MIX = ["short"] * 4 + ["medium"] * 2 + ["long"]  # seven requests in a round: four short, two medium, one long


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=42, help="requests per run (default: 42, six of each round)")
    p.add_argument("--rate", type=float, default=0.7, help="arrivals per second (default: 0.7)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", default=str(REPO / "bench/results/bench_decider.json"))
    return p.parse_args(argv)


def quantile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def run_load(url: str, builder: PromptBuilder, n: int, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    kinds = [MIX[i % len(MIX)] for i in range(n)]
    rng.shuffle(kinds)
    arrivals, t = [], 0.0
    for _ in kinds:
        arrivals.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int, kind: str, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            n_in, n_out = SCENARIOS[kind]
            client = StreamingClient(url, "SmolLM2-135M-Instruct", n_out)
            record = await client.send(session, i, builder.build(n_in, seed * 1000 + i), start)
            return kind, record

        results = await asyncio.gather(*(one(i, k, a) for i, (k, a) in enumerate(zip(kinds, arrivals))))
        async with session.get(f"{url}/v1/syshax/status") as resp:
            status = await resp.json()
    wall = time.perf_counter() - start
    records = [r for _, r in results]
    failed = sum(not r.ok for r in records)
    tokens = sum(r.output_tokens for r in records if r.ok)
    return {"wall_s": round(wall, 1), "failed": failed, "output_tok_s": round(tokens / wall, 2),
            "ttft_ms": {q: _ms(quantile([r.ttft_s for r in records], p)) for q, p in (("p50", 0.5), ("p99", 0.99))},
            "tpot_ms": {q: _ms(quantile([r.tpot_s for r in records], p)) for q, p in (("p50", 0.5), ("p99", 0.99))},
            "by_scenario": {k: {"tpot_p99_ms": _ms(quantile([r.tpot_s for kk, r in results if kk == k], 0.99)),
                                "ttft_p99_ms": _ms(quantile([r.ttft_s for kk, r in results if kk == k], 0.99))}
                            for k in SCENARIOS},
            "routes": status["routes"], "decided_by": status["auto"]["decided_by"],
            "estimates": status["auto"]["estimates"]}


def _ms(seconds: float | None) -> float | None:
    return round(1000 * seconds, 1) if seconds is not None else None


async def one_decider(decider: str, args, builder: PromptBuilder, tmp: Path) -> dict:
    config = tmp / f"{decider}.toml"
    config.write_text(f'mode = "auto"\nprefill_engine = "llamacpp"\nprefill_cpu_affinity = "0"\nmax_num_seqs = 4\n'
                      f'cpu_max_batch_size = 8\nn_ctx = 2048\nmax_queue_size = 128\ndecider = "{decider}"\n'
                      f'model_dir = "{REPO / "models"}"\n')
    daemon = await start_daemon("auto", command=[sys.executable, "-m", "syshaxd"], config=str(config),
                                startup_timeout_s=600, log_dir=str(tmp))
    try:
        await run_load(daemon.url, builder, 14, args.rate, args.seed + 1)  # warm-up: both sides measured
        return await run_load(daemon.url, builder, args.requests, args.rate, args.seed)
    finally:
        await stop_daemon(daemon.process)


def main(argv=None) -> int:
    args = parse_args(argv)
    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    tmp = Path(tempfile.mkdtemp(prefix="bench-decider-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rows = {}
    for decider in ("thresholds", "measured"):
        rows[decider] = row = asyncio.run(one_decider(decider, args, builder, tmp))
        print(f"{decider:<10} {row['output_tok_s']:6.1f} tok/s  TTFT p50 {row['ttft_ms']['p50']} p99 "
              f"{row['ttft_ms']['p99']} ms  TPOT p50 {row['tpot_ms']['p50']} p99 {row['tpot_ms']['p99']} ms  "
              f"failed {row['failed']}  routes {row['routes']}  decided by {row['decided_by']}", flush=True)
    t, m = rows["thresholds"], rows["measured"]
    print("\n| decider | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | TPOT p99 short / medium / long "
          "| routes |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        s = r["by_scenario"]
        print(f"| {name} | {r['output_tok_s']} | {r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} | "
              f"{r['tpot_ms']['p50']} / {r['tpot_ms']['p99']} | {s['short']['tpot_p99_ms']} / "
              f"{s['medium']['tpot_p99_ms']} / {s['long']['tpot_p99_ms']} | "
              f"{', '.join(f'{k} {v}' for k, v in r['routes'].items())} |")
    print(f"\nmeasured / thresholds: {m['output_tok_s'] / t['output_tok_s']:.2f}x tok/s, TPOT p99 "
          f"{m['tpot_ms']['p99'] / t['tpot_ms']['p99']:.2f}x")
    load = save_figures(args.json, started, args, rows)
    print(f"{describe_machine().get('cpu_model', '')} {os.cpu_count()} CPUs; load average at the end {load[0]:.2f}")
    print(f"figures in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
