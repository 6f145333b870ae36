"""What loading an embedding model on demand costs, and what unloading it gives back: the first request's time when
it has to load the model, a warm request's, and the daemon's resident memory (its process and workers) before the
load, loaded, and after an unload; then the same again (a model loaded a second time, as keep_alive makes it).

The model: Qwen3-Embedding-0.6B's shape in Q8_0 (tests/families.py; made once into models/bench), a [[models]]
entry with load = "on_demand" beside the default chat model; one input of about 100 tokens a request.

    .venv/bin/python bench/bench_model_load.py      # about 1 minute
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

from syshaxd.bench.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402

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


async def main_async(args: argparse.Namespace) -> dict:
    if args.model:
        model = Path(args.model)
    else:
        import families

        model = families.make_shape_model("qwen3-embedding-0.6b-shape", REPO / "models" / "bench", quant="q8_0")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "syshaxd.toml"
    config.write_text(f"model_dir = {json.dumps(str(REPO / 'models'))}\n"
                      f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"
                      f'[[models]]\nname = "embed"\npath = {json.dumps(str(model))}\nn_ctx = 512\n'
                      'load = "on_demand"\n')
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), log_dir=str(log_dir))
    body = {"model": "embed", "input": TEXT, "encoding_format": "base64"}
    rounds = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for _ in range(2):
                before = rss_mib(daemon.pid)
                cold = await timed(session, daemon.url + "/v1/embeddings", body)
                warm = min([await timed(session, daemon.url + "/v1/embeddings", body) for _ in range(3)])
                loaded = rss_mib(daemon.pid)
                started = time.perf_counter()
                async with session.post(daemon.url + "/models/unload", json={"model": "embed"}) as resp:
                    assert resp.status == 200, await resp.text()
                unload = time.perf_counter() - started
                await asyncio.sleep(1.0)
                after = rss_mib(daemon.pid)
                rounds.append({"first_request_s": round(cold, 3), "warm_request_s": round(warm, 3),
                               "load_s": round(cold - warm, 3), "unload_s": round(unload, 3),
                               "rss_before_mib": before, "rss_loaded_mib": loaded, "rss_after_unload_mib": after})
                r = rounds[-1]
                print(f"first request {cold:.2f} s (warm {warm:.2f} s: the load {cold - warm:.2f} s); RSS "
                      f"{before} -> {loaded} MiB loaded -> {after} MiB after the unload ({unload:.2f} s)",
                      flush=True)
    finally:
        await stop_daemon(daemon.process)
    return {"model": str(model), "file_mib": model.stat().st_size >> 20, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an embedding GGUF (default: Qwen3-Embedding-0.6B's shape in Q8_0, made once)")
    p.add_argument("--log-dir", default="/tmp/bench_model_load")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_model_load.json"))
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
