"""Agents' sessions: several long contexts growing turn by turn, side requests between turns, a restart halfway;
syshaxd (its shared prefix cache and disk tier) against llama-server at its best for this load (a slot per
session, --cache-ram 8192, --spec-type ngram-simple), in one run (issue 52, item 4).

Each session is an agent: a system prompt the sessions share, a context of its own, and turns that each append the
last answer and a new message of --grow words. Between its turns each session sends a side request (a title for
its last message, 8 tokens): on a server whose cache lives in its slots, that request takes a slot and pushes a
session's context out of it. After --restart-after turns both servers restart (an upgrade, a crash) and the
sessions go on. Every turn is streamed: its TTFT, and its decode rate over --max-tokens tokens (ignore_eos).

    .venv/bin/python bench/bench_agent_sessions.py [--sessions 4] [--turns 6] [--words 2000] [--grow 300]

Ratios, not times: the machine is shared. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from syshaxd.benchmark.daemon import daemon_command, free_port, start_daemon, stop_daemon, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEER = Path.home() / ".cache/syshax-peers/llama-server-0.3.36-noamx/bin/llama-server"
SYLLABLES = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "gu") for b in ("n", "m", "st",
                                                                                                   "x", "l", "r")]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(SYLLABLES) for _ in range(n))


def stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(TTFT s, decode tokens/s after the first, text) of one streamed completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = 0.0
    text = []
    with urllib.request.urlopen(request, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece and not first:
                first = time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    return first - started, (max_tokens - 1) / max(end - first, 1e-9), "".join(text)


class Session:
    def __init__(self, index: int, system: str, args) -> None:
        self.rng = random.Random(1000 + index)
        self.prompt = system + "\n" + words(self.rng, args.words)
        self.args = args

    def turn(self, url: str, model: str) -> dict:
        ttft, rate, text = stream(url, model, self.prompt, self.args.max_tokens)
        self.prompt += text + "\n" + words(self.rng, self.args.grow)
        side = "Write a short title for this message: " + words(self.rng, 60)
        stream(url, model, side, 8)
        return {"ttft_s": ttft, "decode_tok_s": rate}


def run_turns(sessions: list[Session], turns: range, url: str, model: str, out: list) -> None:
    """Every session runs the turns in order, the sessions at once (as agents do)."""
    def one(session: Session) -> list[dict]:
        return [session.turn(url, model) | {"turn": t} for t in turns]

    with ThreadPoolExecutor(len(sessions)) as pool:
        for index, results in enumerate(pool.map(one, sessions)):
            for r in results:
                out.append(r | {"session": index})


def full_prefill(url: str, model: str, prompt: str) -> float:
    """Seconds to the first token of `prompt` run whole and alone (cache_prompt false)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "cache_prompt": False}).encode()
    started = time.perf_counter()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as resp:
        resp.read()
    return time.perf_counter() - started


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models") as resp:
        return json.loads(resp.read())["data"][0]["id"]


async def ours(args, tmp: Path) -> dict:
    config = tmp / "syshaxd.toml"
    config.write_text(f"model = {json.dumps(str(args.model))}\nquantize = \"\"\nthreads = {args.threads}\n"
                      f"n_ctx = {args.n_ctx}\ncpu_max_batch_size = {args.sessions}\n"
                      f"prefix_cache_mb = {args.prefix_cache_mb}\n"
                      f"prefix_cache_dir = {json.dumps(str(tmp / 'disk'))}\n"
                      f"admin_socket = {json.dumps(str(tmp / 'admin.sock'))}\nlog_level = \"info\"\n")
    sessions = _sessions(args)
    out: list = []
    status = []
    full = 0.0
    for turns in (range(args.restart_after), range(args.restart_after, args.turns)):
        daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), log_dir=str(tmp))
        try:
            model = model_id(daemon.url)
            run_turns(sessions, turns, daemon.url, model, out)
            with urllib.request.urlopen(daemon.url + "/v1/syshax/status") as resp:
                status.append(json.loads(resp.read())["prefix_cache"])
            if turns.stop == args.turns:  # after the turns: nothing it leaves behind may help them
                full = full_prefill(daemon.url, model, sessions[0].prompt)
        finally:
            await stop_daemon(daemon.process)
    return {"turns": out, "prefix_cache": status, "full_prefill_s": full}


