"""Decode across hosts against decode on one host, in one run, as two hosts on one machine (network namespaces and
a veth pair; needs root, as the tests do).

(a) A 2048-token prompt's KV: the prefill (llama.cpp, core 0) against what moving its record to a decoder costs.
    Single host: export into the ring + import. Across the link: export + Mooncake's write over TCP into the node's
    ring + import on the node (core 1). Real engines, ring and transfer engine; no daemon in between.
(b) Decode throughput at c=16: single-host hetero (prefill core 0, decoder core 1) against a front (prefill core 0,
    local_decoders = false) whose decoder is a node across the link (core 1). Real daemons, `syshax benchmark`'s
    client, the same prompts.

    .venv/bin/python bench/bench_remote.py [--repeats 5] [--iterations 64]

Prints both tables and writes bench/results/bench_remote.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "llamacpp"), str(REPO / "tests")]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.q4_0.gguf"
NS, FRONT_IF, NODE_IF = "shxbench", "shxbf", "shxbn"
FRONT_IP, NODE_IP = "10.212.0.1", "10.212.0.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_hosts():
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "link", "del", FRONT_IF], capture_output=True)
    _ip("netns", "add", NS)
    try:
        _ip("link", "add", FRONT_IF, "type", "veth", "peer", "name", NODE_IF)
        _ip("link", "set", NODE_IF, "netns", NS)
        _ip("addr", "add", f"{FRONT_IP}/24", "dev", FRONT_IF)
        _ip("link", "set", FRONT_IF, "up")
        for cmd in (["ip", "addr", "add", f"{NODE_IP}/24", "dev", NODE_IF], ["ip", "link", "set", NODE_IF, "up"],
                    ["ip", "link", "set", "lo", "up"]):
            _ip("netns", "exec", NS, *cmd)
        yield
    finally:
        subprocess.run(["ip", "link", "del", FRONT_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


# --- (a) the record's way, piece by piece -------------------------------------------------------

def _spec(instance: str, role: str, batch: int):
    from syshaxd.sdk.types import EngineSpec

    return EngineSpec(backend="llamacpp", role=role, model_path=str(MODEL), model_name="m", n_ctx=4096,
                      max_batch_size=batch, threads=1, prefill_chunk_size=512, ring=instance)


def _timed(timings: dict, name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            timings[name] = time.perf_counter() - t
    return wrapper


def node_side() -> None:
    """The node's half of (a), in the node's namespace on core 1: a ring registered with the transfer engine and a
    decoder that imports what the front wrote there. Speaks JSON lines on stdin/stdout."""
    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.remote.transfer import TransferEngine, mapping_address
    from syshaxd.sdk.kv.ring import KVRing
    from syshaxd.sdk.types import GenerateRequest, Handling, Imported, KVHandle, SamplingParams

    os.sched_setaffinity(0, {1})
    instance = f"bench-node-{uuid.uuid4().hex[:6]}"
    ring = KVRing.create(instance, 512 << 20)
    engine = TransferEngine(NODE_IP)
    base = mapping_address(ring.mapping)
    engine.register(base, len(ring.mapping))
    decoder = LlamaCppEngine(_spec(instance, "generate", 4))
    timings: dict = {}
    decoder.handoff.port.import_into = _timed(timings, "import", decoder.handoff.port.import_into)
    reserved = {}
    print(json.dumps({"session": engine.session}), flush=True)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "reserve":
                res = ring.reserve(msg["length"])
                reserved[res.offset] = res
                print(json.dumps({"offset": res.offset, "seq": res.seq,
                                  "address": base + KVRing.payload_position(res.offset)}), flush=True)
            elif msg["op"] == "import":
                reserved.pop(msg["handle"]["offset"]).commit()
                handle = KVHandle(**msg["handle"])
                req = GenerateRequest(request_id=msg["id"], max_tokens=1, sampling=SamplingParams(temperature=0),
                                      prompt_tokens=tuple(msg["tokens"]))
                events = list(decoder.submit(req, Handling(kv=handle)))
                while decoder.has_work():
                    events += decoder.step()
                ok = next(e for e in events if isinstance(e, Imported)).ok
                ring.release(handle.offset)
                print(json.dumps({"ok": ok, "import_s": timings["import"]}), flush=True)
    finally:
        decoder.close()
        ring.unlink()
        ring.close()


def record_way(n_tokens: int = 2048, repeats: int = 5) -> dict:
    from dataclasses import asdict, replace

    from syshax_llamacpp.engine import LlamaCppEngine
    from syshaxd.remote.transfer import TransferEngine, mapping_address
    from syshaxd.sdk.kv.ring import KVRing
    from syshaxd.sdk.types import GenerateRequest, Handling, Imported, Prefilled, SamplingParams

    node = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, __file__, "--node-side"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ask = lambda msg: (node.stdin.write(json.dumps(msg) + "\n"), node.stdin.flush(),  # noqa: E731
                       json.loads(node.stdout.readline()))[2]
    session = json.loads(node.stdout.readline())["session"]
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    instance = f"bench-front-{uuid.uuid4().hex[:6]}"
    ring = KVRing.create(instance, 512 << 20)
    engine = TransferEngine(FRONT_IP)
    base = mapping_address(ring.mapping)
    engine.register(base, len(ring.mapping))
    prefill = LlamaCppEngine(_spec(instance, "prefill", 1))
    local = LlamaCppEngine(_spec(instance, "generate", 4))  # the single-host decoder's import, on this core
    timings: dict = {}
    prefill.handoff.port.export = _timed(timings, "export", prefill.handoff.port.export)
    local.handoff.port.import_into = _timed(timings, "import", local.handoff.port.import_into)
    rows = []
    try:
        for r in range(repeats + 1):  # the first is a warm-up (first touches of the ring and the connection)
            tokens = tuple(100 + (i * 7 + 13 * r) % 40000 for i in range(n_tokens))
            req = GenerateRequest(request_id=f"r{r}", max_tokens=1, sampling=SamplingParams(temperature=0),
                                  prompt_tokens=tokens)
            t0 = time.perf_counter()
            events = list(prefill.submit(req))
            while prefill.has_work():
                events += prefill.step()
            total = time.perf_counter() - t0
            handle = next(e for e in events if isinstance(e, Prefilled)).handle
            export = timings["export"]
            # single host: the decoder beside it imports from this ring
            events = list(local.submit(req, Handling(kv=handle)))
            while local.has_work():
                events += local.step()
            assert next(e for e in events if isinstance(e, Imported)).ok
            local_import = timings["import"]
            # across the link: room in the node's ring, the one-sided write, the node's import
            t = time.perf_counter()
            room = ask({"op": "reserve", "length": handle.length})
            engine.write(session, base + KVRing.payload_position(handle.offset), room["address"], handle.length)
            transfer = time.perf_counter() - t
            there = replace(handle, offset=room["offset"], seq=room["seq"])
            answer = ask({"op": "import", "id": req.request_id, "tokens": list(tokens), "handle": asdict(there)})
            assert answer["ok"], answer
            ring.release(handle.offset)
            if r:
                rows.append({"prefill_s": total - export, "export_s": export, "import_single_s": local_import,
                             "transfer_s": transfer, "import_node_s": answer["import_s"], "bytes": handle.length})
    finally:
        prefill.close()
        local.close()
        ring.unlink()
        ring.close()
        node.stdin.close()
        node.wait(30)
        os.sched_setaffinity(0, cpus)  # the daemons of (b) place themselves
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    single = med["export_s"] + med["import_single_s"]
    remote = med["export_s"] + med["transfer_s"] + med["import_node_s"]
    return med | {"tokens": n_tokens, "repeats": repeats,
                  "single_host_pct_of_prefill": 100 * single / med["prefill_s"],
                  "across_link_pct_of_prefill": 100 * remote / med["prefill_s"],
                  "transfer_plus_import_pct_of_prefill": 100 * (med["transfer_s"] + med["import_node_s"])
                  / med["prefill_s"],
                  "transfer_gb_per_s": med["bytes"] / med["transfer_s"] / 1e9}


# --- (b) decode throughput at c=16 --------------------------------------------------------------

def _bench(url: str, iterations: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "syshaxd.benchmark", "--url", f"x={url}", "--scenario", "custom",
                    "--input-len", "128", "--output-len", "256", "--concurrency", "16", "--iterations",
                    str(iterations), "--warmup", "4", "--json", str(out)], check=True, capture_output=True,
                   cwd=REPO)
    (target,) = json.loads(out.read_text())["targets"]
    (level,) = target["levels"]
    return {"tok_s": level["output_throughput_tok_s"], "ttft_p50_ms": 1e3 * level["ttft_s"]["median"],
            "tpot_p50_ms": 1e3 * level["tpot_s"]["median"], "ok": f"{level['completed']}/{level['sent']}"}


def throughput(iterations: int) -> dict:
    from conftest import MODEL_NAME, start_daemon, wait_for
    from test_remote import Node

    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    secret = tmp / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    base = {"model": str(MODEL), "model_name": MODEL_NAME, "mode": "hetero", "prefill_cpu_affinity": "0",
            "admin_socket": str(tmp / "admin.sock")}
    results = {}
    single = start_daemon(tmp, base | {"cpu_affinity": "1"})
    try:
        results["single_host"] = _bench(single.url, iterations, tmp / "single.json")
    finally:
        single.stop()
    import test_remote

    test_remote.NS, test_remote.NODE_IP = NS, NODE_IP  # the bench's hosts, not the tests'
    node = Node(tmp, MODEL, secret).start()
    try:
        front = start_daemon(tmp, base | {"local_decoders": False, "remote_nodes": [f"{NODE_IP}:7070"],
                                          "node_secret_file": str(secret)})
        try:
            wait_for(lambda: front.status()["ready"], 60, "the node")
            results["across_link"] = _bench(front.url, iterations, tmp / "remote.json")
            results["node"] = front.status()["nodes"][0]
        finally:
            front.stop()
    finally:
        node.stop()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iterations", type=int, default=64)
    args = p.parse_args()
    if args.node_side:
        node_side()
        return 0
    with two_hosts():
        way = record_way(repeats=args.repeats)
        print(f"(a) {way['tokens']}-token prompt, {way['bytes'] / 2**20:.1f} MiB record, medians of {way['repeats']}:")
        print(f"    prefill {way['prefill_s'] * 1e3:.0f} ms; export {way['export_s'] * 1e3:.1f} ms; single-host import "
              f"{way['import_single_s'] * 1e3:.1f} ms; transfer {way['transfer_s'] * 1e3:.1f} ms "
              f"({way['transfer_gb_per_s']:.2f} GB/s); node import {way['import_node_s'] * 1e3:.1f} ms")
        print(f"    handoff / prefill: single host {way['single_host_pct_of_prefill']:.2f}%, across the link "
              f"{way['across_link_pct_of_prefill']:.2f}% (transfer + import alone "
              f"{way['transfer_plus_import_pct_of_prefill']:.2f}%)")
        tp = throughput(args.iterations)
    s, r = tp["single_host"], tp["across_link"]
    ratio = r["tok_s"] / s["tok_s"]
    print(f"(b) c=16, 128 in / 256 out, {args.iterations} requests ({s['ok']}, {r['ok']} ok): single host "
          f"{s['tok_s']:.1f} tok/s, across the link {r['tok_s']:.1f} tok/s: {ratio:.2f}x; TTFT p50 {s['ttft_p50_ms']:.0f} vs "
          f"{r['ttft_p50_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.1f} vs {r['tpot_p50_ms']:.1f} ms")
    out = REPO / "bench" / "results" / "bench_remote.json"
    out.write_text(json.dumps({"record_way": way, "throughput": tp, "throughput_ratio": ratio}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
