"""syshaxd and llama-server on a model of a real shape (1.5B dense, or Qwen 3.5 2B's hybrid): memory, decode, TTFT, hetero handoff, 32B on paper; writes bench/results/bench_real_shape.json.

The model is made here, once (tests/families.py, make_shape_model): Qwen2-1.5B's shape (qwen2 arch, hidden
1536, 28 layers, 12 heads, 2 KV heads of head_dim 128, intermediate 8960, tied embeddings) with random weights,
written by llama.cpp's own converter, quantized to q4_0 with the output matrix and token embeddings in q8_0 (as
syshaxd quantizes) and cached in models/bench/ (about 0.8 GB; the HF folder and f16 GGUF it came from are deleted).
Its vocabulary is SmolLM2's 49152 tokens, the one tests/families.py gives qwen2 (there is no network here to fetch
Qwen2's own 151936): the embedding and output matrices are a third of the real model's, the rest is the same.
A decode step's, a prompt's and a handoff's cost do not depend on the weights' values.

1. syshaxd --mode cpu against llama.cpp's own llama-server (../shared/tools/llama-server.sh: the same llama.cpp
   that llama-cpp-python vendors, built without AMX as syshaxd's wheel is), both up, one loaded at a time, the
   first alternating from load to load (bench/bench_peers.py's servers and way): the same threads (2), 8 slots of
   --n-ctx tokens, flash attention. Loads: decode at c=1 (128-token prompts, 128 tokens forced out), decode at
   c=8 with staggered arrivals (the first 8 sent --stagger s apart), and TTFT of --long-len (2,048) tokens.
2. Memory: each process's RSS (and of it: anon, file-backed, shared memory, from /proc/PID/status) when idle
   after load, and after the loads. syshaxd's workers come from /v1/syshax/status. The model file's pages are
   file-backed and shared (llama-server and every syshaxd worker mmap it): "host" counts them once.
3. syshaxd --mode hetero (a llama.cpp prefill worker on the first CPU, one decoder on the second): one
   --long-len prompt to warm it up, then the TTFT prompts, each alone. Per handoff, from /v1/syshax/status
   before and after (KVStatus; /metrics gives the same as syshax_kv_bytes_moved, syshax_kv_records_read,
   syshax_kv_handoff_latency_seconds): the record's bytes and whether the decoder imported it. The status keeps
   the handoff latency (prefill worker reported the record -> decoder imported it) as quantiles over the
   handoffs so far, not one by one: every handoff of this daemon is a --long-len one, so its p50 is theirs.
   Then, in-process (bench/bench_hetero.py's handoff_vs_prefill), the prefill engine's export into the ring
   and the decoder's import of one --long-len prompt, timed around the two calls: the handoff's own cost.
4. On paper, for the seed's 32B model (DeepSeek-R1-Distill-Qwen-32B: 64 layers, 8 KV heads of 128, f16 KV:
   256 KiB a token): the ring a number of concurrent --long-len handoffs needs, the handoff time of one such
   prompt scaled by bytes from the measured one, KV memory per sequence at 4k and 32k, the weights at q4_0.

--shape qwen35-2b-shape makes Qwen 3.5 2B's shape instead (a hybrid: three gated delta-net layers to each gated
attention layer, 24 layers, hidden 2048; tests/families.py says the rest), --quant q4_k_m the file a user downloads.

    .venv/bin/python bench/bench_real_shape.py            # about 10 minutes on 2 quiet cores (+2 to make the model)
    .venv/bin/python bench/bench_real_shape.py --shape qwen35-2b-shape --quant q4_k_m --skip-hetero   # 6 minutes
    .venv/bin/python bench/bench_real_shape.py --quick    # fewer, shorter requests: a smoke test, not a measurement
    .venv/bin/python bench/bench_real_shape.py --quick --layers 2   # the pipeline on a 2-layer model of the same width
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "tests")]

import aiohttp  # noqa: E402

import bench_hetero  # noqa: E402
from bench_peers import (OURS, PARALLEL, PEER, Load, Server, find_llama_server, format_table, run_load,  # noqa: E402
                         start_ours, start_peer, stop_on_sigterm, summary_rows, warm_up)
from families import SHAPE_SPECS, make_shape_model  # noqa: E402
from syshaxd.benchmark.client import StreamingClient, list_models, run_level  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, Prompt, PromptBuilder  # noqa: E402
from syshaxd.benchmark.report import level_summary, write_json  # noqa: E402
from syshaxd.benchmark.resources import ResourceSampler, describe_machine  # noqa: E402
from syshaxd.config import Config  # noqa: E402
from syshaxd.engine.status import SchedulerStatus  # noqa: E402
from syshaxd.sdk.gguf.header import read_gguf_header  # noqa: E402
from syshaxd.sdk.gguf.quantize import gguf_file_type  # noqa: E402

SCHEMA = "syshax-bench-real-shape/1"
SHAPE = "qwen2-1.5b-shape"
HETERO = "syshaxd hetero"
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class PaperModel:
    """A model known by its shape only: what its KV and weights take."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    tied: bool

    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, f16

    def weight_bytes(self, q8_output: bool) -> float:
        """q4_0 (4.5 bits a weight: 32 of 4 bits and one f16 scale); the output matrix and token embeddings in
        q8_0 (8.5 bits) when q8_output, as syshaxd quantizes. Norms and biases are left out (under 0.1 %)."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        body = self.layers * (attn + 3 * self.hidden * self.intermediate)
        ends = self.vocab * self.hidden * (1 if self.tied else 2)
        return body * 4.5 / 8 + ends * (8.5 if q8_output else 4.5) / 8


R1_32B = PaperModel("DeepSeek-R1-Distill-Qwen-32B", layers=64, kv_heads=8, head_dim=128, hidden=5120, heads=40,
                    intermediate=27648, vocab=152064, tied=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests: a smoke test")
    p.add_argument("--shape", choices=sorted(SHAPE_SPECS), default=SHAPE,
                   help=f"the real shape made here (tests/families.py SHAPE_SPECS; default: {SHAPE})")
    p.add_argument("--quant", default="q4_0", help="its llama.cpp file type: q4_0 (default, made as syshaxd "
                   "quantizes: output q8_0) or any other (q4_k_m, ...: as llama.cpp's quantizer makes it)")
    p.add_argument("--layers", type=int, help="build the shape with this many layers instead of its own (a smoke "
                   "test of the pipeline; its figures are not the shape's)")
    p.add_argument("--model", type=Path, help="a GGUF to serve instead of the shape's model made here")
    p.add_argument("--threads", type=int, default=2, help="threads of syshaxd's cpu mode and llama-server (default: 2)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context per sequence on every server; llama-server gets "
                   f"-c n_ctx x {PARALLEL} (default: 4096)")
    p.add_argument("--long-len", type=int, default=2048, help="tokens of the TTFT and handoff prompt (default: 2048)")
    p.add_argument("--ttft-repeats", type=int, help="--long-len prompts per server (default: 2; --quick: 1)")
    p.add_argument("--stagger", type=float, default=0.5,
                   help="seconds between the c=8 load's first 8 arrivals (default: 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words (default: 0)")
    p.add_argument("--llama-server", metavar="PATH", help="the llama-server binary (default: what "
                   "../shared/tools/llama-server.sh prints, built there the first time)")
    p.add_argument("--repack", choices=("auto", "on", "off"), default="auto",
                   help="weight repacking on syshaxd and llama-server (default: auto)")
    p.add_argument("--skip-hetero", action="store_true", help="no hetero daemon and no in-process handoff")
    p.add_argument("--json", type=Path, help="where the figures go (default: bench/results/bench_real_shape.json; "
                   "bench_real_shape-quick.json with --quick or --layers)")
    args = p.parse_args(argv)
    for name in ("threads", "n_ctx", "long_len", "ttft_repeats", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: {value} is not allowed; it must be at least 1")
    if args.stagger < 0:
        p.error(f"--stagger: {args.stagger} is not allowed; it must be 0 or more")
    if args.n_ctx < args.long_len + 64:
        p.error(f"--n-ctx {args.n_ctx} cannot hold a --long-len {args.long_len} prompt and its answer; give at least "
                f"{args.long_len + 64}")
    if args.model is not None and args.layers is not None:
        p.error("--layers shapes the model made here; it cannot change --model")
    if args.model is not None and not args.model.is_file():
        p.error(f"--model: {args.model} is not a file")
    if not args.skip_hetero and args.long_len > 4096 - 64:
        p.error(f"--long-len {args.long_len}: the in-process handoff's engines hold 4096 tokens "
                "(bench_hetero.handoff_vs_prefill); give at most 4032, or --skip-hetero")
    if args.ttft_repeats is None:
        args.ttft_repeats = 1 if args.quick else 2
    if args.json is None:
        smoke = args.quick or args.layers is not None
        args.json = REPO / "bench/results" / ("bench_real_shape-quick.json" if smoke else "bench_real_shape.json")
    return args


# --- the model ------------------------------------------------------------------------------------------------


def model_shape(path: Path) -> dict:
    """What the GGUF's header says of its shape, and the f16 KV bytes a token takes in it."""
    meta, tensors = read_gguf_header(path)
    arch = meta["general.architecture"]
    n_embd, n_head = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length") or n_embd // n_head
    layers, kv_heads = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count_kv"]
    return {"path": str(path), "file_type": gguf_file_type(path), "file_bytes": path.stat().st_size, "arch": arch,
            "layers": layers, "hidden": n_embd, "heads": n_head, "kv_heads": kv_heads, "head_dim": head_dim,
            "intermediate": meta.get(f"{arch}.feed_forward_length"), "vocab": _vocab(tensors),
            "kv_bytes_per_token_f16": layers * kv_heads * head_dim * 2 * 2}


