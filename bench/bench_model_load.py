"""What loading a model of [[models]] on demand costs, and what unloading it gives back: the first request's time when
it has to load the model, a warm request's, and the daemon's resident memory (its process, its workers, and a chat
model's own daemon) before the load, loaded, and after an unload; then the same again (a model loaded a second time,
as keep_alive makes it).

--kind embedding (the default): Qwen3-Embedding-0.6B's shape in Q8_0 (tests/families.py; made once into
models/bench), one input of about 100 tokens a request.
--kind chat: two chat entries in turn, the default model (SmolLM2-135M q4_0) and Qwen2-1.5B's shape in q4_0 (made
once into models/bench); a request is a streamed chat completion of 16 tokens, timed to its first token (TTFT).

    .venv/bin/python bench/bench_model_load.py                # about 1 minute
    .venv/bin/python bench/bench_model_load.py --kind chat    # about 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402

TEXT = ("Embeddings turn a document into a vector, so that a retrieval system finds the passages nearest to a "
        "question by their meaning rather than by their words; a server that keeps a chat model and an embedding "
        "model side by side answers both kinds of request from one address.")


def rss_mib(pid: int) -> int:
    """The process's and its children's resident memory."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) >> 20


async def timed(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    started = time.perf_counter()
    async with session.post(url, json=body) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {answer}")
    return time.perf_counter() - started


async def ttft(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds to a streamed chat completion's first token."""
    started = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content": "' in line:
                first = time.perf_counter() - started
                break
        else:
            raise RuntimeError(f"{url}: no token in the stream")
        await resp.read()
    return first


def entries(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, GGUF) of each [[models]] entry the run loads and unloads."""
    import families

    bench = REPO / "models" / "bench"
    if args.model:
        return [("entry", Path(args.model))]
    if args.kind == "embedding":
        return [("embed", families.make_shape_model("qwen3-embedding-0.6b-shape", bench, quant="q8_0"))]
    from syshaxd.model import prepare_default_model
    from syshaxd.sdk.gguf.quantize import ensure_quantized

    smol = ensure_quantized(prepare_default_model(REPO / "models"), "q4_0", REPO / "models")
    return [("smollm2", smol), ("qwen2-1.5b-shape", families.make_shape_model("qwen2-1.5b-shape", bench))]


async def measure(session: aiohttp.ClientSession, daemon, kind: str, name: str) -> dict:
    """One round: a first request that loads `name`, warm ones, an unload; RSS at each step."""
    if kind == "embedding":
        url, body, clock = daemon.url + "/v1/embeddings", {"model": name, "input": TEXT,
                                                            "encoding_format": "base64"}, timed
    else:
        url, clock = daemon.url + "/v1/chat/completions", ttft
        body = {"model": name, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 16,
                "temperature": 0, "stream": True}
    before = rss_mib(daemon.pid)
    cold = await clock(session, url, body)
    warm = min([await clock(session, url, body | {"messages": [{"role": "user", "content": f"{i} {TEXT}"}]}
                            if kind == "chat" else body) for i in range(3)])
    loaded = rss_mib(daemon.pid)
    started = time.perf_counter()
    async with session.post(daemon.url + "/models/unload", json={"model": name}) as resp:
        assert resp.status == 200, await resp.text()
    unload = time.perf_counter() - started
    await asyncio.sleep(1.0)
    after = rss_mib(daemon.pid)
    what = "first token" if kind == "chat" else "first request"
    print(f"{name}: {what} {cold:.2f} s (warm {warm:.2f} s: the load {cold - warm:.2f} s); RSS {before} -> "
          f"{loaded} MiB loaded -> {after} MiB after the unload ({unload:.2f} s)", flush=True)
    return {"model": name, "first_s": round(cold, 3), "warm_s": round(warm, 3), "load_s": round(cold - warm, 3),
            "unload_s": round(unload, 3), "rss_before_mib": before, "rss_loaded_mib": loaded,
            "rss_after_unload_mib": after}


async def main_async(args: argparse.Namespace) -> dict:
    models = entries(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "syshaxd.toml"
    config.write_text(f"model_dir = {json.dumps(str(REPO / 'models'))}\n"
                      f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"
                      + "".join(f'[[models]]\nname = "{name}"\npath = {json.dumps(str(path))}\n'
                                + ("n_ctx = 512\n" if args.kind == "embedding" else "") + 'load = "on_demand"\n'
                                for name, path in models))
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), log_dir=str(log_dir))
    rounds = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for _ in range(2):
                for name, _path in models:
                    rounds.append(await measure(session, daemon, args.kind, name))
    finally:
        await stop_daemon(daemon.process)
    return {"kind": args.kind, "models": {name: {"path": str(path), "file_mib": path.stat().st_size >> 20}
                                          for name, path in models}, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("embedding", "chat"), default="embedding",
                   help="which models of [[models]] to load and unload (default embedding)")
    p.add_argument("--model", help="one GGUF of that kind instead of the default ones")
    p.add_argument("--log-dir", default="/tmp/bench_model_load")
    p.add_argument("--out", help="the JSON results (default bench/results/bench_model_load[_chat].json)")
    args = p.parse_args(argv)
    suffix = "_chat" if args.kind == "chat" else ""
    args.out = args.out or str(REPO / "bench" / "results" / f"bench_model_load{suffix}.json")
    results = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
