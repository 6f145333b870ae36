"""What the prefix cache adds to a short prompt's time to its first token: syshaxd with it against syshaxd without
it (prefix_cache_mb = 0), in one run (issue 38, item 1: the short prompts' TTFT gap to llama-server).

On a miss the engine writes the prompt's new blocks into the cache at the step after the first token's Delta left
the worker, not before it (prefix_side.py, PrefixSide.defer and keep_deferred). Two daemons up at once (cpu mode,
the default model, 2 threads each), unique random-word prompts of --tokens tokens, one request at a time,
alternating which daemon goes first; each request streams 4 tokens, timed to its first token by the repo's bench
client (syshaxd/benchmark/client.py, as bench_peers.py times TTFT). Prints each daemon's p50, the difference, and
the CPU each daemon and its workers used per request.

Found on 2026-12-05 (AMD EPYC with AVX-512, 2 cores, quiet): with the write before the first token (this script
as of commit 97b0e5d, unstreamed, 1 token) the cache added 11.8 to 17.3 ms at p50; with the write at the step
after it (the blocks read from the state the move exported) two runs gave +13.2 ms (24 prompts: 152.4 against
139.2, the minimums 125.4 and 126.9) and -0.5 ms (--requests 40: 129.6 against 130.1): within this machine's noise.

    .venv/bin/python bench/bench_ttft_prefix.py [--requests 24] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.client import StreamingClient  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the daemon and its workers have used so far."""
    daemon = psutil.Process(pid)
    used = {"daemon": sum(daemon.cpu_times()[:2]), "workers": 0.0}
    for worker in daemon.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            used["workers"] += sum(worker.cpu_times()[:2])
    return used


async def first_tokens(daemons: dict, prompts: list, model: str) -> dict[str, list[float]]:
    """Each prompt streamed to each daemon in turn (which goes first alternating), 4 tokens; the seconds to its
    first token as the repo's bench client times them (syshaxd/benchmark/client.py)."""
    times: dict[str, list[float]] = {name: [] for name in daemons}
    async with aiohttp.ClientSession() as session:
        clients = {name: StreamingClient(d.url, model, 4) for name, d in daemons.items()}
        for i, prompt in enumerate(prompts):
            for name in (list(daemons) if i % 2 else list(daemons)[::-1]):
                record = await clients[name].send(session, i, prompt, time.perf_counter())
                if not record.ok or record.ttft_s is None:
                    raise RuntimeError(f"{name}: the request failed ({record.error}: {record.error_detail})")
                times[name].append(record.ttft_s)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24, help="prompts, each sent to both daemons (default: 24)")
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops both daemons
    root = Path(tempfile.mkdtemp(prefix="bench-ttft-prefix-"))
    daemons = {}
    try:
        for name, extra in (("cache", ""), ("no cache", "prefix_cache_mb = 0\n")):
            d = root / name.replace(" ", "-")
            d.mkdir()
            (d / "syshaxd.toml").write_text(f"threads = {args.threads}\nn_ctx = 4096\n"
                                            f"admin_socket = {json.dumps(str(d / 'admin.sock'))}\n{extra}")
            daemons[name] = asyncio.run(start_daemon("cpu", command=daemon_command(), config=str(d / "syshaxd.toml"),
                                                     startup_timeout_s=300, log_dir=str(d)))
        with urllib.request.urlopen(daemons["cache"].url + "/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
        prompts = [builder.build(args.tokens, 5000 + i) for i in range(args.requests + 2)]
        asyncio.run(first_tokens(daemons, prompts[:2], model))  # each warms the daemons up, uncounted
        cpu = {name: cpu_seconds(d.pid) for name, d in daemons.items()}
        times = asyncio.run(first_tokens(daemons, prompts[2:], model))
        for name, d in daemons.items():
            cpu[name] = {role: used - cpu[name][role] for role, used in cpu_seconds(d.pid).items()}
    finally:
        for d in daemons.values():
            asyncio.run(stop_daemon(d.process))
    p50 = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:<9} TTFT p50 {1000 * p50[name]:.1f} ms (min {1000 * min(t):.1f}, {len(t)} prompts of "
              f"{args.tokens} tokens)")
    for name, used in cpu.items():
        print(f"{name:<9} CPU per request: daemon {1000 * used['daemon'] / args.requests:.1f} ms, workers "
              f"{1000 * used['workers'] / args.requests:.1f} ms")
    print(f"the prefix cache adds {1000 * (p50['cache'] - p50['no cache']):.1f} ms at p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