def _vocab(tensors) -> int | None:
    """The vocabulary's size: the token embeddings' second dimension (the header reader skips the token list)."""
    return next((dims[-1] for name, dims, _ in tensors if name == "token_embd.weight"), None)


def prepare_model(args: argparse.Namespace) -> tuple[Path, float | None]:
    """The GGUF to serve and the seconds it took to make (None: given or cached)."""
    if args.model is not None:
        return args.model.resolve(), None
    out_dir = REPO / "models" / "bench"
    spec = SHAPE_SPECS[args.shape]
    print(f"model: {args.shape} in {args.quant}{f' with {args.layers} layers' if args.layers else ''} ({spec.note})",
          flush=True)
    t0 = time.monotonic()
    built = []
    path = make_shape_model(args.shape, out_dir, layers=args.layers, quant=args.quant,
                            log=lambda text: (built.append(text), print(text, flush=True)))
    return path.resolve(), (time.monotonic() - t0 if built else None)


# --- memory -----------------------------------------------------------------------------------------------------


def process_memory(pid: int) -> dict:
    """One process's resident memory in MiB, split as the kernel counts it (/proc/PID/status): anon (its own
    heap: KV cache, compute buffers), file (mmapped files: the model, shared with every process that maps it),
    shmem (shared memory: syshaxd's KV ring and prefix cache)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    fields[key] = int(value.split()[0]) / 1024  # kB
    except OSError as exc:
        return {"pid": pid, "error": str(exc)}
    return {"pid": pid, "rss_mib": fields.get("VmRSS"), "anon_mib": fields.get("RssAnon"),
            "file_mib": fields.get("RssFile"), "shmem_mib": fields.get("RssShmem"), "peak_rss_mib": fields.get("VmHWM")}


def memory_total(processes: dict[str, dict]) -> dict:
    """A server's processes together: their RSS summed, and what the host holds for them (each one's anon, the
    model's pages and the shared memory once: every process maps the same file and segments)."""
    ok = [m for m in processes.values() if "error" not in m]
    return {"rss_sum_mib": sum(m["rss_mib"] for m in ok),
            "host_mib": sum(m["anon_mib"] for m in ok) + max((m["file_mib"] for m in ok), default=0)
            + max((m["shmem_mib"] for m in ok), default=0)}