def peer(args, tmp: Path) -> dict:
    sessions = _sessions(args)
    out: list = []
    full = 0.0
    for turns in (range(args.restart_after), range(args.restart_after, args.turns)):
        port = free_port()
        argv = [str(args.peer), "-m", str(args.model), "-t", str(args.threads), "-tb", str(args.threads),
                "-c", str(args.n_ctx * args.sessions), "-np", str(args.sessions), "-fa", "on", "--cache-ram", "8192",
                "--spec-type", "ngram-simple", "--host", "127.0.0.1", "--port", str(port)]
        with open(tmp / "llama-server.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url)
            run_turns(sessions, turns, url, "m", out)
            if turns.stop == args.turns:
                full = full_prefill(url, "m", sessions[0].prompt)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"argv": argv, "turns": out, "full_prefill_s": full}


def _sessions(args) -> list[Session]:
    system = "You are an agent working in a repository. " + words(random.Random(1), args.system_words)
    return [Session(i, system, args) for i in range(args.sessions)]


def by_turn(turns: list[dict], key: str) -> list[float]:
    n = max(t["turn"] for t in turns) + 1
    return [statistics.median(t[key] for t in turns if t["turn"] == k) for k in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct.q4_0.gguf")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--restart-after", type=int, default=3, help="turns before both servers restart")
    p.add_argument("--system-words", type=int, default=400, help="the system prompt the sessions share")
    p.add_argument("--words", type=int, default=2000, help="each session's own context at its first turn")
    p.add_argument("--grow", type=int, default=300, help="words each turn adds after the last answer")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="syshaxd's shared-memory tier (512: its default); the disk tier is behind it")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=8192, help="per session")
    p.add_argument("--peer", type=Path, default=PEER, help="llama-server (../shared/tools/llama-server.sh builds it)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/agent_sessions.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as name:
        tmp = Path(name)
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "ours": asyncio.run(ours(args, tmp))}
        if args.peer.exists():
            result["llama-server"] = peer(args, tmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    ours_ttft, ours_rate = by_turn(result["ours"]["turns"], "ttft_s"), by_turn(result["ours"]["turns"], "decode_tok_s")
    print(f"median over {args.sessions} sessions; the servers restart before turn {args.restart_after}")
    print(f"{'turn':>4} {'syshaxd TTFT':>12} {'tok/s':>6}", end="")
    if "llama-server" in result:
        peer_ttft = by_turn(result["llama-server"]["turns"], "ttft_s")
        peer_rate = by_turn(result["llama-server"]["turns"], "decode_tok_s")
        print(f" {'llama-server TTFT':>17} {'tok/s':>6} {'TTFT ratio':>10} {'tok/s ratio':>11}")
    else:
        print()
    for k in range(args.turns):
        print(f"{k:>4} {ours_ttft[k]:>12.3f} {ours_rate[k]:>6.1f}", end="")
        if "llama-server" in result:
            print(f" {peer_ttft[k]:>17.3f} {peer_rate[k]:>6.1f} {peer_ttft[k] / ours_ttft[k]:>9.2f}x "
                  f"{ours_rate[k] / peer_rate[k]:>10.2f}x")
        else:
            print()
    full = result["ours"]["full_prefill_s"]
    print(f"syshaxd: a full prefill of session 0's last prompt, alone: {full:.3f} s; each later turn's TTFT under "
          "the sessions' load is that over " + ", ".join(f"{full / t:.1f}" for t in ours_ttft[1:]))
    if "llama-server" in result:
        pf = result["llama-server"]["full_prefill_s"]
        print(f"llama-server: the same full prefill: {pf:.3f} s; each later turn over "
              + ", ".join(f"{pf / t:.1f}" for t in peer_ttft[1:]))
    disk = result["ours"]["prefix_cache"][-1]["disk"]
    print(f"disk tier at the end: {disk['blocks']} blocks, {disk['loaded']} read back, {disk['written']} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
