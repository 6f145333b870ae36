"""What streaming costs syshaxd itself at concurrency 8: streamed against unstreamed tok/s of one daemon, and the
daemon's own CPU time per output token (issue 38).

bench_serving_cost.py's load (8 unique 128-token prompts decoding 256 tokens each at once, 16 requests a round) on
one syshaxd, streamed and not streamed alternating within each round (the first alternating from round to round),
so that both see the same drift of a shared machine. Per run: output tok/s, ITL p50 (streamed), the CPU time the
daemon's own process spent per output token (its workers not counted; of it, the kernel's part) and the client's:
on 2 cores each of those milliseconds is taken from the engine's two threads. The ratio streamed / unstreamed is the
figure to watch (1.00: a stream costs the daemon nothing a JSON answer does not); the CPU per token is the steadier
one where another load shares the machine, as tok/s follows that load.

Found on 2026-12-06 (AMD EPYC with AVX-512, 2 cores, 20 rounds a run, the client on uvloop, a round's ratio
anywhere from 0.82x to 1.18x on that noisy machine): 0.988x; the daemon 0.117 ms CPU per token streamed and 0.093
not, the client 0.056: streaming adds about 24 microseconds a token to the daemon. A run on a machine slowed by a
quarter gave 1.033x (0.140 against 0.116: its CPU times swell with the slowing).

--profile PATH runs the daemon under cProfile during the rounds (timed by its CPU clock), writes the stats to PATH
(pstats reads them) and prints the functions that took most of its CPU, per output token. The profiler's own cost
makes such a run's tok/s meaningless, not its ranking of where the daemon's time goes. Only the runs of one kind
are profiled: the streamed ones, or with --profile-kind unstreamed the others.

    .venv/bin/python bench/bench_stream_cost.py [--rounds 3] [--profile /tmp/daemon-profile.txt]
    .venv/bin/python bench/bench_stream_cost.py --rounds 1 --profile /tmp/u.prof --profile-kind unstreamed
    .venv/bin/python bench/bench_stream_cost.py --rounds 1 --profile /tmp/s.prof --compare /tmp/u.prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "plugins" / "llamacpp")]

import aiohttp  # noqa: E402
import psutil  # noqa: E402

import bench_peers  # noqa: E402
from bench_serving_cost import OUT, PROMPT, SLOTS, unstreamed  # noqa: E402
from syshaxd.benchmark.client import StreamingClient, run_level  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder  # noqa: E402
from syshaxd.benchmark.report import level_summary, write_json  # noqa: E402

RESULTS = HERE / "results" / "bench_stream_cost.json"


def run_profiled(path: str, argv: list[str]) -> int:
    """syshaxd's main(argv) under cProfile between SIGUSR1 and SIGUSR2, timed by the event loop's own CPU clock (a
    wall clock charges a syscall the time the kernel gave the client and the engine meanwhile); the stats go to
    path when main() returns (SIGTERM drains, then returns)."""
    import cProfile

    from syshaxd.daemon import main as daemon_main

    profile = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profile.disable())
    try:
        return daemon_main(argv)
    finally:
        profile.disable()
        profile.dump_stats(path)


def _own_times(path: str) -> dict:
    """Each function's own CPU time (seconds) in a saved profile."""
    import pstats

    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    return {key: (tt, calls) for key, (_, calls, tt, _, _) in stats.items()}


