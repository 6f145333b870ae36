"""KV ring bandwidth against a plain numpy copy of the same bytes; prints a table, writes bench/results/bench_ring.json.

Sizes are those of real records of the default model (SmolLM2-135M: 30 layers, 3 KV heads of 64,
f16, 23 KiB of K+V per token). For each size:

  numpy copy      np.copyto of the payload into one other buffer (cache-hot when it fits)
  numpy rotating  np.copyto into successive slots of a ring-sized buffer: the ring's memory traffic
  ring write      reserve + copy into the segment + commit + release (the producer's cost)
  ring handoff    ring write, plus the consumer's read() and one copy out of the segment
  record          encode_into a reservation (header, copy, xxh3 seal) + decode with checksum check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from syshaxd.sdk.kv import record  # noqa: E402
from syshaxd.sdk.kv.ring import KVRing  # noqa: E402

FP = record.ModelFingerprint(arch="llama", n_layer=30, n_head_kv=3, head_dim=64, rope_type="norm",
                             rope_dim=64, rope_freq_base=100000.0, rope_freq_scale=1.0, tensor_table_hash=0)


def best_of(fn, repeat: int) -> float:
    fn()  # warm: page faults on first touch of the segment are not what we measure
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(ring: KVRing, n_tokens: int, repeat: int) -> dict:
    size = record.record_size(FP, n_tokens, "f16")
    g = np.random.default_rng(n_tokens)
    src = g.integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    arena = np.empty(ring.capacity, np.uint8)
    arena[:] = 0
    slots = [0]
    kv = g.standard_normal((FP.n_layer, n_tokens, FP.n_head_kv, FP.head_dim)).astype(np.float16)
    tokens = np.arange(n_tokens)

    def numpy_copy():
        np.copyto(dst, src)

    def numpy_rotating():
        at = slots[0] if slots[0] + size <= len(arena) else 0
        np.copyto(arena[at:at + size], src)
        slots[0] = at + size

    def ring_write():
        res = ring.reserve(size, timeout=1.0)
        np.copyto(np.frombuffer(res.view, np.uint8), src)
        ring.release(res.commit())

    def ring_handoff():
        res = ring.reserve(size, timeout=1.0)
        np.copyto(np.frombuffer(res.view, np.uint8), src)
        offset = res.commit()
        np.copyto(dst, np.frombuffer(ring.read(offset), np.uint8))
        ring.release(offset)

    def record_handoff():
        res = ring.reserve(size, timeout=1.0)
        record.encode_into(res.view, FP, tokens, tokens, kv, kv)
        offset = res.commit()
        record.decode(ring.read(offset), expect=FP)
        ring.release(offset)

    row = {"n_tokens": n_tokens, "bytes": size}
    for name, fn in [("numpy_copy", numpy_copy), ("numpy_rotating", numpy_rotating), ("ring_write", ring_write),
                     ("ring_handoff", ring_handoff), ("record", record_handoff)]:
        seconds = best_of(fn, repeat)
        row[name] = {"seconds": seconds, "gb_per_s": size / seconds / 1e9}
    for name in ("ring_write", "ring_handoff", "record"):
        row[name]["ratio_to_numpy"] = row[name]["gb_per_s"] / row["numpy_copy"]["gb_per_s"]
        row[name]["ratio_to_rotating"] = row[name]["gb_per_s"] / row["numpy_rotating"]["gb_per_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024],
                    help="record sizes, in tokens of the default model")
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per size (the best counts)")
    ap.add_argument("--capacity-mib", type=int, default=64, help="ring capacity")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_ring.json")
    args = ap.parse_args(argv)

    instance = f"bench{os.getpid()}"
    with KVRing.create(instance, args.capacity_mib << 20) as ring:
        rows = [measure(ring, n, args.repeat) for n in args.tokens]

    print("GB/s, and in brackets the ratio to numpy copy / to numpy rotating")
    print(f"{'tokens':>7} {'bytes':>9} {'numpy':>7} {'rotating':>8} {'ring write':>22} {'ring handoff':>22} "
          f"{'record+xxh3':>22}")
    for r in rows:
        cells = [f"{r[k]['gb_per_s']:5.2f} ({r[k]['ratio_to_numpy']:4.2f}x/{r[k]['ratio_to_rotating']:4.2f}x)"
                 for k in ("ring_write", "ring_handoff", "record")]
        print(f"{r['n_tokens']:>7} {r['bytes']:>9} {r['numpy_copy']['gb_per_s']:>7.2f} "
              f"{r['numpy_rotating']['gb_per_s']:>8.2f} " + " ".join(f"{c:>22}" for c in cells))
    print("ring handoff moves the bytes twice (into the segment, then out of it)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"bench": "ring", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
              "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
              "repeat": args.repeat, "capacity_bytes": args.capacity_mib << 20, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
