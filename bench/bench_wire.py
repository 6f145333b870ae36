"""What the node channel's typed wire and the KV records' MAC cost, against their peers in the same run.

* The wire (remote/wire.py: msgspec, every field checked) against pickle, which it replaced, on the two messages
  that matter: a Submit of a 2,048-token prompt (once per request) and a FromNode of 8 Deltas (once per decode
  step of 8 requests). Median of --rounds rounds of --repeat encodes and decodes each.
* The record MAC (wire.record_mac: keyed BLAKE2b) against HMAC-SHA256 and xxh3 (the unkeyed checksum the ring's
  records carry) over a --mib MiB record, in MiB/s.

    .venv/bin/python bench/bench_wire.py [--rounds 5] [--repeat 2000] [--mib 64]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import xxhash  # noqa: E402

from syshaxd.remote import wire  # noqa: E402
from syshaxd.sdk.types import Delta, GenerateRequest, Handling, Submit  # noqa: E402


def per_call_us(fn, repeat: int, rounds: int) -> float:
    """The median over rounds of one call's time, in µs."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(times)


def mib_per_s(fn, mib: int, rounds: int) -> float:
    best = min((lambda t0: (fn(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(rounds))
    return mib / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args(argv)

    request = GenerateRequest(request_id="r-0123456789abcdef", max_tokens=512, prompt_tokens=tuple(range(2048)))
    messages = {
        "Submit, 2,048 prompt tokens": wire.ToNode(Submit(request, Handling())),
        "FromNode, 8 Deltas": wire.FromNode(tuple(Delta(f"r-{i}", " word", 1, tokens=(1000 + i,)) for i in range(8))),
    }
    print(f"{'message':<30} {'bytes wire/pickle':>18} {'encode µs wire/pickle':>24} {'decode µs wire/pickle':>24}")
    for name, message in messages.items():
        body, pickled = wire.dumps(message), pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        assert wire.loads(body) == message and pickle.loads(pickled) == message
        enc = per_call_us(lambda: wire.dumps(message), args.repeat, args.rounds)
        enc_p = per_call_us(lambda: pickle.dumps(message, pickle.HIGHEST_PROTOCOL), args.repeat, args.rounds)
        dec = per_call_us(lambda: wire.loads(body), args.repeat, args.rounds)
        dec_p = per_call_us(lambda: pickle.loads(pickled), args.repeat, args.rounds)
        print(f"{name:<30} {len(body):>8} / {len(pickled):<8} {enc:>9.1f} / {enc_p:<9.1f} ({enc / enc_p:.2f}x)"
              f" {dec:>8.1f} / {dec_p:<8.1f} ({dec / dec_p:.2f}x)")

    record, key = os.urandom(args.mib << 20), os.urandom(32)
    macs = {
        "BLAKE2b, keyed (record_mac)": lambda: wire.record_mac(key, "r-0123456789abcdef", 4096, 7, record),
        "HMAC-SHA256": lambda: hmac.new(key, record, hashlib.sha256).digest(),
        "xxh3-64 (unkeyed)": lambda: xxhash.xxh3_64_digest(record),
    }
    print(f"\n{'record MAC over ' + str(args.mib) + ' MiB':<30} {'MiB/s':>8}  ms per 56 MiB (a 2,048-token 1.5B record)")
    for name, fn in macs.items():
        rate = mib_per_s(fn, args.mib, args.rounds)
        print(f"{name:<30} {rate:>8.0f}  {56 / rate * 1000:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
