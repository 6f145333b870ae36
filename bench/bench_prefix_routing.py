"""Prefix-aware placement over a pool of engines with their own prefix caches, against least-loaded placement.

One gpu-mode daemon per setting (prefix_routing true, then false), the same otherwise: two vLLM engines (its CPU
build here), one on each CPU (prefill_cpu_affinity "0;1"), each with vLLM's own automatic prefix caching. The load:
several conversations at once, each of several turns, every turn sending the whole conversation so far (a long
shared system prompt, then the turns) as a chat client does. A turn hits vLLM's prefix cache only on the engine
that ran the conversation's turn before. Prints the prompt tokens the engines found cached, TTFT of the later turns
(p50, p99) and output tok/s; writes bench/results/bench_prefix_routing.json.

    .venv/bin/python bench/bench_prefix_routing.py           # about 6 minutes on 2 quiet cores
    .venv/bin/python bench/bench_prefix_routing.py --prefill-engine llamacpp   # a shared block store: no difference
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.client import StreamingClient  # noqa: E402
from syshaxd.benchmark.daemon import start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.benchmark.resources import describe_machine, save_figures  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-engine", default="vllm", help="the pool's backend (default: vllm)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=600, help="each conversation's own system prompt")
    p.add_argument("--message-tokens", type=int, default=60)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--json", default=str(REPO / "bench/results/bench_prefix_routing.json"))
    return p.parse_args(argv)


def quantile(values, q):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def conversations(url: str, args, builder: PromptBuilder) -> dict:
    client = StreamingClient(url, "SmolLM2-135M-Instruct", args.output_len, endpoint="chat")
    start = time.perf_counter()
    records = []
    rng = random.Random(5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": builder.build(args.system_tokens, 7000 + c).text}]
            await asyncio.sleep(rng.uniform(0, 2))  # people start, read and answer at their own pace
            for turn in range(1, args.turns + 1):
                messages.append({"role": "user", "content": builder.build(args.message_tokens, 100 * c + turn).text})
                pieces: list[str] = []
                n_out = rng.randint(args.output_len // 2, args.output_len * 2)
                record = await client.send(session, c * 100 + turn, builder.build(1, 0), start, n_out,
                                           messages=messages, text_out=pieces)
                await asyncio.sleep(rng.uniform(0.2, 1.5))
                record.turn = turn
                records.append(record)
                messages.append({"role": "assistant", "content": "".join(pieces)})

        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
        async with session.get(f"{url}/v1/syshax/status") as resp:
            status = await resp.json()
    wall = time.perf_counter() - start
    engines = [w for w in status["workers"] if w["pool"] == "gpu"]
    later = [r.ttft_s for r in records if r.turn and r.turn > 1]
    return {"wall_s": round(wall, 1), "failed": sum(not r.ok for r in records),
            "output_tok_s": round(sum(r.output_tokens for r in records if r.ok) / wall, 2),
            "prompt_tokens": sum(w["stats"]["prompt_tokens"] for w in engines),
            "cached_tokens": sum(w["stats"]["cached_tokens"] for w in engines),
            "later_turns_ttft_ms": {"p50": _ms(quantile(later, 0.5)), "p99": _ms(quantile(later, 0.99))},
            "per_engine": {w["name"]: w["stats"]["finished"] for w in engines},
            "prefix_routing": status.get("prefix_routing", {})}


def _ms(s):
    return round(1000 * s, 1) if s is not None else None


async def one(setting: bool, args, builder, tmp: Path) -> dict:
    config = tmp / f"routing-{setting}.toml"
    config.write_text(f'mode = "gpu"\nprefill_engine = "{args.prefill_engine}"\nprefill_cpu_affinity = "0;1"\n'
                      f'max_num_seqs = 4\nn_ctx = 2048\nprefix_routing = {str(setting).lower()}\n'
                      f'model_dir = "{REPO / "models"}"\n')
    daemon = await start_daemon("gpu", command=[sys.executable, "-m", "syshaxd"], config=str(config),
                                startup_timeout_s=900, log_dir=str(tmp))
    try:
        return await conversations(daemon.url, args, builder)
    finally:
        await stop_daemon(daemon.process)


def main(argv=None) -> int:
    args = parse_args(argv)
    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-routing-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rows = {}
    for setting in (True, False):
        name = "by prefix" if setting else "least loaded"
        rows[name] = r = asyncio.run(one(setting, args, builder, tmp))
        print(f"{name:<13} cached {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens; later turns TTFT p50 "
              f"{r['later_turns_ttft_ms']['p50']} p99 {r['later_turns_ttft_ms']['p99']} ms; {r['output_tok_s']} "
              f"tok/s; failed {r['failed']}; per engine {r['per_engine']}; {r['prefix_routing']}", flush=True)
    print("\n| placement | cached prompt tokens | later turns TTFT p50 / p99 (ms) | output tok/s |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['cached_tokens']} of {r['prompt_tokens']} ({r['cached_tokens'] / max(1, r['prompt_tokens']):.0%})"
              f" | {r['later_turns_ttft_ms']['p50']} / {r['later_turns_ttft_ms']['p99']} | {r['output_tok_s']} |")
    load = save_figures(args.json, started, args, rows)
    print(f"\n{describe_machine().get('cpu_model', '')} {os.cpu_count()} CPUs; pool: 2 x {args.prefill_engine}; load "
          f"average at the end {load[0]:.2f}")
    print(f"figures in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
