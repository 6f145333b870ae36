"""syshaxd against llama.cpp's own llama-server on the same GGUF and threads, in one run; prints a markdown table, writes bench/results/bench_peers.json.

llama-server (C++, slots, continuous batching, prompt cache) is the strongest CPU
peer; it is built from the very llama.cpp that llama-cpp-python 0.3.36 vendors by
../shared/tools/llama-server.sh (once, about 5 minutes; cached after). Both servers
get the same GGUF, the same thread count, 8 parallel sequences, the same context per
sequence and flash attention. Both are started, and only one of them is loaded at any time:
each load runs on one server, then on the other, the first alternating from load to
load and round to round (--rounds N runs every load N times, each round with prompts
of its own seed, so that no round finds the one before it in a cache). This machine's
speed drifts by 10 % and more within minutes; side by side in time, both servers see
the same drift, where running every load on one server and then on the other made the
second server's figures up to 20 % worse or better than a repeat gave. The loads:

* short, unique prompts: 128 tokens in, 256 forced out, at concurrency 1, 8, 16;
* short, one prompt repeated: the same 128-token prompt at concurrency 8 (a prompt cache's case);
* chat: 8 conversations x 6 turns behind a shared 512-token system prompt, each turn resending
  the whole history (32-token user messages, 64-token answers); TTFT per turn in its own table;
* staggered finish: 48 requests at concurrency 8 whose max_tokens run from 128 to 256 in a
  shuffled order, so batch slots free in scattered order, with unique 100-token prompts,
  with one 100-token prompt repeated, and with a shared 128-token prefix (about 100 words)
  before a unique 32-token tail.

`--set seed` runs the seed article's three scenarios instead, each with unique prompts arriving 0.5 s apart
(so prompts and decodes overlap, as a server's users do): short, 128 tokens in and 256 out at concurrency
1, 8 and 16; medium, 512 in and 1,024 out at 1, 4 and 8; long, 2,048 in and 512 out at 1, 2 and 4 (twice
the concurrency in requests, at least 2). Their contexts need `--n-ctx` 4096, which the set takes when
none is given. `--set all` runs both sets. Found on 2026-12-06 (AMD EPYC with AVX-512, 2 threads each, the default
model, one run of 696 s, llama.cpp patches 0008 and 0009), syshaxd / llama-server: tok/s 1.18x to 2.27x at every
level; TTFT p50 0.46x (medium c=8) to 1.00x (short c=8), but long c=2 1.11x (the p50 of 4 requests: 0.90x to
1.61x from run to run); a 2,048-token prompt alone 3.68 s against 3.64 s
(docs/performance.md: the table).

Per load and server: output tokens/s, TTFT p50, TPOT p50, and the ratio syshaxd / llama-server
(throughput: higher is better for syshaxd; latency: lower is); with rounds, the median of the rounds'
figures and of their ratios, and each round's tok/s ratio. Prompts are exact in the model's
tokens (syshaxd/benchmark/prompts.py), the same on both servers; outputs are forced (ignore_eos).

    .venv/bin/python bench/bench_peers.py            # the issue's loads, about 10 minutes on 2 quiet cores
    .venv/bin/python bench/bench_peers.py --quick    # fewer and shorter requests: a smoke test
    .venv/bin/python bench/bench_peers.py --repack off   # both servers with plain kernels (weight repacking off)
    .venv/bin/python bench/bench_peers.py --load chat --load shared   # only the loads whose names hold these
    .venv/bin/python bench/bench_peers.py --rounds 3   # every load 3 times on each server, interleaved
    .venv/bin/python bench/bench_peers.py --set seed   # the seed's short, medium and long scenarios
    .venv/bin/python bench/bench_peers.py --set seed --load long   # the long prompts alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from syshaxd.benchmark.chat import build_conversations, run_conversations  # noqa: E402
from syshaxd.benchmark.client import StreamingClient, list_models, run_level  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, free_port, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, Prompt, PromptBuilder, default_tokenizer_path  # noqa: E402
from syshaxd.benchmark.report import level_summary, write_json  # noqa: E402
from syshaxd.benchmark.resources import ResourceSampler, describe_machine  # noqa: E402

SCHEMA = "syshax-bench-peers/1"
PEER, OURS = "llama-server", "syshaxd"
LLAMA_SERVER_SH = REPO.parent / "shared/tools/llama-server.sh"
PARALLEL = 8  # llama-server's -np and syshaxd's cpu_max_batch_size


@dataclass(frozen=True)
class Load:
    """One workload, run the same way on both servers."""

    name: str
    # "unique", "repeated" (one prompt for every request), "chat", "staggered", "staggered-repeated",
    # "staggered-shared" (one prefix of prefix_len tokens before each request's unique tail)
    kind: str
    concurrency: int
    requests: int  # conversations for chat
    input_len: int  # per user message for chat
    output_len: int  # the shortest max_tokens of a staggered load
    output_max: int | None = None  # staggered: the longest max_tokens
    system_len: int = 0  # chat
    turns: int = 1  # chat
    prefix_len: int = 0  # staggered-shared
    arrival_gap_s: float = 0.0  # staggered arrivals: the first `concurrency` requests sent this far apart


# the seed article's scenarios: (name, tokens in, tokens out, concurrencies); --quick shortens the outputs
SEED_SCENARIOS = (("short", 128, 256, (1, 8, 16)), ("medium", 512, 1024, (1, 4, 8)), ("long", 2048, 512, (1, 2, 4)))
SETS = ("issue", "seed", "all")


def seed_loads(quick: bool) -> list[Load]:
    """The seed's three scenarios: unique prompts, staggered arrivals, forced outputs."""
    return [Load(f"seed {name} c={c}", "unique", c, max(2, 2 * c) if not quick else max(1, c), n_in,
                 n_out // 8 if quick else n_out, arrival_gap_s=0.5)
            for name, n_in, n_out, levels in SEED_SCENARIOS for c in levels]


def load_set(which: str, quick: bool) -> list[Load]:
    return {"issue": loads(quick), "seed": seed_loads(quick), "all": loads(quick) + seed_loads(quick)}[which]


def loads(quick: bool) -> list[Load]:
    """The issue's loads; quick keeps their shapes with fewer and shorter requests."""
    out = 16 if quick else 256
    short = [Load(f"short c={c}", "unique", c, (max(2, c) if quick else max(4, 2 * c)), 128, out) for c in (1, 8, 16)]
    lo, hi, n = (8, 24, 16) if quick else (128, 256, 48)
    turns = 2 if quick else 6
    return [
        *short,
        Load("short repeated c=8", "repeated", 8, 8 if quick else 16, 128, out),
        Load(f"chat 8x{turns}", "chat", 8, 8, 32, 8 if quick else 64, system_len=512, turns=turns),
        Load("staggered unique c=8", "staggered", 8, n, 100, lo, hi),
        Load("staggered repeated c=8", "staggered-repeated", 8, n, 100, lo, hi),
        Load("staggered shared-prefix c=8", "staggered-shared", 8, n, 160, lo, hi, prefix_len=128),
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="GGUF both servers load (default: the prepared q4_0 SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="threads for both servers (default: 2)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests, for a smoke test")
    p.add_argument("--n-ctx", type=int,
                   help="context per sequence on both servers; llama-server gets -c n_ctx x 8 (default: 2048, "
                   "4096 with --set seed or all)")
    p.add_argument("--set", choices=SETS, default="issue", dest="load_set",
                   help="which loads: the issue's (short prompts, chat, staggered finishes), the seed article's "
                   "three scenarios (short, medium, long prompts), or all (default: issue)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words (default: 0)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="the llama-server binary (default: what ../shared/tools/llama-server.sh prints, built there"
                   " the first time)")
    p.add_argument("--rounds", type=int, default=1, help="run every load this many times on each server, "
                   "interleaved, each round with prompts of its own (default: 1)")
    p.add_argument("--only", choices=(PEER, OURS), help="run one server only (the ratios are then missing)")
    p.add_argument("--load", action="append", default=[], metavar="TEXT",
                   help="run only the loads whose names contain TEXT (repeatable; default: every load)")
    p.add_argument("--repack", choices=("auto", "on", "off"), default="auto",
                   help="weight repacking on both servers: syshaxd's repack key; llama-server's --repack / --no-repack"
                   " (auto: its default, on) (default: auto)")
    p.add_argument("--speculative-tokens", type=int, help="syshaxd's speculative_tokens (default: the daemon's "
                   "default)")
    p.add_argument("--json", type=Path, help="where the figures go (default: bench/results/bench_peers.json;"
                   " bench_peers-seed.json with --set seed, ...-quick.json with --quick)")
    args = p.parse_args(argv)
    args.model = (args.model or default_tokenizer_path()).resolve()
    if not args.model.is_file():
        p.error(f"--model: {args.model} is not a file; prepare the default model (make run) or give a GGUF")
    if args.threads < 1:
        p.error(f"--threads: {args.threads} is not allowed; it must be at least 1")
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds} is not allowed; it must be at least 1")
    need = max(ld.system_len + ld.turns * (ld.input_len + (ld.output_max or ld.output_len)) + 16 * ld.turns
               for ld in load_set(args.load_set, args.quick))
    if args.n_ctx is None:
        args.n_ctx = 2048 if args.load_set == "issue" else 4096
    if args.n_ctx < need:
        p.error(f"--n-ctx {args.n_ctx} cannot hold the longest request ({need} tokens with the chat template)")
    if args.json is None:
        name = "bench_peers" + ("" if args.load_set == "issue" else f"-{args.load_set}") + ("-quick" if args.quick else "")
        args.json = REPO / "bench/results" / f"{name}.json"
    return args


def find_llama_server(given: str | None) -> str:
    """The llama-server binary: given, or built (once) and printed by ../shared/tools/llama-server.sh."""
    if given:
        return given
    if not LLAMA_SERVER_SH.is_file():
        raise SystemExit(f"bench_peers: {LLAMA_SERVER_SH} is missing; give --llama-server PATH")
    print(f"finding llama-server with {LLAMA_SERVER_SH} (builds it the first time, about 5 minutes) ...", flush=True)
    done = subprocess.run(["bash", str(LLAMA_SERVER_SH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not os.access(path, os.X_OK):
        raise SystemExit(f"bench_peers: {LLAMA_SERVER_SH} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return path


class Server:
    """One running server: its URL, process and how it was started."""

    def __init__(self, label: str, url: str, process: subprocess.Popen, info: dict):
        self.label, self.url, self.process, self.info = label, url, process, info

    async def stop(self) -> None:
        self.info["exited_during_run"] = self.process.poll() is not None
        self.info["returncode"] = await stop_daemon(self.process, grace_s=15)


async def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300) -> float:
    """Seconds until GET /health answers 200 (llama-server answers 503 while it loads)."""
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.perf_counter() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{_tail(log)}")
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return time.perf_counter() - started
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.25)
    await stop_daemon(process)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def start_peer(args: argparse.Namespace, binary: str, log_dir: Path) -> Server:
    port = free_port()
    # -np given, so no unified KV (that is the default only for -np auto): each slot gets -c / np = n_ctx
    # tokens, as syshaxd's slots each have their own stream. Continuous batching, the slots' prompt cache
    # and the host-memory prompt cache (--cache-ram 8192 MiB) are on by default in this version (0.5.0-dev,
    # commit 0c1e570); flash attention on, as syshaxd's engine uses it.
    argv = [binary, "-m", str(args.model), "-t", str(args.threads), "-tb", str(args.threads),
            "-c", str(args.n_ctx * PARALLEL), "-np", str(PARALLEL), "-fa", "on",
            "--host", "127.0.0.1", "--port", str(port), "--no-repack" if args.repack == "off" else "--repack"]
    log = log_dir / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    startup = await wait_healthy(url, proc, log)
    return Server(PEER, url, proc, {"argv": argv, "pid": proc.pid, "log": str(log), "startup_s": startup})


async def start_ours(args: argparse.Namespace, log_dir: Path) -> Server:
    config = log_dir / "syshaxd.toml"
    config.write_text(
        "# written by bench/bench_peers.py\n"
        f"model = {json.dumps(str(args.model))}\n"
        f"model_dir = {json.dumps(str(args.model.parent))}\n"
        'quantize = ""\n'  # the file is q4_0 already: load it as llama-server does
        f"threads = {args.threads}\n"
        f"cpu_max_batch_size = {PARALLEL}\n"
        f"n_ctx = {args.n_ctx}\n"
        f"repack = {json.dumps(args.repack)}\n"
        f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"  # not the default one another syshaxd may hold
        'log_level = "info"\n'
        # other benches start syshaxd with parsers of their own, which may not have the option
        + (f"speculative_tokens = {args.speculative_tokens}\n" if getattr(args, "speculative_tokens", None) is not None
           else "")
    )
    daemon = await start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                                log_dir=str(log_dir))
    return Server(OURS, daemon.url, daemon.process, {"argv": daemon.argv, "pid": daemon.pid, "log": daemon.log_path,
                                                     "startup_s": daemon.startup_s, "config": config.read_text()})


class Workloads:
    """The prompts of every load in one round, built once with the model's tokenizer: both servers get the very
    same. Each round has a seed of its own."""

    def __init__(self, args: argparse.Namespace, round_index: int = 0, builder: PromptBuilder | None = None):
        self.builder = builder or PromptBuilder(GGUFTokenizer(args.model))
        self.seed = args.seed + 7919 * round_index
        self.loads = [ld for ld in load_set(args.load_set, args.quick)
                      if not args.load or any(t in ld.name for t in args.load)]
        if not self.loads:
            raise SystemExit(f"bench_peers: no load's name contains {' or '.join(map(repr, args.load))}")
        self.inputs = {ld.name: self._inputs(i, ld) for i, ld in enumerate(self.loads)}
        self.warmup = [self.builder.build(32, self._seed(99, k)) for k in range(2)]

    def _seed(self, load_index: int, k: int) -> int:
        return (self.seed * 1_000_003 + load_index) * 1_000_033 + k

    def _inputs(self, i: int, ld: Load):
        if ld.kind == "chat":
            return build_conversations(self.builder, ld.requests, system_len=ld.system_len, turn_len=ld.input_len,
                                       turns=ld.turns, seed=self.seed, user_seed=lambda k: self._seed(i, k))
        if ld.kind in ("repeated", "staggered-repeated"):
            prompts = [self.builder.build(ld.input_len, self._seed(i, 0))] * ld.requests
        elif ld.kind == "staggered-shared":
            prefix = self.builder.build(ld.prefix_len, self._seed(i, 0))
            prompts = [Prompt(prefix.text + self.builder.build(ld.input_len - ld.prefix_len, self._seed(i, k + 2)).text,
                              ld.input_len, self._seed(i, k + 2)) for k in range(ld.requests)]
        else:
            prompts = [self.builder.build(ld.input_len, self._seed(i, k)) for k in range(ld.requests)]
        if ld.output_max is None:
            return prompts, ld.output_len
        # Evenly from output_len to output_max, shuffled (the same order on both servers).
        span = ld.output_max - ld.output_len
        lengths = [ld.output_len + span * k // max(1, ld.requests - 1) for k in range(ld.requests)]
        random.Random(self._seed(i, 1)).shuffle(lengths)
        return prompts, lengths


async def warm_up(server: Server, session: aiohttp.ClientSession, prompts: list[Prompt]) -> None:
    """Learn the server's model name (server.info["model"]) and run the prompts at once, 8 tokens each."""
    (model, *_) = await list_models(session, server.url) or ["default"]
    server.info["model"] = model
    warm = StreamingClient(server.url, model, 8)
    await run_level(warm, session, prompts, len(prompts))


async def run_load(server: Server, session: aiohttp.ClientSession, work: Workloads, ld: Load, tag: str,
                   sample_interval: float = 0.5) -> dict:
    """One load against one server: its level summary."""
    model = server.info["model"]
    print(f"  [{server.label}{tag}] {ld.name}: {ld.requests}{f' x {ld.turns} turns' if ld.kind == 'chat' else ''}"
          " requests ...", end="", flush=True)
    sampler = ResourceSampler(server.process.pid, sample_interval).start()
    try:
        if ld.kind == "chat":
            client = StreamingClient(server.url, model, ld.output_len, endpoint="chat")
            run = await run_conversations(client, session, work.inputs[ld.name], ld.concurrency)
            expected = ld.output_len
        else:
            prompts, lengths = work.inputs[ld.name]
            client = StreamingClient(server.url, model, ld.output_len)
            run = await run_level(client, session, prompts, ld.concurrency, output_len=lengths,
                                  arrival_gap_s=ld.arrival_gap_s)
            expected = lengths if isinstance(lengths, int) else None
    finally:
        resources = sampler.stop()
    summary = level_summary(run, expected, resources)
    summary["load"] = ld.name
    print(f" {summary['output_throughput_tok_s']:.1f} tok/s, {summary['completed']}/{summary['sent']} ok"
          f"{', ' + str(summary['retries']) + ' retried' if summary['retries'] else ''}", flush=True)
    if server.process.poll() is not None:
        raise RuntimeError(f"{server.label} exited with {server.process.returncode} during {ld.name}")
    return summary


def _ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours is not None and peer else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary_rows(loads_run: list[Load], results: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Per load: each server's figures (the median over rounds) and the ratios (the median of the rounds' ratios:
    each round's two runs were side by side in time)."""
    rows = []
    for ld in loads_run:
        peer, ours = results.get(PEER, {}).get(ld.name, []), results.get(OURS, {}).get(ld.name, [])
        row = {"load": ld.name, "concurrency": ld.concurrency, "requests": ld.requests * ld.turns,
               "rounds": max(len(peer), len(ours)), "shape": asdict(ld)}
        for key, pick in (("tok_s", lambda lv: lv["output_throughput_tok_s"]),
                          ("ttft_p50_s", lambda lv: lv["ttft_s"]["median"]),
                          ("tpot_p50_s", lambda lv: lv["tpot_s"]["median"])):
            row[f"peer_{key}"] = _median([pick(lv) for lv in peer])
            row[f"ours_{key}"] = _median([pick(lv) for lv in ours])
            per_round = [_ratio(pick(o), pick(p)) for p, o in zip(peer, ours)]
            row[f"ratio_{key}"] = _median(per_round)
            if key == "tok_s":
                row["ratio_tok_s_rounds"] = per_round
        for side, levels in (("peer", peer), ("ours", ours)):
            row[f"{side}_ok"] = (f"{sum(lv['completed'] for lv in levels)}/{sum(lv['sent'] for lv in levels)}"
                                 if levels else None)
            row[f"{side}_retries"] = sum(lv["retries"] for lv in levels) if levels else None
            row[f"{side}_other_cpu_percent"] = _median([((lv.get("resources") or {}).get("other_cpu_percent")
                                                          or {}).get("mean") for lv in levels])
        rows.append(row)
    return rows


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def format_table(rows: list[dict]) -> str:
    """One markdown table: both servers and syshaxd / llama-server per load."""
    header = ["load", "requests", f"{PEER} tok/s", f"{OURS} tok/s", "tok/s ratio", "per round",
              f"{PEER} TTFT p50 ms", f"{OURS} TTFT p50 ms", "TTFT ratio",
              f"{PEER} TPOT p50 ms", f"{OURS} TPOT p50 ms", "TPOT ratio", "ok (peer / ours)", "retried (peer / ours)",
              "other CPU % (peer / ours)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    for r in rows:
        cells = [r["load"], str(r["requests"]),
                 _fmt(r["peer_tok_s"], "{:.1f}"), _fmt(r["ours_tok_s"], "{:.1f}"), _fmt(r["ratio_tok_s"], "{:.2f}x"),
                 " ".join(_fmt(x, "{:.2f}") for x in r["ratio_tok_s_rounds"]) or "-",
                 _fmt(_ms(r["peer_ttft_p50_s"]), "{:.1f}"), _fmt(_ms(r["ours_ttft_p50_s"]), "{:.1f}"),
                 _fmt(r["ratio_ttft_p50_s"], "{:.2f}x"),
                 _fmt(_ms(r["peer_tpot_p50_s"]), "{:.2f}"), _fmt(_ms(r["ours_tpot_p50_s"]), "{:.2f}"),
                 _fmt(r["ratio_tpot_p50_s"], "{:.2f}x"),
                 f"{r['peer_ok'] or '-'} / {r['ours_ok'] or '-'}",
                 f"{_fmt(r['peer_retries'], '{}')} / {_fmt(r['ours_retries'], '{}')}",
                 f"{_fmt(r['peer_other_cpu_percent'], '{:.0f}')} / {_fmt(r['ours_other_cpu_percent'], '{:.0f}')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_turns(loads_run: list[Load], results: dict[str, dict[str, list[dict]]]) -> str:
    """The chat load's TTFT p50 per turn on each server (the median over rounds), as markdown."""
    chat = next(ld for ld in loads_run if ld.kind == "chat")
    header = ["server", *(f"turn {t}" for t in range(1, chat.turns + 1))]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * chat.turns]
    per_server = {}
    for label in (PEER, OURS):
        levels = results.get(label, {}).get(chat.name)
        if not levels:
            continue
        per_server[label] = {t: _median([row["ttft_s"]["median"] for lv in levels for row in lv.get("turns", ())
                                         if row["turn"] == t]) for t in range(1, chat.turns + 1)}
        lines.append("| " + " | ".join([label, *(_fmt(None if per_server[label].get(t) is None
                                                       else per_server[label][t] * 1000, "{:.1f}")
                                                  for t in range(1, chat.turns + 1))]) + " |")
    if len(per_server) == 2:
        lines.append("| " + " | ".join([f"{OURS}/{PEER}", *(_fmt(_ratio(per_server[OURS].get(t), per_server[PEER].get(t)),
                                                                   "{:.2f}x") for t in range(1, chat.turns + 1))]) + " |")
    return f"chat ({chat.requests} conversations x {chat.turns} turns, {chat.system_len}-token system prompt), TTFT p50 ms per turn:\n" + "\n".join(lines)


async def run_all(args: argparse.Namespace, binary: str | None, rounds: list[Workloads], log_dir: Path,
                  servers: dict[str, dict]) -> dict[str, dict[str, list[dict]]]:
    """Both servers up; every load of every round on each, one server loaded at a time, the first alternating."""
    labels = [label for label in (PEER, OURS) if not args.only or label == args.only]
    results: dict[str, dict[str, list[dict]]] = {label: {} for label in labels}
    started: dict[str, Server] = {}
    try:
        for label in labels:
            print(f"starting {label} ...", flush=True)
            server = await (start_peer(args, binary, log_dir) if label == PEER else start_ours(args, log_dir))
            started[label] = server
            servers[label] = server.info
            print(f"  {label} ready at {server.url} after {server.info['startup_s']:.1f} s", flush=True)
        connector = aiohttp.TCPConnector(limit=64, limit_per_host=64)
        async with aiohttp.ClientSession(connector=connector) as session:
            for server in started.values():
                await warm_up(server, session, rounds[0].warmup)
            for i, ld in enumerate(rounds[0].loads):
                for r, work in enumerate(rounds):
                    order = labels if (i + r) % 2 == 0 else labels[::-1]
                    for label in order:
                        tag = f", round {r + 1}" if len(rounds) > 1 else ""
                        summary = await run_load(started[label], session, work, ld, tag)
                        summary["round"] = r + 1
                        results[label].setdefault(ld.name, []).append(summary)
    finally:
        for server in started.values():
            await server.stop()
    return results


def stop_on_sigterm(signum, frame) -> None:
    # Python's default SIGTERM ends the process without its finally blocks: the servers would outlive it.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    binary = None if args.only == OURS else find_llama_server(args.llama_server)
    # Same threads for both, whatever this shell exported; no pinning of one server only.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.pop("CUSTOM_CPU_AFFINITY", None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_peers-", dir=args.json.parent))
    print(f"model {args.model}, {args.threads} threads each, {PARALLEL} parallel sequences of {args.n_ctx} tokens;"
          f" llama-server {binary}; logs in {log_dir}", flush=True)
    first = Workloads(args)
    rounds = [first, *(Workloads(args, r, first.builder) for r in range(1, args.rounds))]
    servers: dict[str, dict] = {}
    try:
        results = asyncio.run(run_all(args, binary, rounds, log_dir, servers))
    except KeyboardInterrupt:
        print(f"\nbench_peers: interrupted; servers stopped; logs in {log_dir}", file=sys.stderr)
        return 130
    rows = summary_rows(first.loads, results)
    document = {
        "schema": SCHEMA,
        "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "argv": sys.argv,
        "settings": {"model": str(args.model), "threads": args.threads, "parallel": PARALLEL, "n_ctx": args.n_ctx,
                     "repack": args.repack, "quick": args.quick, "set": args.load_set, "seed": args.seed, "rounds": args.rounds,
                     "llama_server": binary, "loads": [asdict(ld) for ld in first.loads]},
        "machine": describe_machine(),
        "servers": servers,
        "summary": rows,
        "results": results,
    }
    write_json(document, args.json)
    print()
    print(f"{OURS} / {PEER} ({args.threads} threads each, {'--quick: a smoke test, ' if args.quick else ''}"
          "ratios: tok/s higher is better for syshaxd, TTFT and TPOT lower is better):")
    print()
    print(format_table(rows))
    print()
    if any(ld.kind == "chat" for ld in first.loads):
        print(format_turns(first.loads, results))
    notes = [f"{label}: {shlex.join(info['argv'])}" for label, info in servers.items()]
    print("\n" + "\n".join(notes))
    print(f"\nwhole run {document['wall_s']:.0f} s; figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
