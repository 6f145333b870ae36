"""Mooncake's transfer engine against NIXL, in one run: one-sided writes of mmap'd memory (as the KV ring is) from one
process into another over TCP on loopback, bytes checked, best of 3 per size. Why syshaxd/remote/ uses Mooncake.

    .venv/bin/python bench/bench_transfer_engines.py

Mooncake comes with the `remote` extra. NIXL's wheels are CUDA builds that declare torch; for this comparison only:
    python -m venv /tmp/nixlenv && /tmp/nixlenv/bin/pip install --no-deps nixl-cu12==1.5.1 && /tmp/nixlenv/bin/pip \
        install numpy
    then pass --nixl-python /tmp/nixlenv/bin/python (skipped without it). NIXL runs UCX with UCX_TLS=tcp.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time

N = 64 << 20
SIZES = (1 << 20, 8 << 20, 32 << 20, 45 << 20, 64 << 20)  # 45 MiB: the record of a 2048-token SmolLM2 prompt


def _addr(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


# --- each engine: a target process that registers its memory, an initiator that writes into it ------------------

def _mooncake_target(q, done) -> None:
    from mooncake.engine import TransferEngine

    mm = mmap.mmap(-1, N)
    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    te.register_memory(_addr(mm), N)
    q.put((f"127.0.0.1:{te.get_rpc_port()}", _addr(mm)))
    done.wait()
    q.put(hashlib.sha1(mm[:N]).hexdigest())


def _mooncake_writer(peer, remote):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")

    def setup(mm):
        te.register_memory(_addr(mm), N)

    def write(mm, size):
        assert te.transfer_sync_write(peer, _addr(mm), remote, size) == 0
    return setup, write


def _nixl_target(q, done) -> None:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    mm = mmap.mmap(-1, N)
    agent.register_memory([(_addr(mm), N, 0, "")], "DRAM")
    q.put((agent.get_agent_metadata(), _addr(mm)))
    done.wait()
    q.put(hashlib.sha1(mm[:N]).hexdigest())


def _nixl_writer(meta, remote):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    state = {}

    def setup(mm):
        agent.register_memory([(_addr(mm), N, 0, "")], "DRAM")
        state["peer"] = agent.add_remote_agent(meta)

    def write(mm, size):
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(_addr(mm), size, 0)], "DRAM"),
                                       agent.get_xfer_descs([(remote, size, 0)], "DRAM"), state["peer"])
        agent.transfer(handle)
        while (done := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
            pass
        agent.release_xfer_handle(handle)
        assert done == "DONE"
    return setup, write


ENGINES = {"mooncake": (_mooncake_target, _mooncake_writer), "nixl": (_nixl_target, _nixl_writer)}


def measure(name: str) -> dict:
    target, writer = ENGINES[name]
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(q, done))
    proc.start()
    setup, write = writer(*q.get())
    mm = mmap.mmap(-1, N)
    data = os.urandom(N)
    mm[:] = data
    setup(mm)
    rows = []
    for size in SIZES:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            write(mm, size)
            times.append(time.perf_counter() - t)
        rows.append({"bytes": size, "first_ms": 1e3 * times[0], "best_ms": 1e3 * min(times),
                     "best_gb_per_s": size / min(times) / 1e9})
    done.set()
    exact = q.get() == hashlib.sha1(data).hexdigest()
    proc.join()
    return {"engine": name, "bytes_exact": exact, "sizes": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # one engine, in its own interpreter
    p.add_argument("--nixl-python", help="an interpreter with nixl-cu12 installed (see above); NIXL is skipped without")
    args = p.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("UCX_TLS", "tcp")
    if args.engine:
        print(json.dumps(measure(args.engine)))
        return 0
    runs = [(sys.executable, "mooncake")] + ([(args.nixl_python, "nixl")] if args.nixl_python else [])
    results = []
    for python, name in runs:
        out = subprocess.run([python, __file__, "--engine", name], capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise SystemExit(f"{name} measured nothing (exit {out.returncode}):\n{out.stderr[-2000:]}")
        if out.returncode:  # nixl-cu12 1.5.1 segfaults at interpreter exit, after its figures are out
            print(f"note: {name}'s process exited with {out.returncode} after measuring")
        results.append(json.loads(lines[-1]))
    for r in results:
        print(f"{r['engine']:<9} bytes exact: {r['bytes_exact']}")
        for s in r["sizes"]:
            print(f"  {s['bytes'] >> 20:>3} MiB: first {s['first_ms']:6.1f} ms, best {s['best_ms']:6.1f} ms "
                  f"({s['best_gb_per_s']:.2f} GB/s)")
    if not args.nixl_python:
        print("NIXL skipped: pass --nixl-python (see --help)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
