"""Requests against a decode worker that dies: a hetero (or cpu) daemon serves the same load twice, undisturbed and
with its decode worker SIGKILLed twice mid-run; prints what each request got, and writes
bench/results/bench_worker_deaths[-cpu].json.

The load (issue 21's): 300 greedy completions at concurrency 16, unique prompts, max_tokens staggered from 32 to
96 so that requests finish in scattered order. In the disturbed run decode0 is killed once a third and again once
two thirds of the requests are answered (each time while it decodes). Every request should be answered 200 with
the text of the undisturbed run (engine/journey.py resumes it on the restarted decoder with its tokens so far); the
cost is the restarts' time, as the ratio of the two runs' wall times.

    .venv/bin/python bench/bench_worker_deaths.py                 # about 3 minutes on 2 quiet cores
    .venv/bin/python bench/bench_worker_deaths.py --mode cpu      # cpu0 killed instead of hetero's decode0
    .venv/bin/python bench/bench_worker_deaths.py --requests 60   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402

MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
SUBJECTS = ["the sea", "a library", "winter", "a bridge", "trains", "bees", "a market", "the moon", "clocks", "rain"]


def load(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"Request {i}: write a few sentences about {SUBJECTS[i % len(SUBJECTS)]}.",
             "max_tokens": rng.randint(32, 96), "temperature": 0, "ignore_eos": True} for i in range(n)]


async def ask(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with session.post(f"{url}/v1/completions", json={"model": "bench"} | body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            return resp.status, answer.get("error", {}).get("message", "")
        return 200, answer["choices"][0]["text"]


async def status(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/syshax/status") as resp:
        return await resp.json()


async def run(url: str, bodies: list[dict], concurrency: int, kills: int = 0,
              victim: str = "decode0") -> tuple[list, float, list[int]]:
    """Every body's (status, text), the wall time, and the pids killed (each while the decoder decodes)."""
    gate = asyncio.Semaphore(concurrency)
    done = 0
    killed: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(body):
            nonlocal done
            async with gate:
                got = await ask(session, url, body)
            done += 1
            return got

        async def killer():
            for k in range(1, kills + 1):
                while done < len(bodies) * k // (kills + 1):
                    await asyncio.sleep(0.05)
                while True:  # a ready decoder with sequences running: the kill lands mid-stream
                    w = next(w for w in (await status(session, url))["workers"] if w["name"] == victim)
                    if w["state"] == "ready" and w["pid"] not in killed and w["in_flight"] >= 4:
                        break
                    await asyncio.sleep(0.05)
                os.kill(w["pid"], signal.SIGKILL)
                killed.append(w["pid"])

        started = time.perf_counter()
        answers = asyncio.gather(*(one(b) for b in bodies))
        await asyncio.gather(answers, killer())
        return answers.result(), time.perf_counter() - started, killed


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kills", type=int, default=2, help="times the decoder is killed in the second run (0: a "
                        "control run, which says how far two undisturbed runs of this load agree)")
    parser.add_argument("--mode", choices=("hetero", "cpu"), default="hetero",
                        help="hetero: decode0 is killed; cpu: cpu0 (the one worker that does both phases)")
    parser.add_argument("--model", default=str(MODEL))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "syshax.toml"
        config.write_text('model_name = "bench"\nprefill_cpu_affinity = "0"\nworker_restart_delay = 0.5\n')
        daemon = await start_daemon(args.mode, command=daemon_command(), config=str(config), model=args.model,
                                    log_dir=tmp)
        victim = "decode0" if args.mode == "hetero" else "cpu0"
        try:
            bodies = load(args.requests)
            quiet, quiet_s, _ = await run(daemon.url, bodies, args.concurrency)
            async with aiohttp.ClientSession() as session:
                before = (await status(session, daemon.url))["rescued"]
            disturbed, disturbed_s, killed = await run(daemon.url, bodies, args.concurrency, kills=args.kills,
                                                       victim=victim)
            async with aiohttp.ClientSession() as session:
                after = (await status(session, daemon.url))["rescued"]
        finally:
            await stop_daemon(daemon.process)
    statuses = Counter(s for s, _ in disturbed)
    same = sum(1 for (s, t), (qs, qt) in zip(disturbed, quiet) if s == qs == 200 and t == qt)
    rescued = {k: after[k] - before[k] for k in after}
    figures = {"mode": args.mode, "requests": args.requests, "concurrency": args.concurrency,
               "decoders_killed": len(killed),
               "answered_200": statuses[200], "errors": {str(k): v for k, v in statuses.items() if k != 200},
               "text_as_undisturbed": same, "rescued": rescued, "undisturbed_s": round(quiet_s, 1),
               "disturbed_s": round(disturbed_s, 1), "wall_ratio": round(disturbed_s / quiet_s, 2)}
    print("| requests | killed | answered 200 | errors | text as undisturbed | resent / resumed / lost | wall ratio |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.requests} at c={args.concurrency} | {victim} x{len(killed)} | {statuses[200]} | "
          f"{figures['errors'] or 0} | {same} | {rescued['resent']} / {rescued['resumed']} / {rescued['lost']} | "
          f"{figures['wall_ratio']} ({quiet_s:.1f} s undisturbed) |")
    differ = [i for i, ((s, t), (_, qt)) in enumerate(zip(disturbed, quiet)) if s == 200 and t != qt]
    if differ:
        i = differ[0]
        print(f"request {i} differs (of {len(differ)}):\n  undisturbed: {quiet[i][1]!r}\n  disturbed:   {disturbed[i][1]!r}")
    out = REPO / "bench" / "results" / (f"bench_worker_deaths{'-cpu' if args.mode == 'cpu' else ''}"
                                        f"{'-control' if not args.kills else ''}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if statuses[200] == same == args.requests else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
