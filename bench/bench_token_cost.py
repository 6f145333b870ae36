"""What one streamed token costs at concurrency 1: syshaxd against llama-server, in one run (issue 20, item 2).

Both servers as bench_peers.py starts them (same GGUF, threads, slots, flash attention), both up and loaded one
at a time, the first alternating from round to round (bench_peers.py's way: this machine's speed drifts within
minutes, and so both see the drift). Each round, each streams the same unique 128-token prompts (the round's own)
at concurrency 1, 256 tokens forced out, after one warm-up request.
Per server: TPOT p50 and output tokens/s as the client sees them, and the CPU seconds per output token of each
of its processes (user + system CPU time, read before and after the level). llama-server is one
process; syshaxd is the daemon (HTTP, scheduling, SSE) and its engine worker (llama_decode, sampling, the
pipe). On 2 cores the worker's two llama.cpp threads take both, so every millisecond of daemon CPU per token
is taken from them; that is the part this measures beside the peer.

    .venv/bin/python bench/bench_token_cost.py [--requests 8] [--rounds 2] [--repack auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

import bench_peers  # noqa: E402
from syshaxd.benchmark.client import StreamingClient, list_models, run_level  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder  # noqa: E402
from syshaxd.benchmark.report import level_summary  # noqa: E402


def process_tree(pid: int) -> list[psutil.Process]:
    """The server's process and its descendants (syshaxd's worker is a child of the daemon)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def measure(server, prompts, out_len: int) -> dict:
    async with aiohttp.ClientSession() as session:
        model = (await list_models(session, server.url))[0]
        client = StreamingClient(server.url, model, out_len)
        await run_level(client, session, prompts[:1], 1)
        tree = process_tree(server.process.pid)
        before = [cpu_seconds(p) for p in tree]
        started = time.perf_counter()
        run = await run_level(client, session, prompts[1:], 1, output_len=out_len)
        wall = time.perf_counter() - started
        spent = [cpu_seconds(p) - b for p, b in zip(tree, before)]
    summary = level_summary(run, out_len, None)
    tokens = sum(r.output_tokens for r in run.records)
    # by role, not pid, so that rounds line up: llama-server's one process; syshaxd's daemon and its engine worker
    root = "daemon" if server.label == bench_peers.OURS else server.label
    busy = {(root if p.pid == server.process.pid else "worker"): 1000 * s / tokens for p, s in zip(tree, spent)
            if s > 0}
    return {"tok_s": tokens / wall, "tpot_p50_ms": 1000 * summary["tpot_s"]["median"], "cpu_ms_per_token": busy,
            "total_cpu_ms_per_token": sum(busy.values())}


async def main_async(args) -> None:
    builder = PromptBuilder(GGUFTokenizer(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_token_cost-"))
    labels = (bench_peers.PEER, bench_peers.OURS)
    results: dict[str, list[dict]] = {label: [] for label in labels}
    servers = {}
    try:
        # both up, one loaded at a time, the first alternating (bench_peers.py's way: the machine's drift falls on both)
        servers[bench_peers.PEER] = await bench_peers.start_peer(args, args.binary, log_dir)
        servers[bench_peers.OURS] = await bench_peers.start_ours(args, log_dir)
        for r in range(args.rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                # prompts of the round's own: no server finds them in a cache
                prompts = [builder.build(128, 7_000 + 100 * r + k) for k in range(args.requests + 1)]
                results[label].append(await measure(servers[label], prompts, 256))
    finally:
        for server in servers.values():
            await server.stop()
    print(f"c=1, {args.requests} requests of 128 tokens in and 256 out per round, {args.rounds} rounds, "
          f"{args.threads} threads each, repack {args.repack}; medians over the rounds:\n")
    print("| server | tok/s | TPOT p50 ms | CPU ms per token (per process) | CPU ms per token (all) |")
    print("|---|---:|---:|---|---:|")
    for label, rounds in results.items():
        names = dict.fromkeys(name for r in rounds for name in r["cpu_ms_per_token"])
        per = ", ".join(f"{name} {statistics.median(r['cpu_ms_per_token'].get(name, 0.0) for r in rounds):.2f}"
                        for name in names)
        print(f"| {label} | {statistics.median(r['tok_s'] for r in rounds):.1f} | "
              f"{statistics.median(r['tpot_p50_ms'] for r in rounds):.2f} | {per} | "
              f"{statistics.median(r['total_cpu_ms_per_token'] for r in rounds):.2f} |")
    ours, peer = results[bench_peers.OURS], results[bench_peers.PEER]
    tok = [o["tok_s"] / p["tok_s"] for o, p in zip(ours, peer)]
    tpot = [o["tpot_p50_ms"] / p["tpot_p50_ms"] for o, p in zip(ours, peer)]
    print(f"\nsyshaxd / llama-server: tok/s {statistics.median(tok):.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in tok)}), TPOT {statistics.median(tpot):.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in tpot)})")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The options of both servers that the c=1 benches share (this one and bench_vllm_random.py)."""
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repack", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--llama-server", dest="binary", metavar="PATH", help="the llama-server binary (default: "
                   "what ../shared/tools/llama-server.sh prints)")


def settle_servers(args: argparse.Namespace) -> argparse.Namespace:
    """args as bench_peers.start_peer and start_ours read them: the default model, 2,048 tokens a sequence, the
    llama-server binary, and the threads in the environment both servers start with."""
    args.model = bench_peers.default_tokenizer_path()
    args.n_ctx = 2048
    args.binary = bench_peers.find_llama_server(args.binary)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.pop("CUSTOM_CPU_AFFINITY", None)
    return args


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="measured requests per server (default: 8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each server once per round (default: 2)")
    add_server_arguments(p)
    asyncio.run(main_async(settle_servers(p.parse_args())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
