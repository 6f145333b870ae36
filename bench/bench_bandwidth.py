"""How close a decode step comes to the memory bandwidth here, and what that gives on paper for a Kunpeng 920.

A decode step of one sequence reads every weight once (the tied output matrix included), so its tokens a second
are at most the memory's read bandwidth over the weights' bytes. This script measures, on this machine and with
the same threads:

1. the read bandwidth: threads summing their share of a 2 GiB array (numpy releases the GIL for it), best of 5;
2. a decode step of one sequence with llama.cpp (llama-cpp-python 0.3.36, as the workers build it), on the
   1.5B shape in q4_0 (tests/families.py's qwen2-1.5b-shape, made once into models/bench): the median of 64
   steps after a 32-token prompt;

and their ratio: the share of the bandwidth a step turns into tokens. Then, on paper, the decode tokens a second of
a Kunpeng 920 node (4 of a socket's 8 DDR4-2933 channels: 93.9 GB/s; a syshax CPU worker is one node) and of a
whole 2-socket server (4 nodes, one request each), for SmolLM2-135M and the seed's 32B model in q4_0, at the same
ratio. That ratio is of 2 cores here, which cannot draw a whole socket's bandwidth: it is the figure to replace
with a run on the machine itself.

    .venv/bin/python bench/bench_bandwidth.py           # about 2 minutes (the first run also makes the model)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import numpy as np  # noqa: E402

# DDR4-2933: 2933 MT/s x 8 bytes a channel; a Kunpeng 920 socket has 8 channels, 4 per NUMA node (its two dies)
KUNPENG_NODE_BW = 2933e6 * 8 * 4
KUNPENG_NODES = 4
# weights read per token: the default model's q4_0 file; the seed's 32B at q4_0 with its output matrix and
# embeddings in q8_0, as syshaxd quantizes it (docs/performance.md, "Sizing a 32B model")
MODELS = {"SmolLM2-135M q4_0": 0.092e9, "32B (DeepSeek-R1-Distill-Qwen-32B) q4_0": 19.2e9}


def read_bandwidth(threads: int, gib: float = 2.0, rounds: int = 5) -> float:
    """Bytes a second that `threads` threads read from memory, summing their share of one array."""
    data = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(rounds):
        sums = [0.0] * threads

        def work(i: int) -> None:
            sums[i] = float(parts[i].sum())

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        started = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = max(best, data.nbytes / (time.perf_counter() - started))
    return best


def decode_step(model: Path, threads: int, steps: int = 64) -> float:
    """Seconds of one decode step of one sequence (the median), after a 32-token prompt."""
    import llama_cpp

    llama = llama_cpp.Llama(str(model), n_ctx=256, n_batch=64, n_threads=threads, n_threads_batch=threads,
                            verbose=False, flash_attn=True)
    llama.eval(list(range(100, 132)))
    times = []
    token = 200
    for _ in range(steps):
        started = time.perf_counter()
        llama.eval([token])
        times.append(time.perf_counter() - started)
        token = 200 + (token + 7) % 1000
    llama.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--model", help="a q4_0 GGUF (default: the 1.5B shape, made once)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_bandwidth.json"))
    args = p.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        import families

        model = families.make_shape_model("qwen2-1.5b-shape", REPO / "models" / "bench")
    bandwidth = read_bandwidth(args.threads)
    step = decode_step(model, args.threads)
    weights = model.stat().st_size
    ratio = weights / step / bandwidth
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s")
    print(f"decode step of {model.name} ({weights / 1e9:.2f} GB): {step * 1000:.1f} ms = "
          f"{weights / step / 1e9:.1f} GB/s of weights, {ratio:.0%} of the bandwidth")
    paper = {}
    for name, size in MODELS.items():
        node = ratio * KUNPENG_NODE_BW / size
        paper[name] = {"node_tok_s": round(node, 1), "server_tok_s": round(node * KUNPENG_NODES, 1)}
        print(f"Kunpeng 920 on paper, {name}: {node:.1f} tok/s a request on one node "
              f"({KUNPENG_NODE_BW / 1e9:.1f} GB/s), {node * KUNPENG_NODES:.1f} tok/s over 4 nodes")
    out = {"threads": args.threads, "bandwidth_gb_s": round(bandwidth / 1e9, 2), "model": model.name,
           "weights_gb": round(weights / 1e9, 3), "decode_step_ms": round(step * 1000, 2),
           "ratio": round(ratio, 3), "kunpeng_node_gb_s": round(KUNPENG_NODE_BW / 1e9, 1), "paper": paper}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