async def server_status(session: aiohttp.ClientSession, url: str) -> SchedulerStatus:
    async with session.get(url + "/v1/syshax/status") as resp:
        resp.raise_for_status()
        return SchedulerStatus.from_json(await resp.json())


async def memory_of(server: Server, session: aiohttp.ClientSession) -> dict:
    """Every process of the server (syshaxd: the daemon and the workers its status names) and their total."""
    pids = {"llama-server": server.process.pid} if server.label == PEER else {"daemon": server.process.pid}
    if server.label != PEER:
        pids |= {w.name: w.pid for w in (await server_status(session, server.url)).workers if w.pid}
    processes = {name: process_memory(pid) for name, pid in pids.items()}
    return {"processes": processes, **memory_total(processes)}


# --- the loads ----------------------------------------------------------------------------------------------------


class Inputs:
    """Every load's prompts and output lengths (what bench_peers.run_load reads), the same on every server."""

    def __init__(self, builder: PromptBuilder, loads: list[Load], seed: int, long_len: int):
        self.inputs = {ld.name: ([builder.build(ld.input_len, (seed * 1_000_003 + i) * 1_000_033 + k)
                                  for k in range(ld.requests)], ld.output_len) for i, ld in enumerate(loads)}
        self.warmup = [builder.build(32, seed * 7 + 99_000 + k) for k in range(2)]
        # hetero's warm-up is a long prompt: its handoff latencies are then all of one length
        self.hetero_warmup = builder.build(long_len, seed * 7 + 98_000)


