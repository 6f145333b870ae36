"""Embeddings per second: syshaxd's /v1/embeddings (an embedding model of [[models]]) against llama.cpp's
`llama-server --embeddings` on the same GGUF and threads, in one run; prints a table and writes
bench/results/bench_embeddings.json.

The model: Qwen3-Embedding-0.6B's shape (tests/families.py's qwen3-embedding-0.6b-shape: 28 layers, hidden 1024,
last-token pooling, random weights, SmolLM2's vocabulary) in Q8_0, as Qwen ships its GGUF; made once into
models/bench. `--model FILE` takes another. syshaxd runs one input a pass, taking requests' inputs in turn;
llama-server gets 8 slots (`-np 8`, `--peer-slots` changes it), which it fills from every request waiting. 512
tokens an input at most, flash attention, 2 threads each.

The inputs are documents of 30 to 120 words (about 40 to 160 tokens) drawn from a fixed word list, the same on
both servers. The loads, each run on one server and then the other, the first alternating from load to load:

* batch 1, one client: one input a request, each sent when the last is answered (a query's path);
* batch 1, 8 clients: one input a request, 8 requests in flight (many users' queries at once);
* batch 32, one client: 32 inputs a request (indexing documents).

The vectors of both servers are compared (cosine) on the first inputs, so that the figures are of the same work.

    .venv/bin/python bench/bench_embeddings.py            # about 3 minutes on 2 quiet cores
    .venv/bin/python bench/bench_embeddings.py --quick    # fewer requests: a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench_peers import find_llama_server, wait_healthy  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, free_port, start_daemon, stop_daemon  # noqa: E402

N_CTX = 512
WORDS = ("server memory model token vector search query document index cluster node socket thread kernel cache "
         "batch prompt answer latency throughput request engine worker config schema retrieval embedding score "
         "rank field table column row file folder network packet route policy budget metric alert trace span "
         "river mountain forest ocean city street market garden winter summer morning evening history science "
         "language music painting theatre number letter paper pencil window door kitchen table chair").split()


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))).capitalize() + "." for _ in range(n)]


class Load:
    def __init__(self, name: str, batch: int, clients: int, requests: int) -> None:
        self.name, self.batch, self.clients, self.requests = name, batch, clients, requests


async def run_load(url: str, model: str, load: Load, texts: list[str]) -> dict:
    """Embeddings per second and request latency of one load on one server."""
    bodies = [{"model": model, "input": texts[i * load.batch:(i + 1) * load.batch] if load.batch > 1
               else texts[i], "encoding_format": "base64"} for i in range(load.requests)]
    return await timed_posts(url + "/v1/embeddings", bodies, load, "embeddings")


async def timed_posts(url: str, bodies: list[dict], load: Load, unit: str, total_s: float = 600) -> dict:
    """The bodies posted to url by load.clients clients, each sending its next when the last is answered: `unit`
    (load.requests * load.batch of them) a second, and the requests' latency."""
    latencies: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            started = time.perf_counter()
            async with session.post(url, json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: {resp.status} {answer}")
            latencies.append(time.perf_counter() - started)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_s)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(load.clients)))
        elapsed = time.perf_counter() - started
    count = load.requests * load.batch
    return {unit: count, "seconds": round(elapsed, 3), f"{unit}_per_s": round(count / elapsed, 2),
            "latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
            "latency_p99_ms": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))] * 1000, 1)}


async def in_turns(servers: dict[str, str], loads: list[Load], unit: str, run) -> list[dict]:
    """Each load on each server (syshaxd and llama-server), the first alternating from load to load; run(url, load,
    i) gives timed_posts' figures. A row a load, with syshaxd's `unit` a second over llama-server's, printed too."""
    rows = []
    for i, load in enumerate(loads):
        order = list(servers) if i % 2 == 0 else list(servers)[::-1]
        row = {"load": load.name}
        for name in order:
            row[name] = await run(servers[name], load, i)
        ours, peer = row["syshaxd"], row["llama-server"]
        row["ratio"] = round(ours[f"{unit}_per_s"] / peer[f"{unit}_per_s"], 2)
        rows.append(row)
        print(f"{load.name:<24} syshaxd {ours[f'{unit}_per_s']:8.2f}/s  llama-server {peer[f'{unit}_per_s']:8.2f}/s  "
              f"ratio {row['ratio']:.2f}x  (p50 {ours['latency_p50_ms']:.0f} / {peer['latency_p50_ms']:.0f} ms)",
              flush=True)
    return rows


