"""The documentation's chart: syshaxd against llama-server on a seed scenario, drawn by `syshax benchmark --plot`.

Both servers are started as bench/bench_peers.py starts them (the same GGUF, threads, 8 parallel sequences,
context per sequence and flash attention), then `syshax benchmark` runs one scenario against both URLs, one
server at a time, and draws its own two-panel plot (output tok/s and p99 latency against concurrency) into
docs/images/seed-chart.png; its JSON goes to bench/results/seed_chart.json. Run it on quiet cores.

    .venv/bin/python bench/bench_chart.py                       # short: 128 in, 256 out at 1, 2, 4, 8, 16
    .venv/bin/python bench/bench_chart.py --scenario medium --iterations 8
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_peers  # noqa: E402  (starts both servers the same way)


async def run(args: argparse.Namespace) -> int:
    binary = bench_peers.find_llama_server(args.llama_server)
    peer_args = argparse.Namespace(model=args.model, threads=2, n_ctx=4096, repack="auto")
    with tempfile.TemporaryDirectory(prefix="bench-chart-") as tmp:
        log_dir = Path(tmp)
        ours = await bench_peers.start_ours(peer_args, log_dir)
        try:
            peer = await bench_peers.start_peer(peer_args, binary, log_dir)
            try:
                argv = [str(Path(sys.executable).with_name("syshax")), "benchmark", "--scenario", args.scenario,
                        "--iterations", str(args.iterations), "--tokenizer", str(args.model),
                        "--url", f"syshaxd={ours.url}", "--url", f"llama-server={peer.url}",
                        "--server-pid", str(ours.process.pid), "--server-pid", str(peer.process.pid),
                        "--json", str(args.json), "--plot", str(args.plot)]
                print(" ".join(argv), flush=True)
                return subprocess.run(argv).returncode
            finally:
                await peer.stop()
        finally:
            await ours.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("short", "medium", "long"), default="short",
                   help="the seed scenario to run (default: short)")
    p.add_argument("--iterations", type=int, default=16, help="requests per concurrency level (default: 16)")
    p.add_argument("--model", type=Path, help="GGUF both servers load (default: the prepared q4_0 SmolLM2)")
    p.add_argument("--llama-server", metavar="PATH", help="the llama-server binary (default: as bench_peers.py)")
    p.add_argument("--plot", type=Path, default=REPO / "docs/images/seed-chart.png", help="the PNG to write")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/seed_chart.json", help="the figures")
    args = p.parse_args()
    from syshaxd.benchmark.prompts import default_tokenizer_path

    args.model = (args.model or default_tokenizer_path()).resolve()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