def make_loads(args: argparse.Namespace) -> list[Load]:
    out = 16 if args.quick else 128
    return [
        Load("decode c=1", "unique", 1, 2 if args.quick else 3, 128, out),
        Load("decode c=8 staggered", "unique", 8, 8 if args.quick else 16, 128, out, arrival_gap_s=args.stagger),
        # two tokens out: the first is the prefill's; in hetero it reaches the client through the decoder
        Load(f"TTFT {args.long_len}", "unique", 1, args.ttft_repeats, args.long_len, 2),
    ]


async def phase_cpu_vs_peer(args, binary, log_dir, work: Inputs, loads: list[Load], servers: dict) -> tuple[dict, dict]:
    """syshaxd cpu and llama-server up; memory idle; every load on each, the first alternating; memory after."""
    results: dict[str, dict[str, list[dict]]] = {PEER: {}, OURS: {}}
    memory: dict[str, dict] = {}
    started: dict[str, Server] = {}
    try:
        for label in (PEER, OURS):
            print(f"starting {label} ...", flush=True)
            server = await (start_peer(args, binary, log_dir) if label == PEER else start_ours(args, log_dir))
            started[label] = server
            servers[label] = server.info
            print(f"  {label} ready at {server.url} after {server.info['startup_s']:.1f} s", flush=True)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            for label, server in started.items():
                memory[label] = {"idle_after_load": await memory_of(server, session)}
            for server in started.values():
                await warm_up(server, session, work.warmup)
            for i, ld in enumerate(loads):
                for label in ((PEER, OURS) if i % 2 == 0 else (OURS, PEER)):
                    results[label][ld.name] = [await run_load(started[label], session, work, ld, "")]
            for label, server in started.items():
                memory[label]["after_load"] = await memory_of(server, session)
                if label == OURS:
                    servers[label]["workers"] = [asdict(w) | {"stats": None}
                                                 for w in (await server_status(session, server.url)).workers]
    finally:
        for server in started.values():
            await server.stop()
    return results, memory


async def start_hetero(args, log_dir: Path) -> Server:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_real_shape: hetero mode needs two CPUs; give --skip-hetero")
    config = log_dir / "syshaxd-hetero.toml"
    config.write_text(
        "# written by bench/bench_real_shape.py\n"
        f"model = {json.dumps(str(args.model))}\n"
        f"model_dir = {json.dumps(str(args.model.parent))}\n"
        'quantize = ""\n'
        f"prefill_cpu_affinity = \"{cpus[0]}\"\n"
        f"cpu_affinity = \"{cpus[1]}\"\n"
        "threads = 1\n"
        f"cpu_max_batch_size = {PARALLEL}\n"
        f"n_ctx = {args.n_ctx}\n"
        f"repack = {json.dumps(args.repack)}\n"
        f"admin_socket = {json.dumps(str(log_dir / 'admin-hetero.sock'))}\n"
        'log_level = "info"\n'
    )
    # one thread per worker, whatever the environment says (OMP_NUM_THREADS would override threads)
    with _env_without("OMP_NUM_THREADS"):
        daemon = await start_daemon("hetero", command=daemon_command(), config=str(config), startup_timeout_s=600,
                                    log_dir=str(log_dir))
    return Server(HETERO, daemon.url, daemon.process, {"argv": daemon.argv, "pid": daemon.pid, "log": daemon.log_path,
                                                       "startup_s": daemon.startup_s, "config": config.read_text()})