def print_profile(path: str, tokens: int, rows: int = 45, compare: str | None = None) -> None:
    """The functions that took most of the daemon's CPU (their own time), in microseconds per output token; a
    coroutine's calls count each time it resumed. With compare (a profile of the other kind, as many tokens): each
    function's time here less its time there, largest first: what one kind adds to the other."""
    own = _own_times(path)
    total = sum(tt for tt, _ in own.values())
    print(f"\nthe daemon's CPU under cProfile: {1e6 * total / tokens:.1f} us per output token; the top functions:")
    if compare is None:
        print("| us/token | calls/token | function |")
        print("|---:|---:|---|")
        for (tt, calls), (file, line, name) in sorted(((v, k) for k, v in own.items()), reverse=True)[:rows]:
            print(f"| {1e6 * tt / tokens:.2f} | {calls / tokens:.2f} | {Path(file).name}:{line}({name}) |")
        return
    other = _own_times(compare)
    print(f"against {compare}: {1e6 * sum(tt for tt, _ in other.values()) / tokens:.1f} us per output token\n")
    print("| us/token more | here | there | calls/token here | function |")
    print("|---:|---:|---:|---:|---|")
    ranked = sorted(((own.get(k, (0.0, 0))[0] - other.get(k, (0.0, 0))[0], k) for k in own.keys() | other.keys()),
                   reverse=True)
    for more, (file, line, name) in ranked[:rows]:
        here, calls = own.get((file, line, name), (0.0, 0))
        there = other.get((file, line, name), (0.0, 0))[0]
        print(f"| {1e6 * more / tokens:.2f} | {1e6 * here / tokens:.2f} | {1e6 * there / tokens:.2f} | "
              f"{calls / tokens:.2f} | {Path(file).name}:{line}({name}) |")


