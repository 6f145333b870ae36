"""What the prefix cache adds to a short prompt's time to its first token: syshaxd with it against syshaxd without
it (prefix_cache_mb = 0), in one run (issue 38, item 1: the short prompts' TTFT gap to llama-server).

On a miss the engine writes the prompt's new blocks into the cache; that write once came before the first token's
Delta left the worker. Two daemons up at once (cpu mode, the default model, 2 threads each), unique random-word
prompts of --tokens tokens, one request at a time, alternating which daemon goes first; each request streams 4
tokens and its time is that to its first chunk with text, as the client sees it. Prints each daemon's p50, the
difference, and the CPU each daemon and its workers used per request.

Found on 2026-12-05 (AMD EPYC with AVX-512, 2 cores, quiet): with the write before the first token (unstreamed,
1 token) the cache added 11.8 to 17.3 ms at p50 (the write itself 9.9 ms a prompt in the worker, into fresh pages
of the store); with the write at the step after the first token (stepping.py, _keep_unkept) it adds -0.1 ms
(128.5 against 128.6 ms).

    .venv/bin/python bench/bench_ttft_prefix.py [--requests 24] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def seconds_to_first_token(url: str, body: dict) -> float:
    """Seconds from sending the streamed request to its first chunk with text; the rest is read and dropped."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the daemon and its workers have used so far, by role."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {"daemon": 0.0, "workers": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        own, parent = int(stat.parent.name), int(fields[1])
        if own == pid or parent == pid:
            used["daemon" if own == pid else "workers"] += (int(fields[11]) + int(fields[12])) / tick
    return used


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
        cpu: dict[str, dict[str, float]] = {}
        for i in range(args.requests + 2):  # the first two each warm the daemons up, uncounted
            if i == 2:
                cpu = {name: cpu_seconds(d.pid) for name, d in daemons.items()}
            body = {"model": model, "prompt": builder.build(args.tokens, 5000 + i).text, "max_tokens": 4,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            for name in (list(daemons) if i % 2 else list(daemons)[::-1]):
                took = seconds_to_first_token(daemons[name].url + "/v1/completions", body)
                if i >= 2:
                    times[name].append(took)
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