@contextlib.contextmanager
def _env_without(name: str):
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


async def one_handoff(server: Server, session: aiohttp.ClientSession, prompt: Prompt, output_len: int) -> dict:
    """One prompt alone through prefill, ring and decoder: its TTFT and its record as the status counts it."""
    before = (await server_status(session, server.url)).kv
    client = StreamingClient(server.url, server.info["model"], output_len)
    run = await run_level(client, session, [prompt], 1)
    after = (await server_status(session, server.url)).kv
    record = run.records[0]
    moved, read = after.bytes_moved - before.bytes_moved, after.records_read - before.records_read
    return {"tokens": prompt.n_tokens, "ok": record.ok, "error": record.error_detail, "ttft_s": record.ttft_s,
            "records_read": read, "bytes": moved, "bytes_per_token": moved / prompt.n_tokens if read == 1 else None,
            "fallbacks": {k: v - before.fallbacks.get(k, 0) for k, v in after.fallbacks.items()
                          if v != before.fallbacks.get(k, 0)},
            "request": record.as_dict()}


async def phase_hetero(args, log_dir: Path, work: Inputs, ttft_load: Load, servers: dict) -> dict:
    """The hetero daemon: memory idle, a long prompt's handoff to warm up, the TTFT prompts', memory after."""
    print(f"starting {HETERO} (prefill on one CPU, decoder on the other) ...", flush=True)
    server = await start_hetero(args, log_dir)
    servers[HETERO] = server.info
    print(f"  ready at {server.url} after {server.info['startup_s']:.1f} s", flush=True)
    out: dict = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
            out["memory"] = {"idle_after_load": await memory_of(server, session)}
            status = await server_status(session, server.url)
            server.info["workers"] = [asdict(w) | {"stats": None} for w in status.workers]
            out["ring_capacity_bytes"] = status.kv.ring.capacity if status.kv else None
            (server.info["model"], *_) = await list_models(session, server.url) or ["default"]
            prompts = [("warm-up", work.hetero_warmup), *(("measured", p) for p in work.inputs[ttft_load.name][0])]
            sampler = ResourceSampler(server.process.pid, 0.5).start()
            handoffs = []
            try:
                for role, prompt in prompts:
                    print(f"  [{HETERO}] {role}: handoff of {prompt.n_tokens} tokens ...", end="", flush=True)
                    row = {"role": role} | await one_handoff(server, session, prompt, ttft_load.output_len)
                    handoffs.append(row)
                    print(f" TTFT {_fmt(row['ttft_s'], '{:.2f}')} s, {row['bytes'] / MIB:.1f} MiB through the ring",
                          flush=True)
            finally:
                resources = sampler.stop()
            out["handoffs"] = handoffs
            out["resources"] = resources
            out["memory"]["after_load"] = await memory_of(server, session)
            status = await server_status(session, server.url)
            out["kv_status"] = asdict(status.kv) if status.kv else None
    finally:
        await server.stop()
        server.info["returncode"] = server.process.returncode
    return out


def engine_handoff(model: Path, tokens: int) -> dict:
    """bench_hetero's in-process measure: a llama.cpp prefill engine and a decoder over one ring, the export and
    import timed around their calls. llama.cpp's log of it goes to a file, not the table."""
    bench_hetero.MODEL = model
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            (row,) = bench_hetero.handoff_vs_prefill(lengths=(tokens,), repeats=1)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return row


