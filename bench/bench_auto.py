"""auto mode against gpu-only and cpu-only, in the same run, on the same daemon: the shape of the seed's table.

One syshaxd starts in auto mode (its GPU engine and its CPU decoders); every concurrency level
then runs the same workload three times, each request naming its route with
{"syshax": {"mode": "cpu" | "gpu" | "auto"}}: cpu-only uses the CPU decoders alone, gpu-only the
GPU engine alone, auto the GPU engine with decodes offloaded to the CPU when it is saturated.
The three runs of a level follow each other, so a noisy neighbour hurts all three alike.

On a host without a GPU the "GPU" engine is `--prefill-engine` (llama.cpp on its own cores by
default; `vllm` uses vLLM's CPU build) on CPU 0, and the decoders take the other CPUs.

    .venv/bin/python bench/bench_auto.py                        # 1,2,4,8,16; prints the table
    .venv/bin/python bench/bench_auto.py --prefill-engine vllm --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.client import StreamingClient, run_level  # noqa: E402
from syshaxd.benchmark.daemon import start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.benchmark.report import level_summary  # noqa: E402
from syshaxd.benchmark.resources import describe_machine, save_figures  # noqa: E402

MODES = ("cpu", "gpu", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-engine", default="llamacpp", help="the GPU engine's backend (default: llamacpp)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="the GPU engine's batch (default: 4)")
    p.add_argument("--cpu-max-batch-size", type=int, default=8, help="each CPU decoder's batch (default: 8)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="levels (default: 1,2,4,8,16)")
    p.add_argument("--iterations", type=int, default=0,
                   help="requests per level and mode (default: twice the concurrency, at least 8)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument("--json", default=str(REPO / "bench/results/bench_auto.json"), help="where the figures go")
    return p.parse_args(argv)


async def _status(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/syshax/status") as resp:
        return await resp.json()


async def bench(args: argparse.Namespace, url: str) -> list[dict]:
    levels = [int(c) for c in args.concurrency.split(",")]
    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = StreamingClient(url, "SmolLM2-135M-Instruct", 8, extra_body={"syshax": {"mode": "auto"}})
        await run_level(warm, session, [builder.build(args.input_len, s) for s in range(4)], 4)
        for c in levels:
            n = args.iterations or max(8, 2 * c)
            prompts = [builder.build(args.input_len, 1000 * c + i) for i in range(n)]
            for mode in MODES:
                client = StreamingClient(url, "SmolLM2-135M-Instruct", args.output_len,
                                         extra_body={"syshax": {"mode": mode}})
                before = (await _status(session, url))["routes"]
                run = await run_level(client, session, prompts, c)
                after = (await _status(session, url))["routes"]
                s = level_summary(run, args.output_len, None)
                s.pop("requests")
                routes = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
                rows.append({"concurrency": c, "mode": mode, "routes": routes, **s})
                print(f"c={c:<3} {mode:<5} {s['output_throughput_tok_s']:7.1f} tok/s  p99 e2e "
                      f"{s['e2e_s']['p99']:6.2f} s  p99 tpot {1000 * (s['tpot_s']['p99'] or 0):6.1f} ms  "
                      f"failed {s['failed']}  routes {routes}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    out = ["| concurrency | cpu tok/s | gpu tok/s | auto tok/s | auto/gpu | auto/cpu | p99 e2e cpu / gpu / auto (s) "
           "| auto routes |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted({r["concurrency"] for r in rows}):
        cpu, gpu, auto = by[(c, "cpu")], by[(c, "gpu")], by[(c, "auto")]
        t = {m: by[(c, m)]["output_throughput_tok_s"] for m in MODES}
        out.append(f"| {c} | {t['cpu']:.1f} | {t['gpu']:.1f} | {t['auto']:.1f} | {t['auto'] / t['gpu']:.2f}x | "
                   f"{t['auto'] / t['cpu']:.2f}x | {cpu['e2e_s']['p99']:.2f} / {gpu['e2e_s']['p99']:.2f} / "
                   f"{auto['e2e_s']['p99']:.2f} | {', '.join(f'{k} {v}' for k, v in auto['routes'].items())} |")
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = Path(tempfile.mkdtemp(prefix="bench-auto-")) / "syshax.toml"
    config.write_text(f'mode = "auto"\nprefill_engine = "{args.prefill_engine}"\nprefill_cpu_affinity = "0"\n'
                      f"max_num_seqs = {args.max_num_seqs}\ncpu_max_batch_size = {args.cpu_max_batch_size}\n"
                      f'n_ctx = 1024\nmax_queue_size = 64\nmodel_dir = "{REPO / "models"}"\n')
    daemon = asyncio.run(start_daemon("auto", command=[sys.executable, "-m", "syshaxd"], config=str(config),
                                      startup_timeout_s=600))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        rows = asyncio.run(bench(args, daemon.url))
    finally:
        asyncio.run(stop_daemon(daemon.process))
    print()
    print(table(rows))
    load = save_figures(args.json, started, args, rows)
    print(f"\n{describe_machine().get('cpu_model', '')} {os.cpu_count()} CPUs; GPU engine {args.prefill_engine} "
          f"(max_num_seqs {args.max_num_seqs}) on CPU 0, decoder on the rest; load average at the end {load[0]:.2f}")
    print(f"figures in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