def arguments(description: str, name: str, model_help: str, quick_help: str) -> argparse.ArgumentParser:
    """The command line bench_embeddings.py and bench_rerank.py share (`name`: the log folder's and results' name)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help=model_help)
    p.add_argument("--llama-server", help="the llama-server binary (default: built by ../shared/tools)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-slots", type=int, default=8, help="llama-server's -np (default 8)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--log-dir", default=f"/tmp/{name}", help="the servers' logs")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / f"{name}.json"))
    return p


def write_results(out: str, results: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in a fresh clone
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


async def vectors(url: str, model: str, texts: list[str]) -> np.ndarray:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/embeddings", json={"model": model, "input": texts,
                                                              "encoding_format": "float"}) as resp:
            answer = await resp.json()
    rows = np.array([d["embedding"] for d in answer["data"]], dtype=np.float64)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)  # llama-server's are normalized too; be sure


async def start_peer(binary: str, model: Path, threads: int, slots: int, log_dir: Path,
                     flags: tuple[str, ...] = ("--embeddings", "--pooling", "last")) -> tuple[str, subprocess.Popen]:
    """llama-server on the model with `flags` (an embedding model's by default; bench_rerank.py: --reranking)."""
    port = free_port()
    argv = [binary, "-m", str(model), *flags, "-t", str(threads), "-tb", str(threads),
            "-c", str(N_CTX * slots), "-np", str(slots), "-b", str(N_CTX * slots), "-ub", str(N_CTX),
            "-fa", "on", "--host", "127.0.0.1", "--port", str(port)]
    log = log_dir / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(url, proc, log)
    return url, proc


async def start_ours(model: Path, threads: int, log_dir: Path, name: str = "embed",
                     written_by: str = "bench/bench_embeddings.py: the default chat model (idle) and the embedding "
                                       "model"):
    """syshaxd with the model as the [[models]] entry `name`, beside the idle default chat model."""
    config = log_dir / "syshaxd.toml"
    config.write_text(
        f"# written by {written_by}\n"
        f"model_dir = {json.dumps(str(REPO / 'models'))}\n"
        "threads = 1\n"
        f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"
        f'[[models]]\nname = "{name}"\npath = {json.dumps(str(model))}\nn_ctx = {N_CTX}\n'
        f"threads = {threads}\n")
    return await start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                              log_dir=str(log_dir))


def default_model() -> Path:
    import families

    return families.make_shape_model("qwen3-embedding-0.6b-shape", REPO / "models" / "bench", quant="q8_0")


async def main_async(args: argparse.Namespace) -> dict:
    model = Path(args.model) if args.model else default_model()
    binary = find_llama_server(args.llama_server)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    scale = 4 if args.quick else 1
    loads = [Load("batch 1, 1 client", 1, 1, 64 // scale), Load("batch 1, 8 clients", 1, 8, 128 // scale),
             Load("batch 32, 1 client", 32, 1, 8 // scale)]
    peer_url, peer = await start_peer(binary, model, args.threads, args.peer_slots, log_dir)
    ours = await start_ours(model, args.threads, log_dir)
    servers = {"syshaxd": ours.url, "llama-server": peer_url}
    results: dict = {"model": str(model), "threads": args.threads, "peer_slots": args.peer_slots, "loads": []}
    try:
        check = documents(16, seed=7)
        a, b = await vectors(ours.url, "embed", check), await vectors(peer_url, "embed", check)
        results["cosine_min"] = round(float(np.min(np.sum(a * b, axis=1))), 5)
        for warm in servers.values():  # one request each, so that neither pays a first pass in the figures
            await run_load(warm, "embed", Load("warm", 8, 1, 1), documents(8, seed=1))
        results["loads"] = await in_turns(servers, loads, "embeddings", lambda url, load, i: run_load(
            url, "embed", load, documents(load.requests * load.batch, seed=100 + i)))
    finally:
        await stop_daemon(ours.process)
        await stop_daemon(peer, grace_s=15)
    return results


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "bench_embeddings", "an embedding GGUF (default: Qwen3-Embedding-0.6B's "
                     "shape in Q8_0, made once)", "a quarter of the requests").parse_args(argv)
    results = asyncio.run(main_async(args))
    print(f"vectors of the two servers: cosine at least {results['cosine_min']}")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
