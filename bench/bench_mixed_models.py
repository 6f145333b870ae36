"""Several models in one daemon under a mixed load: does each model keep the time to first token (TTFT) it has when
its traffic is the only traffic? One daemon serves a chat model of its own, a second chat model of [[models]] (a
daemon of its own) and an embedding model; each gets its own stream of requests, with arrivals spread at random
(a Poisson process), prompts unique or sharing a long prefix, and answers of random lengths. Each model's stream is
sent alone, then all three at once; the figure is each model's p99 together over its p99 alone (the issue asks for
at most 1.5).

The CPUs are split as models/docs advise for models busy at once: the daemon's own chat model on CPU 0, the second
chat model on CPU 1, the embedding model on CPU 0 beside the first.

    .venv/bin/python bench/bench_mixed_models.py      # about 5 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiohttp  # noqa: E402

from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402

SHARED = ("You are a helpful assistant for a hardware store. Answer briefly and name the aisle where the item is. "
          "The aisles are: 1 tools, 2 paint, 3 garden, 4 plumbing, 5 electrical, 6 lumber, 7 fasteners. ") * 3
QUESTIONS = ["Where are the hammers?", "I need white paint for a fence.", "Do you sell hose fittings?",
             "Where can I find light switches?", "I want pine boards.", "Which aisle has wood screws?",
             "Where are the rakes?", "Do you have pipe wrenches?"]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def chat_ttft(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random) -> float:
    question = rng.choice(QUESTIONS)
    prompt = SHARED + question if rng.random() < 0.5 else f"Request {rng.random():.6f}: {question} " * 4
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(16, 64),
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content": "' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{model}: no token in the stream")
    return first


async def embed_time(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random) -> float:
    texts = [f"{rng.choice(QUESTIONS)} {rng.random():.6f}" for _ in range(rng.randint(1, 4))]
    started = time.perf_counter()
    async with session.post(url + "/v1/embeddings", json={"model": model, "input": texts}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{model}: {resp.status} {await resp.text()}")
        await resp.read()
    return time.perf_counter() - started


async def stream(session, url: str, model: str, kind: str, rate: float, seconds: float, seed: int) -> list[float]:
    """Requests to `model` arriving at `rate` a second (Poisson) for `seconds`; each one's TTFT (a chat model) or
    time (an embedding model)."""
    rng = random.Random(seed)
    tasks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        call = chat_ttft if kind == "chat" else embed_time
        tasks.append(asyncio.ensure_future(call(session, url, model, random.Random(rng.random()))))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def main_async(args: argparse.Namespace) -> dict:
    import families
    from syshaxd.model import prepare_default_model
    from syshaxd.sdk.gguf.quantize import ensure_quantized

    own = ensure_quantized(prepare_default_model(REPO / "models"), "q4_0", REPO / "models")
    second = REPO / "models" / "bench" / "SmolLM2-135M-Instruct.q4_k_m.gguf"
    if not second.is_file():
        second = own
    embed = families.make_family_model("qwen3-embedding", REPO / "models" / "families")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "syshaxd.toml"
    config.write_text(f"model_dir = {json.dumps(str(REPO / 'models'))}\nmodel_name = \"own\"\n"
                      f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"
                      'n_ctx = 2048\ncpu_affinity = "0"\n'
                      f'[[models]]\nname = "second"\npath = {json.dumps(str(second))}\ncpu_affinity = "1"\n'
                      f'[[models]]\nname = "embed"\npath = {json.dumps(str(embed))}\nn_ctx = 256\n'
                      'cpu_affinity = "0"\n')
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), log_dir=str(log_dir),
                                model=str(own))
    loads = {"own": ("chat", args.rate), "second": ("chat", args.rate), "embed": ("embedding", 2 * args.rate)}
    results: dict = {"alone": {}, "together": {}}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for name, (kind, rate) in loads.items():  # a warm-up, then each alone
                await stream(session, daemon.url, name, kind, rate, 5, 0)
            for i, (name, (kind, rate)) in enumerate(loads.items()):
                times = await stream(session, daemon.url, name, kind, rate, args.seconds, 100 + i)
                results["alone"][name] = times
                print(f"{name} alone: {len(times)} requests, p50 {quantile(times, 0.5) * 1000:.0f} ms, p99 "
                      f"{quantile(times, 0.99) * 1000:.0f} ms", flush=True)
            together = await asyncio.gather(*(stream(session, daemon.url, name, kind, rate, args.seconds, 200 + i)
                                              for i, (name, (kind, rate)) in enumerate(loads.items())))
            for name, times in zip(loads, together):
                results["together"][name] = times
                alone = results["alone"][name]
                ratio = quantile(times, 0.99) / quantile(alone, 0.99)
                print(f"{name} together: {len(times)} requests, p50 {quantile(times, 0.5) * 1000:.0f} ms, p99 "
                      f"{quantile(times, 0.99) * 1000:.0f} ms: p99 {ratio:.2f}x alone", flush=True)
    finally:
        await stop_daemon(daemon.process)
    return {"rate": args.rate, "seconds": args.seconds, "times": results,
            "p99_ratio": {n: round(quantile(results["together"][n], 0.99) / quantile(results["alone"][n], 0.99), 3)
                          for n in loads}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1.0, help="chat requests a second to each chat model (default 1; "
                   "the embedding model gets twice as many)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each stream sends (default 60)")
    p.add_argument("--log-dir", default="/tmp/bench_mixed_models")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_mixed_models.json"))
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