# --- the report ---------------------------------------------------------------------------------------------------


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def format_memory(memory: dict[str, dict]) -> str:
    header = ["server", "process", "idle RSS", "idle anon", "idle file", "idle shmem", "after RSS", "after anon",
              "after file", "after shmem", "peak RSS"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    totals = []
    for label, phases in memory.items():
        idle, after = phases.get("idle_after_load", {}), phases.get("after_load", {})
        for name in idle.get("processes", {}):
            a, b = idle["processes"][name], after.get("processes", {}).get(name, {})
            kinds = ("rss_mib", "anon_mib", "file_mib", "shmem_mib")
            cells = [label, name, *(_fmt(a.get(k), "{:.0f}") for k in kinds),
                     *(_fmt(b.get(k), "{:.0f}") for k in (*kinds, "peak_rss_mib"))]
            lines.append("| " + " | ".join(cells) + " |")
        totals.append(f"{label}: RSS summed {_fmt(idle.get('rss_sum_mib'), '{:.0f}')} MiB idle, "
                      f"{_fmt(after.get('rss_sum_mib'), '{:.0f}')} after; host (the model's pages and shared memory "
                      f"once) {_fmt(idle.get('host_mib'), '{:.0f}')} idle, "
                      f"{_fmt(after.get('host_mib'), '{:.0f}')} after")
    return ("MiB, from /proc/PID/status (anon: the process's own: its KV cache, compute buffers and, with repack, "
            "its own repacked copy of the weights; file: the mmapped GGUF, shared; shmem: syshaxd's KV ring and "
            "prefix cache):\n" + "\n".join(lines) + "\n" + "\n".join(totals))


def ttft_rows(results: dict, hetero: dict | None, ttft_name: str, long_len: int) -> list[dict]:
    rows = []
    for label in (PEER, OURS):
        levels = results.get(label, {}).get(ttft_name, [])
        rows.append({"server": label, "ttft_s": _median(r["ttft_s"] for lv in levels for r in lv["requests"]
                                                         if r["error"] is None)})
    if hetero:
        rows.append({"server": HETERO, "ttft_s": _median(h["ttft_s"] for h in hetero["handoffs"]
                                                          if h["role"] == "measured" and h["ok"])})
    peer = rows[0]["ttft_s"]
    for row in rows:
        row["over_llama_server"] = _ratio(row["ttft_s"], peer)
    return rows


def handoff_summary(hetero: dict, engine: dict | None, long_len: int) -> dict:
    """Bytes and time per prompt token through the ring, at --long-len (the median of its handoffs)."""
    read = [h for h in hetero["handoffs"] if h["records_read"] == 1]
    latency = (hetero["kv_status"] or {}).get("handoff_latency_s") or {}
    summary = {"tokens": long_len,
               "record_bytes": _median(h["bytes"] for h in read),
               "bytes_per_token": _median(h["bytes_per_token"] for h in read),
               "handoffs": len(hetero["handoffs"]), "imported": len(read),
               "daemon_latency_count": latency.get("count"),
               "daemon_latency_s": latency.get("p50"), "daemon_latency_p90_s": latency.get("p90"),
               "daemon_latency_p99_s": latency.get("p99")}
    summary["daemon_latency_ms_per_token"] = _ms(_ratio(summary["daemon_latency_s"], long_len))
    if engine:
        summary |= {"engine_export_s": engine["export_s"], "engine_import_s": engine["import_s"],
                    "engine_handoff_s": engine["handoff_s"], "engine_bytes": engine["bytes"],
                    "engine_prefill_s": engine["prefill_s"],
                    "engine_handoff_ms_per_token": _ms(engine["handoff_s"] / engine["tokens"]),
                    "engine_tokens": engine["tokens"]}
    return summary


def format_handoffs(hetero: dict, summary: dict, shape: dict) -> str:
    lines = ["| handoff | prompt tokens | TTFT s | imported | record MiB | bytes / token | fallbacks |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for h in hetero["handoffs"]:
        lines.append(f"| {h['role']} | {h['tokens']} | {_fmt(h['ttft_s'], '{:.2f}')} | {h['records_read']} | "
                     f"{h['bytes'] / MIB:.2f} | {_fmt(h['bytes_per_token'], '{:.0f}')} | "
                     f"{', '.join(f'{k} {v}' for k, v in h['fallbacks'].items()) or '-'} |")
    text = "hetero handoffs, each prompt alone (from /v1/syshax/status before and after):\n" + "\n".join(lines)
    overhead = _ratio(summary["bytes_per_token"], shape["kv_bytes_per_token_f16"])
    text += (f"\nf16 KV of this shape: {shape['kv_bytes_per_token_f16']} bytes a token; the ring's records: "
             f"{_fmt(summary['bytes_per_token'], '{:.0f}')} (x{_fmt(overhead, '{:.3f}')})")
    text += (f"\nthe daemon's handoff latency (prefill worker reported the record -> decoder imported it), over its "
             f"{_fmt(summary['daemon_latency_count'], '{}')} handoffs of {summary['tokens']} tokens: p50 "
             f"{_fmt(_ms(summary['daemon_latency_s']), '{:.1f}')} ms "
             f"({_fmt(summary['daemon_latency_ms_per_token'], '{:.4f}')} ms a token), p90 "
             f"{_fmt(_ms(summary['daemon_latency_p90_s']), '{:.1f}')} ms, p99 "
             f"{_fmt(_ms(summary['daemon_latency_p99_s']), '{:.1f}')} ms")
    if "engine_handoff_s" in summary:
        text += (f"\nin-process, one {summary['engine_tokens']}-token prompt: export into the ring "
                 f"{summary['engine_export_s'] * 1000:.1f} ms + import {summary['engine_import_s'] * 1000:.1f} ms = "
                 f"{summary['engine_handoff_s'] * 1000:.1f} ms for {summary['engine_bytes'] / MIB:.1f} MiB "
                 f"({summary['engine_handoff_ms_per_token']:.4f} ms a token; "
                 f"{100 * summary['engine_handoff_s'] / summary['engine_prefill_s']:.2f} % of its one-core prefill, "
                 f"{summary['engine_prefill_s']:.1f} s)")
    return text


def paper_figures(summary: dict | None, shape: dict, long_len: int, ring_bytes: int) -> dict:
    """The 32B model's ring, handoff time, KV and weights, scaled from this shape's measured bytes and times."""
    big = R1_32B
    per_token = big.kv_bytes_per_token()
    overhead = _ratio(summary and summary["bytes_per_token"], shape["kv_bytes_per_token_f16"]) or 1.0
    record = per_token * long_len * overhead
    out = {"model": asdict(big), "kv_bytes_per_token": per_token, "record_overhead": overhead,
           "record_bytes": record, "ring_size_mb_default": ring_bytes / MIB,
           "ring_bytes_for": {n: n * record for n in (1, 2, 4, 8, 16)},
           "kv_bytes_per_sequence": {ctx: ctx * per_token for ctx in (4096, 32768)},
           "weights_bytes_q4_0": big.weight_bytes(q8_output=False),
           "weights_bytes_q4_0_q8_output": big.weight_bytes(q8_output=True)}
    if summary:
        small_record = summary["record_bytes"]
        for key in ("daemon_latency_s", "engine_handoff_s"):
            measured, measured_bytes = summary.get(key), (summary.get("engine_bytes") if key == "engine_handoff_s"
                                                          else small_record)
            out[f"{key}_scaled"] = measured * record / measured_bytes if measured and measured_bytes else None
    return out


def format_paper(paper: dict, long_len: int) -> str:
    m = paper["model"]
    lines = [f"On paper, {m['name']} ({m['layers']} layers, {m['kv_heads']} KV heads of {m['head_dim']}, f16 KV: "
             f"{paper['kv_bytes_per_token'] // 1024} KiB a token):",
             f"* one {long_len}-token handoff record: {paper['record_bytes'] / MIB:.0f} MiB (this shape's records "
             f"carry x{paper['record_overhead']:.3f} the raw KV); the ring (ring_size_mb, default "
             f"{paper['ring_size_mb_default']:.0f}) for N at once: "
             + ", ".join(f"{n}: {b / GIB:.2f} GiB" for n, b in paper["ring_bytes_for"].items()),
             f"* handoff of one {long_len}-token prompt, scaled by bytes: in-process export + import "
             f"{_fmt(paper.get('engine_handoff_s_scaled'), '{:.2f}')} s; the daemon's reported -> imported "
             f"{_fmt(paper.get('daemon_latency_s_scaled'), '{:.2f}')} s",
             "* KV per sequence: " + ", ".join(f"{ctx // 1024}k context {b / GIB:.0f} GiB"
                                                for ctx, b in paper["kv_bytes_per_sequence"].items())
             + f" ({PARALLEL} sequences at 4k: {PARALLEL * paper['kv_bytes_per_sequence'][4096] / GIB:.0f} GiB)",
             f"* weights at q4_0: {paper['weights_bytes_q4_0'] / 1e9:.1f} GB; with the output matrix and token "
             f"embeddings in q8_0 (as syshaxd quantizes): {paper['weights_bytes_q4_0_q8_output'] / 1e9:.1f} GB"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    made_here = args.model is None
    args.model, build_s = prepare_model(args)
    shape = model_shape(args.model)
    binary = find_llama_server(args.llama_server)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # as bench_peers: the same threads for both
    os.environ.pop("CUSTOM_CPU_AFFINITY", None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_real_shape-", dir=args.json.parent))
    print(f"model {args.model} ({shape['file_bytes'] / MIB:.0f} MiB, {shape['layers']} layers, vocab "
          f"{shape['vocab']}{f', made in {build_s:.0f} s' if build_s else ''}); {args.threads} threads, {PARALLEL} "
          f"sequences of {args.n_ctx} tokens; llama-server {binary}; logs in {log_dir}", flush=True)
    loads = make_loads(args)
    work = Inputs(PromptBuilder(GGUFTokenizer(args.model)), loads, args.seed, args.long_len)
    servers: dict[str, dict] = {}
    hetero = engine = None
    try:
        results, memory = asyncio.run(phase_cpu_vs_peer(args, binary, log_dir, work, loads, servers))
        if not args.skip_hetero:
            hetero = asyncio.run(phase_hetero(args, log_dir, work, loads[-1], servers))
            memory[HETERO] = hetero["memory"]
            print(f"in-process handoff of one {args.long_len}-token prompt (prefill on one thread) ...", flush=True)
            engine = engine_handoff(args.model, args.long_len)
    except KeyboardInterrupt:
        print(f"\nbench_real_shape: interrupted; servers stopped; logs in {log_dir}", file=sys.stderr)
        return 130
    rows = summary_rows(loads, results)
    ttft = ttft_rows(results, hetero, loads[-1].name, args.long_len)
    handoff = handoff_summary(hetero, engine, args.long_len) if hetero else None
    ring_bytes = (hetero or {}).get("ring_capacity_bytes") or Config().ring_size_mb * MIB
    paper = paper_figures(handoff, shape, args.long_len, ring_bytes)
    document = {
        "schema": SCHEMA, "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0, "argv": sys.argv,
        "settings": {"threads": args.threads, "parallel": PARALLEL, "n_ctx": args.n_ctx, "long_len": args.long_len,
                     "ttft_repeats": args.ttft_repeats, "stagger_s": args.stagger, "repack": args.repack,
                     "quick": args.quick, "layers": args.layers, "seed": args.seed, "llama_server": binary,
                     "loads": [asdict(ld) for ld in loads]},
        "model": shape | ({"shape": args.shape, "note": SHAPE_SPECS[args.shape].note, "build_s": build_s}
                          if made_here else {"shape": None}),
        "machine": describe_machine(),
        "servers": servers,
        "memory": memory,
        "summary": rows,
        "ttft": ttft,
        "hetero": hetero,
        "engine_handoff": engine,
        "handoff": handoff,
        "paper_32b": paper,
        "results": results,
    }
    write_json(document, args.json)
    smoke = "--quick: a smoke test, " if args.quick else ""
    if args.layers:
        smoke += f"{args.layers} layers, not the shape's own: the pipeline only, "
    print(f"\n{OURS} (cpu mode) / {PEER}, {args.threads} threads each ({smoke}ratios: tok/s higher is better for "
          "syshaxd, TTFT and TPOT lower is better):\n")
    print(format_table(rows))
    print(f"\nTTFT of a {args.long_len}-token prompt (median of {args.ttft_repeats}; hetero: prefill on one core):")
    print("\n".join(f"  {r['server']:<15} {_fmt(r['ttft_s'], '{:.2f}')} s  ({_fmt(r['over_llama_server'], '{:.2f}')}x "
                    "llama-server)" for r in ttft))
    print("\nmemory " + format_memory(memory))
    if hetero:
        print("\n" + format_handoffs(hetero, handoff, shape))
    print("\n" + format_paper(paper, args.long_len))
    print("\n" + "\n".join(f"{label}: {shlex.join(info['argv'])}" for label, info in servers.items()))
    print(f"\nwhole run {document['wall_s']:.0f} s; figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
