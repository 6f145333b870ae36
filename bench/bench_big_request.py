"""A 4 MB request must not slow the working streams: 8 streams alone, then while 4 MB bodies arrive.

Starts one syshaxd in cpu mode (default limits: max_body_bytes 4 MiB, max_string_bytes 1 MiB),
runs 8 concurrent streamed completions (unique prompts, forced length) alone, then the same 8
streams again while bodies just under max_body_bytes arrive round robin until the streams end: a
4 MB prompt string, four messages of 1 MB each, a prompt of a million token ids, and one byte over
the limit; then once beside each of those alone; then alone once more. One big body at a time,
--gap seconds after the last one's answer (0: back to back, a flood of gigabytes that client and
daemon parse on the same CPUs as the streams). Prints each big input's status, code and time to
answer, the workers' restarts, and TPOT p50/p90 of each stream run against the runs alone; writes
JSON under bench/results/.

  .venv/bin/python bench/bench_big_request.py [--streams 8] [--output-len 128] [--gap 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from syshaxd.benchmark.client import list_models, run_streams  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder  # noqa: E402
from syshaxd.config import Config  # noqa: E402

MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
MAX_BODY = Config().max_body_bytes
MAX_STRING = Config().max_string_bytes


def _words(n: int) -> str:
    return ("lorem ipsum dolor sit amet " * (n // 27 + 1))[:n]


def big_inputs(model: str) -> dict[str, tuple[str, bytes]]:
    """name -> (endpoint, raw body): each just under max_body_bytes, but the last, one byte over."""
    def sized(endpoint: str, build, size: int) -> tuple[str, bytes]:
        empty = len(json.dumps(build(0)).encode())
        raw = json.dumps(build(size - empty)).encode()
        return endpoint, raw + b" " * (size - len(raw))  # trailing whitespace makes the size exact

    under = MAX_BODY - 64
    return {
        "prompt: one 4 MB string": sized("completions", lambda n: {"model": model, "prompt": _words(n),
                                                                   "max_tokens": 4}, under),
        # each message within max_string_bytes: only the context can refuse them
        "chat: 4 messages of 1 MB": sized("chat/completions", lambda n: {"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": _words(n // 4 + (n % 4 if i == 0 else 0))} for i in range(4)]}, under),
        "prompt: a million token ids": sized("completions", lambda n: {"model": model, "max_tokens": 4,
                                                                       "prompt": [42] * max(n // 4, 1)}, under),
        "body: 1 byte over max_body_bytes": sized("completions", lambda n: {"model": model, "prompt": "hi",
                                                                            "pad": "x" * n}, MAX_BODY + 1),
    }


async def restarts(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/v1/syshax/status") as resp:
        return sum(w["restarts"] + w["hangs"] for w in (await resp.json())["workers"])


async def send_big(session: aiohttp.ClientSession, url: str, endpoint: str, raw: bytes) -> tuple[int, str, float]:
    """(status, error code, seconds to the whole answer) of one raw body."""
    started = time.perf_counter()
    async with session.post(f"{url}/v1/{endpoint}", data=raw, headers={"Content-Type": "application/json"}) as resp:
        body = await resp.json(content_type=None)
    return resp.status, (body.get("error") or {}).get("code") or "", time.perf_counter() - started


async def streams_beside_big(url: str, prompts, output_len: int, inputs: dict, gap: float) -> tuple[dict, dict]:
    """The streams, with the big inputs sent round robin, one at a time and gap seconds apart, until they end."""
    answers: dict[str, list] = {name: [] for name in inputs}
    streams = asyncio.create_task(run_streams(url, prompts, output_len))
    await asyncio.sleep(0.5)  # the streams are admitted and decoding
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        while not streams.done():
            for name, (endpoint, raw) in inputs.items():
                answers[name].append(await send_big(session, url, endpoint, raw))
                if streams.done():
                    break
                await asyncio.wait([streams], timeout=gap)
    return await streams, answers


async def main(args: argparse.Namespace) -> dict:
    builder = PromptBuilder(GGUFTokenizer(args.model))
    (REPO / "bench" / "results").mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_big_", dir=REPO / "bench" / "results"))
    config = log_dir / "syshaxd.toml"
    config.write_text(f"model = {json.dumps(str(args.model))}\nmodel_dir = {json.dumps(str(args.model.parent))}\n"
                      f"quantize = \"\"\nthreads = {args.threads}\ncpu_max_batch_size = {args.streams}\n"
                      f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n")
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                                log_dir=str(log_dir))
    result: dict = {"runs": {}, "big": {}}
    try:
        url = daemon.url

        def prompts(k):
            return [builder.build(args.input_len, 1000 * k + i) for i in range(args.streams)]

        async with aiohttp.ClientSession() as session:
            model = (await list_models(session, url))[0]
            before = await restarts(session, url)
        inputs = big_inputs(model)
        await run_streams(url, prompts(9), 8)  # warm-up
        result["runs"]["alone (before)"] = await run_streams(url, prompts(0), args.output_len)
        result["runs"]["during all four, round robin"], answers = await streams_beside_big(
            url, prompts(1), args.output_len, inputs, args.gap)
        for k, name in enumerate(inputs, start=3):  # which input costs the streams what
            result["runs"][f"during {name}"], alone_answers = await streams_beside_big(
                url, prompts(k), args.output_len, {name: inputs[name]}, args.gap)
            answers[name] += alone_answers[name]
        await asyncio.sleep(1)
        result["runs"]["alone (after)"] = await run_streams(url, prompts(2), args.output_len)
        async with aiohttp.ClientSession() as session:
            result["restarts"] = await restarts(session, url) - before
        for name, got in answers.items():
            result["big"][name] = {"bytes": len(inputs[name][1]), "sent": len(got),
                                   "answers": sorted({f"{s} {c}".strip() for s, c, _ in got}),
                                   "p50_s": statistics.median(t for _, _, t in got) if got else None,
                                   "max_s": max((t for _, _, t in got), default=None)}
    finally:
        await stop_daemon(daemon.process)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gap", type=float, default=1.0,
                   help="seconds between one big body's answer and the next (0: back to back, a flood)")
    return p.parse_args(argv)


def print_tables(result: dict) -> None:
    print("| input | bytes | sent | answer | time p50 s | time max s |\n|---|---:|---:|---|---:|---:|")
    for name, b in result["big"].items():
        p50 = "-" if b["p50_s"] is None else f"{b['p50_s']:.2f}"
        top = "-" if b["max_s"] is None else f"{b['max_s']:.2f}"
        print(f"| {name} | {b['bytes']:,} | {b['sent']} | {', '.join(b['answers']) or '-'} | {p50} | {top} |")
    print(f"\nworker restarts during the run: {result['restarts']}\n")
    runs = result["runs"]
    alone = {k: statistics.mean(r[k] for name, r in runs.items() if name.startswith("alone"))
             for k in ("tpot_p50_ms", "tpot_p90_ms")}
    print("| run | ok | tok/s | TPOT p50 ms | TPOT p90 ms | p50 / alone | p90 / alone |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['ok']}/{r['requests']} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.2f} | "
              f"{r['tpot_p90_ms']:.2f} | {r['tpot_p50_ms'] / alone['tpot_p50_ms']:.2f}x | "
              f"{r['tpot_p90_ms'] / alone['tpot_p90_ms']:.2f}x |")


if __name__ == "__main__":
    result = asyncio.run(main(parse_args()))
    print_tables(result)
    out = REPO / "bench" / "results" / "bench_big_request.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"figures: {out}")
