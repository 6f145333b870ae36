"""An agent's session across a restart: TTFT per turn for syshaxd (prefix cache with its disk tier) and llama-server
(its slots and --cache-ram), in one run (issue 52, items 1-2).

One session: a long prompt that grows by --grow words a turn, as an agent's context does. Turns 0 and 1 run, both
servers restart, turns 2 and 3 run. Each turn's time is a request for one token (its TTFT). After the turns each
server also gets turn 2's prompt uncached (cache_prompt false), a full prefill, to say how much faster than a
full prefill the turn after the restart is.

    .venv/bin/python bench/bench_prefix_disk.py [--words 2400] [--grow 200] [--threads 2]

Ratios, not times: the machine is shared. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from syshaxd.benchmark.daemon import daemon_command, free_port, start_daemon, stop_daemon, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEER = Path.home() / ".cache/syshax-peers/llama-server-0.3.36-noamx/bin/llama-server"


def post(url: str, body: dict) -> tuple[float, dict]:
    data = json.dumps(body).encode()
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - started, answer


def turn(url: str, model: str, prompt: str, cache: bool = True) -> tuple[float, int]:
    seconds, answer = post(url, {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                 "cache_prompt": cache})
    usage = answer.get("usage", {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", -1)
    return seconds, cached


def session(words: int, grow: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po") for b in ("n", "m", "st", "x", "l")]
    text = " ".join(rng.choice(vocab) for _ in range(words))
    turns = []
    for _ in range(4):
        turns.append(text)
        text += " " + " ".join(rng.choice(vocab) for _ in range(grow))
    return turns


async def ours(args, prompts: list[str], tmp: Path) -> dict:
    config = tmp / "syshaxd.toml"
    config.write_text(f"model = {json.dumps(str(args.model))}\nquantize = \"\"\nthreads = {args.threads}\n"
                      f"n_ctx = {args.n_ctx}\ncpu_max_batch_size = 1\nprefix_cache_dir = {json.dumps(str(tmp / 'disk'))}\n"
                      f"admin_socket = {json.dumps(str(tmp / 'admin.sock'))}\nlog_level = \"info\"\n")
    out: dict = {"turns": []}
    for part in ((0, 1), (2, 3)):
        daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), log_dir=str(tmp))
        try:
            with urllib.request.urlopen(daemon.url + "/v1/models") as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            for k in part:
                out["turns"].append(turn(daemon.url, model, prompts[k]))
            if part[0] == 2:  # after the turns: nothing it leaves behind may help them
                out["full_prefill_s"], _ = turn(daemon.url, model, prompts[2], cache=False)
            with urllib.request.urlopen(daemon.url + "/v1/syshax/status") as resp:
                out.setdefault("disk", []).append(json.loads(resp.read())["prefix_cache"]["disk"])
        finally:
            await stop_daemon(daemon.process)
    return out


def peer(args, prompts: list[str], tmp: Path) -> dict:
    out: dict = {"turns": []}
    for part in ((0, 1), (2, 3)):
        port = free_port()
        argv = [str(args.peer), "-m", str(args.model), "-t", str(args.threads), "-tb", str(args.threads),
                "-c", str(args.n_ctx), "-np", "1", "-fa", "on", "--cache-ram", "8192", "--host", "127.0.0.1",
                "--port", str(port)]
        with open(tmp / "llama-server.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url)
            for k in part:
                out["turns"].append(turn(url, "m", prompts[k]))
            if part[0] == 2:  # after the turns: llama-server keeps even an uncached prompt in its slot
                out["full_prefill_s"], _ = turn(url, "m", prompts[2], cache=False)
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct.q4_0.gguf")
    p.add_argument("--words", type=int, default=2400, help="the first turn's prompt, in words of the session")
    p.add_argument("--grow", type=int, default=200, help="words added each turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--peer", type=Path, default=PEER, help="llama-server (../shared/tools/llama-server.sh builds it)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/prefix_disk.json")
    args = p.parse_args()
    prompts = session(args.words, args.grow)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-disk-") as name:
        tmp = Path(name)
        result = {"ours": asyncio.run(ours(args, prompts, tmp))}
        if args.peer.exists():
            result["llama-server"] = peer(args, prompts, tmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'turn':>4} {'syshaxd s':>10} {'cached':>7} {'llama-server s':>15} {'cached':>7} {'ratio':>6}")
    for k in range(4):
        s, c = result["ours"]["turns"][k]
        peer_turn = result.get("llama-server", {}).get("turns", [(0, 0)] * 4)[k]
        ratio = f"{peer_turn[0] / s:.2f}x" if peer_turn[0] else "-"
        note = "  (after a restart)" if k == 2 else ""
        print(f"{k:>4} {s:>10.3f} {c:>7} {peer_turn[0]:>15.3f} {peer_turn[1]:>7} {ratio:>6}{note}")
    full = result["ours"]["full_prefill_s"]
    print(f"syshaxd: turn 2 after the restart {full / result['ours']['turns'][2][0]:.1f}x faster than its full "
          f"prefill ({full:.3f} s)")
    if "llama-server" in result:
        pf = result["llama-server"]["full_prefill_s"]
        print(f"llama-server: turn 2 after the restart {pf / result['llama-server']['turns'][2][0]:.1f}x faster than "
              f"its full prefill ({pf:.3f} s)")
    print(f"disk tier after the restart: {result['ours']['disk'][-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
