"""Rerank pairs per second: syshaxd's /v1/rerank (a reranker of [[models]]) against llama.cpp's
`llama-server --reranking` on the same GGUF and threads, in one run; prints a table and writes
bench/results/bench_rerank.json.

The model: Qwen3-Reranker-0.6B's shape (tests/families.py's qwen3-reranker-0.6b-shape: 28 layers, hidden 1024, rank
pooling with the yes/no classifier and Qwen3-Reranker's prompt, random weights, SmolLM2's vocabulary) in Q8_0, as
Qwen ships its GGUF; made once into models/bench. `--model FILE` takes another. syshaxd scores one pair a pass,
taking requests' documents in turn; llama-server gets 8 slots (`-np 8`, `--peer-slots` changes it), which it fills
from every pair waiting. 512 tokens a pair at most, flash attention, 2 threads each.

Each request is a query and documents of 30 to 120 words (bench_embeddings.py's), the same on both servers, with
Qwen3-Reranker's prompt around each pair (about 100 to 220 tokens). The loads, each run on one server and then the
other, the first alternating from load to load:

* 8 documents, one client: a RAG query's rerank of its retrieved passages, one after another;
* 8 documents, 4 clients: four users' queries at once;
* 32 documents, one client: a wider candidate list.

The scores of both servers are compared on a first request, so that the figures are of the same work.

    .venv/bin/python bench/bench_rerank.py            # about 7 minutes on 2 quiet cores
    .venv/bin/python bench/bench_rerank.py --quick    # half the requests
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiohttp  # noqa: E402

from bench_embeddings import Load, arguments, documents, in_turns, timed_posts, write_results  # noqa: E402
from bench_embeddings import start_ours as embedding_ours  # noqa: E402
from bench_embeddings import start_peer as embedding_peer  # noqa: E402
from bench_peers import find_llama_server  # noqa: E402
from syshaxd.benchmark.daemon import stop_daemon  # noqa: E402

QUERIES = ("which server keeps the cache", "how does the river reach the ocean", "a kernel for the batch",
           "music and painting in the evening", "the network route policy", "memory of the worker thread")


def bodies(load: Load, seed: int) -> list[dict]:
    docs = documents(load.requests * load.batch, seed)
    return [{"model": "rerank", "query": QUERIES[i % len(QUERIES)],
             "documents": docs[i * load.batch:(i + 1) * load.batch]}
            for i in range(load.requests)]


async def run_load(url: str, load: Load, seed: int) -> dict:
    """Pairs per second and request latency of one load on one server."""
    return await timed_posts(url + "/v1/rerank", bodies(load, seed), load, "pairs", total_s=900)


async def scores(url: str, body: dict) -> dict[int, float]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/rerank", json=body) as resp:
            answer = await resp.json()
    return {r["index"]: r["relevance_score"] for r in answer["results"]}


async def start_peer(binary: str, model: Path, threads: int, slots: int, log_dir: Path):
    return await embedding_peer(binary, model, threads, slots, log_dir, flags=("--reranking",))


async def start_ours(model: Path, threads: int, log_dir: Path):
    return await embedding_ours(model, threads, log_dir, name="rerank",
                                written_by="bench/bench_rerank.py: the default chat model (idle) and the reranker")


def default_model() -> Path:
    import families

    return families.make_shape_model("qwen3-reranker-0.6b-shape", REPO / "models" / "bench", quant="q8_0")


async def main_async(args: argparse.Namespace) -> dict:
    model = Path(args.model) if args.model else default_model()
    binary = find_llama_server(args.llama_server)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    scale = 2 if args.quick else 1  # a pair of ~150 tokens takes about a second on 2 cores at this shape
    loads = [Load("8 documents, 1 client", 8, 1, 4 // scale), Load("8 documents, 4 clients", 8, 4, 8 // scale),
             Load("32 documents, 1 client", 32, 1, 2 // scale)]
    peer_url, peer = await start_peer(binary, model, args.threads, args.peer_slots, log_dir)
    ours = await start_ours(model, args.threads, log_dir)
    servers = {"syshaxd": ours.url, "llama-server": peer_url}
    results: dict = {"model": str(model), "threads": args.threads, "peer_slots": args.peer_slots, "loads": []}
    try:
        check = bodies(Load("check", 8, 1, 1), seed=7)[0]
        a, b = await scores(ours.url, check), await scores(peer_url, check)
        results["score_diff_max"] = round(max(abs(a[i] - b[i]) for i in a), 6)
        results["same_order"] = sorted(a, key=lambda i: -a[i]) == sorted(b, key=lambda i: -b[i])
        for warm in servers.values():  # one request each, so that neither pays a first pass in the figures
            await run_load(warm, Load("warm", 8, 1, 1), seed=1)
        results["loads"] = await in_turns(servers, loads, "pairs", lambda url, load, i: run_load(url, load, 100 + i))
    finally:
        await stop_daemon(ours.process)
        await stop_daemon(peer, grace_s=15)
    return results


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0], "bench_rerank", "a reranker GGUF (default: Qwen3-Reranker-0.6B's shape "
                     "in Q8_0, made once)", "half the requests").parse_args(argv)
    results = asyncio.run(main_async(args))
    print(f"scores of the two servers: at most {results['score_diff_max']} apart, the same order: "
          f"{results['same_order']}")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
