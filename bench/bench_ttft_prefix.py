"""What the prefix cache adds to a short prompt's time to its first token: syshaxd with it against syshaxd without
it (prefix_cache_mb = 0), in one run (issue 38, item 1: the short prompts' TTFT gap to llama-server).

A prompt's blocks are written into the cache (the engine's _keep_blocks) before its first token's Delta leaves the
worker, so on a miss that write is on the TTFT path. Two daemons up at once (cpu mode, the default model, 2 threads
each), unique random-word prompts of --tokens tokens, one request at a time, alternating which daemon goes first;
each request asks for 1 token, unstreamed, so its time is its TTFT as the client sees it. Prints each daemon's p50
and the difference.

    .venv/bin/python bench/bench_ttft_prefix.py [--requests 24] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.bench.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402
from syshaxd.bench.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402


def seconds_to_answer(url: str, body: dict) -> float:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - started


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
        times: dict[str, list[float]] = {name: [] for name in daemons}
        for i in range(args.requests + 2):  # the first two each warm the daemons up, uncounted
            body = {"model": model, "prompt": builder.build(args.tokens, 5000 + i).text, "max_tokens": 1,
                    "temperature": 0}
            for name in (list(daemons) if i % 2 else list(daemons)[::-1]):
                took = seconds_to_answer(daemons[name].url + "/v1/completions", body)
                if i >= 2:
                    times[name].append(took)
    finally:
        for d in daemons.values():
            asyncio.run(stop_daemon(d.process))
    p50 = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:<9} TTFT p50 {1000 * p50[name]:.1f} ms (min {1000 * min(t):.1f}, {len(t)} prompts of "
              f"{args.tokens} tokens)")
    print(f"the prefix cache adds {1000 * (p50['cache'] - p50['no cache']):.1f} ms at p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
