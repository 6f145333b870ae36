"""Idle connections must not slow the working streams: 8 streams alone, then beside 1,000 idle connections.

Starts one syshaxd in cpu mode, runs 8 concurrent streamed completions (unique prompts, forced
length) alone, then opens 1,000 TCP connections that send nothing (a greedy client) and runs the
same 8 streams again, then again alone. Prints tok/s and TPOT p50 of each run and the ratio against
the mean of the two runs alone; writes JSON under bench/results/.

  .venv/bin/python bench/bench_idle_connections.py [--idle 1000] [--streams 8] [--output-len 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.client import run_streams  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder  # noqa: E402

MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"


async def open_idle(host: str, port: int, n: int) -> list:
    """n connections that never send a byte (each gets its own socket in the daemon)."""
    conns = []
    for _ in range(n):
        _, writer = await asyncio.open_connection(host, port)
        conns.append(writer)
    return conns


async def main(args: argparse.Namespace) -> dict:
    builder = PromptBuilder(GGUFTokenizer(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_idle_", dir=REPO / "bench" / "results"))
    config = log_dir / "syshaxd.toml"
    config.write_text(f"model = {json.dumps(str(args.model))}\nmodel_dir = {json.dumps(str(args.model.parent))}\n"
                      f"quantize = \"\"\nthreads = {args.threads}\ncpu_max_batch_size = {args.streams}\n"
                      f"max_connections = {args.idle + 64}\nadmin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n")
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                                log_dir=str(log_dir))
    runs = {}
    try:
        host, port = "127.0.0.1", int(daemon.url.rsplit(":", 1)[1])

        def prompts(k):
            return [builder.build(args.input_len, 1000 * k + i) for i in range(args.streams)]

        await run_streams(daemon.url, prompts(9), 8)  # warm-up
        runs["alone (before)"] = await run_streams(daemon.url, prompts(0), args.output_len)
        idle = await open_idle(host, port, args.idle)
        try:
            runs[f"beside {args.idle} idle connections"] = await run_streams(daemon.url, prompts(1), args.output_len)
        finally:
            for writer in idle:
                writer.close()
        await asyncio.sleep(1)
        runs["alone (after)"] = await run_streams(daemon.url, prompts(2), args.output_len)
    finally:
        await stop_daemon(daemon.process)
    return runs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--idle", type=int, default=1000, help="idle connections opened beside the streams")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    runs = asyncio.run(main(args))
    alone = statistics.mean(r["tpot_p50_ms"] for name, r in runs.items() if name.startswith("alone"))
    print("| run | ok | tok/s | TPOT p50 ms | TPOT / alone |\n|---|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['ok']}/{r['requests']} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.2f} | "
              f"{r['tpot_p50_ms'] / alone:.2f}x |")
    out = REPO / "bench" / "results" / "bench_idle_connections.json"
    out.write_text(json.dumps(runs, indent=2))
    print(f"figures: {out}")