def _cpu_s(process: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user, system) the process itself has spent, its children not counted."""
    t = process.cpu_times()
    return t.user, t.system


async def start(args, log_dir: Path) -> bench_peers.Server:
    """syshaxd as bench_peers.py starts it, under cProfile with --profile."""
    command = daemon_command()
    if args.profile:
        command = [sys.executable, str(Path(__file__).resolve()), "--profiled-daemon",
                   str(Path(args.profile).resolve())]
    config = log_dir / "syshaxd.toml"
    config.write_text(
        f"model = {json.dumps(str(args.model))}\n"
        f"model_dir = {json.dumps(str(args.model.parent))}\n"
        'quantize = ""\n'
        f"threads = {args.threads}\n"
        f"cpu_max_batch_size = {SLOTS}\n"
        f"n_ctx = {args.n_ctx}\n"
        'repack = "auto"\n'
        f"admin_socket = {json.dumps(str(log_dir / 'admin.sock'))}\n"
        'log_level = "info"\n'
    )
    daemon = await start_daemon("cpu", command=command, config=str(config), startup_timeout_s=300,
                                log_dir=str(log_dir))
    return bench_peers.Server(bench_peers.OURS, daemon.url, daemon.process, {"pid": daemon.pid, "log": daemon.log_path})


async def measure(args, builder: PromptBuilder) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="bench_stream_cost-"))
    server = await start(args, log_dir)
    daemon = psutil.Process(server.process.pid)
    figures: dict = {"streamed": [], "unstreamed": [], "itl_s": []}
    me = psutil.Process()
    for key in ("cpu_ms_per_token", "system_cpu_ms_per_token", "client_cpu_ms_per_token",
                "client_system_cpu_ms_per_token"):
        figures[key] = {"streamed": [], "unstreamed": []}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            await bench_peers.warm_up(server, session, [builder.build(32, 1), builder.build(32, 2)])
            model = server.info["model"]
            for r in range(args.rounds):
                kinds = ["streamed", "unstreamed"] if r % 2 == 0 else ["unstreamed", "streamed"]
                for kind in kinds:
                    prompts = [builder.build(PROMPT, 10_000 * (r + 1) + (500 if kind == "unstreamed" else 0) + k)
                               for k in range(2 * SLOTS)]
                    cpu, client = _cpu_s(daemon), _cpu_s(me)
                    profiled = args.profile and kind == args.profile_kind
                    if profiled:
                        server.process.send_signal(signal.SIGUSR1)  # run_profiled: the runs of one kind alone
                    if kind == "streamed":
                        run = await run_level(StreamingClient(server.url, model, OUT), session, prompts, SLOTS,
                                              output_len=OUT)
                        summary = level_summary(run, OUT, None)
                        tok_s, tokens = summary["output_throughput_tok_s"], summary["output_tokens"]
                        figures["itl_s"].append(summary["itl_s"]["median"])
                    else:
                        tok_s = await unstreamed(session, server.url, model, prompts, SLOTS)
                        tokens = len(prompts) * OUT
                    if profiled:
                        server.process.send_signal(signal.SIGUSR2)
                    figures[kind].append(tok_s)
                    (user, system), (user0, system0) = _cpu_s(daemon), cpu
                    figures["cpu_ms_per_token"][kind].append(1000 * (user - user0 + system - system0) / tokens)
                    figures["system_cpu_ms_per_token"][kind].append(1000 * (system - system0) / tokens)
                    (user, system), (user0, system0) = _cpu_s(me), client
                    figures["client_cpu_ms_per_token"][kind].append(1000 * (user - user0 + system - system0) / tokens)
                    figures["client_system_cpu_ms_per_token"][kind].append(1000 * (system - system0) / tokens)
                print(f"  round {r + 1}: {figures['streamed'][-1]:.1f} tok/s streamed "
                      f"(ITL p50 {1000 * figures['itl_s'][-1]:.2f} ms, daemon "
                      f"{figures['cpu_ms_per_token']['streamed'][-1]:.3f} ms CPU/token), "
                      f"{figures['unstreamed'][-1]:.1f} not ({figures['cpu_ms_per_token']['unstreamed'][-1]:.3f} "
                      "ms CPU/token)", flush=True)
    finally:
        await server.stop()
    return figures


def main() -> int:
    if sys.argv[1:2] == ["--profiled-daemon"]:  # --profile's daemon: the rest is syshaxd's own argv
        return run_profiled(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", metavar="PATH", help="run the daemon under cProfile, its stats written to PATH")
    p.add_argument("--profile-kind", choices=("streamed", "unstreamed"), default="streamed",
                   help="which runs --profile profiles (default streamed): the two profiles' difference is what "
                        "streaming adds")
    p.add_argument("--compare", metavar="PATH",
                   help="with --profile: a profile of the other kind from a run of as many rounds (--profile-kind); "
                        "prints each function's time here less there")
    p.add_argument("--client-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the client's event loop (default uvloop, as `syshax benchmark` runs its client): the client "
                        "shares the 2 cores, and on asyncio's loop a streamed token costs it more CPU")
    p.add_argument("--json", default=str(RESULTS), help=f"where the figures go (default {RESULTS})")
    args = p.parse_args()
    args.model = bench_peers.default_tokenizer_path()
    args.n_ctx = 2048
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    builder = PromptBuilder(GGUFTokenizer(args.model))
    started = time.time()
    if args.client_loop == "uvloop":
        import uvloop

        f = uvloop.run(measure(args, builder))
    else:
        f = asyncio.run(measure(args, builder))
    ratios = [s / u for s, u in zip(f["streamed"], f["unstreamed"])]
    cpu = f["cpu_ms_per_token"]
    print(f"\nsyshaxd alone, {SLOTS} unique {PROMPT}-token prompts at once, {OUT} tokens each, {args.threads} threads; "
          f"medians over {args.rounds} rounds:\n")
    client = f["client_cpu_ms_per_token"]
    system, client_system = f["system_cpu_ms_per_token"], f["client_system_cpu_ms_per_token"]
    print("| | tok/s | ITL p50 ms | daemon CPU ms per token | of it in the kernel | client CPU ms per token "
          "| of it in the kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, label, itl in (("streamed", "streamed", f"{1000 * statistics.median(f['itl_s']):.2f}"),
                             ("unstreamed", "not streamed", "")):
        print(f"| {label} | {statistics.median(f[kind]):.1f} | {itl} | {statistics.median(cpu[kind]):.3f} | "
              f"{statistics.median(system[kind]):.3f} | {statistics.median(client[kind]):.3f} | "
              f"{statistics.median(client_system[kind]):.3f} |")
    print(f"\nstreamed / not streamed: {statistics.median(ratios):.3f}x (rounds: "
          f"{', '.join(f'{x:.3f}' for x in ratios)})")
    if args.profile:
        print_profile(args.profile, 2 * SLOTS * OUT * args.rounds, compare=args.compare)
    write_json({"schema": "syshax-bench-stream-cost/1", "started": started, "rounds": args.rounds,
                "client_loop": args.client_loop,
                "threads": args.threads, "profiled": bool(args.profile), "figures": f, "ratios": ratios}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
