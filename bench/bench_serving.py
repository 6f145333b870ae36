"""syshaxd against llama_cpp.server on the same model and threads, in one run; prints a table, writes bench/results/bench_serving.json.

The serving comparison with llama.cpp's own server. Both servers are started here on free loopback ports
(same GGUF, same thread count, flash attention on both, since syshaxd's engine uses
it), then `syshax benchmark --url llama_cpp.server=... --url syshaxd=...` runs one
concurrency level at a time (128-token prompts, 256 forced output tokens by default),
alternating the servers level by level so that a drift of the machine hits both.
Each level sends max(min_iterations, factor x concurrency) requests. The table shows
output tokens/s per server and the ratio syshaxd / llama_cpp.server against the
aims (>= 0.9x at concurrency 1, >= 2.5x at concurrency 8). Both servers are
stopped at the end, also on failure or Ctrl-C.

    .venv/bin/python bench/bench_serving.py            # the full table, ~5 minutes on 2 cores
    .venv/bin/python bench/bench_serving.py --concurrency 1,8 --output-len 64   # quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import syshaxd.benchmark  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, free_port, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import default_tokenizer_path  # noqa: E402
from syshaxd.benchmark.report import format_report, ratios, write_json  # noqa: E402
from syshaxd.benchmark.resources import describe_machine  # noqa: E402

SCHEMA = "syshax-bench-serving/1"
PEER, OURS = "llama_cpp.server", "syshaxd"
# The aims for syshaxd / llama_cpp.server output tokens/s, per concurrency: as fast alone, and
# continuous batching well ahead at 8.
AIMS = {1: 0.9, 8: 2.5}
# Other processes using more of a core than this (mean) during a level make it worth running again.
DISTURBED_PERCENT = 25.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="GGUF both servers load (default: the prepared q4_0 SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="threads for both servers (default: 2)")
    p.add_argument("--batch-size", type=int, default=8, help="syshaxd's cpu_max_batch_size (default: 8)")
    p.add_argument("--concurrency", default="1,8,16", help="levels (default: 1,8,16)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=256, help="forced output tokens (default: 256)")
    p.add_argument("--iterations-factor", type=int, default=2, help="requests per level = factor x concurrency (default: 2)")
    p.add_argument("--min-iterations", type=int, default=4, help="but at least this many (default: 4)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per server before each level (default: 1)")
    p.add_argument("--n-ctx", type=int, default=2048, help="llama_cpp.server's --n_ctx (default: 2048)")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/bench_serving.json", help="where the figures go")
    p.add_argument("--plot", type=Path, default=None, help="also draw a PNG (default: beside --json)")
    p.add_argument("--no-plot", action="store_true", help="draw no PNG")
    p.add_argument("--quiet-percent", type=float, default=20.0,
                   help="before each level, wait until other processes use less than this %% of a core (default: 20)")
    p.add_argument("--quiet-timeout", type=float, default=60.0,
                   help="longest wait for that, seconds; 0: do not wait (default: 60)")
    p.add_argument("--retries", type=int, default=1,
                   help="run a level again, for the server it disturbed, when other processes took more than"
                   " 25%% of a core during it (default: 1); each server's least disturbed try is kept")
    args = p.parse_args(argv)
    args.model = (args.model or default_tokenizer_path()).resolve()
    if not args.model.is_file():
        p.error(f"--model: {args.model} is not a file; prepare the default model (make run) or give a GGUF")
    args.levels = sorted({int(c) for c in args.concurrency.split(",")})
    if args.input_len + args.output_len + 8 > args.n_ctx:
        p.error(f"--n-ctx {args.n_ctx} cannot hold {args.input_len} + {args.output_len} tokens")
    if args.plot is None and not args.no_plot:
        args.plot = args.json.with_suffix(".png")
    return args


def wait_ok(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> float:
    """Seconds until url answers 200; raises with the log's tail if the process exits or never answers."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s:\n{tail(log)}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_peer(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, str, dict]:
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(args.n_ctx),
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--flash_attn", "True",
            # by default it ends a running stream as soon as another request arrives
            "--interrupt_requests", "False"]
    log = log_dir / "llama_cpp.server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        startup = wait_ok(url + "/v1/models", proc, log)
    except BaseException:
        stop_peer(proc)
        raise
    return proc, url, {"argv": argv, "pid": proc.pid, "log": str(log), "startup_s": startup}


def stop_peer(proc: subprocess.Popen) -> int | None:
    return asyncio.run(stop_daemon(proc, grace_s=15))


def start_ours(args: argparse.Namespace, log_dir: Path):
    config = log_dir / "syshaxd.toml"
    config.write_text(
        "# written by bench/bench_serving.py\n"
        f"model = {json.dumps(str(args.model))}\n"
        f"model_dir = {json.dumps(str(args.model.parent))}\n"
        'quantize = ""\n'  # the file is q4_0 already: load it as llama_cpp.server does
        f"threads = {args.threads}\n"
        f"cpu_max_batch_size = {args.batch_size}\n"
        'log_level = "info"\n'
    )
    daemon = asyncio.run(start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                                      log_dir=str(log_dir)))
    return daemon, {"argv": daemon.argv, "pid": daemon.pid, "log": daemon.log_path, "startup_s": daemon.startup_s,
                    "config": config.read_text()}


def _process_groups(pids: dict[str, int]) -> dict[str, list]:
    import psutil

    groups = {}
    for label, pid in pids.items():
        root = psutil.Process(pid)
        groups[label] = [root, *root.children(recursive=True)]
    return groups


def cpu_use(pids: dict[str, int], seconds: float = 2.0) -> tuple[dict[str, float], float]:
    """CPU % (100 = one core) of each server with its children, and of everything else on the host, over seconds."""
    import psutil

    groups = _process_groups(pids)
    groups["benchmark"] = [psutil.Process()]
    for group in groups.values():
        for proc in group:
            proc.cpu_percent(None)
    psutil.cpu_percent(None, percpu=True)
    time.sleep(seconds)
    host = sum(psutil.cpu_percent(None, percpu=True))
    used = {}
    for label, group in groups.items():
        total = 0.0
        for proc in group:
            with contextlib.suppress(psutil.Error):
                total += proc.cpu_percent(None)
        used[label] = round(total, 1)
    other = max(0.0, host - sum(used.values()))
    del used["benchmark"]
    return used, round(other, 1)


def wait_quiet(pids: dict[str, int], limit_percent: float, timeout_s: float) -> dict:
    """Wait until other processes use less than limit_percent of a core: on 2 cores, a test suite beside
    the benchmark takes a core from whichever server is measured (llama.cpp's spinning threads suffer most)."""
    started = time.perf_counter()
    said = False
    while True:
        _, other = cpu_use(pids)
        waited = time.perf_counter() - started
        if other < limit_percent or waited >= timeout_s:
            if said:
                print(f"    ... {'quiet' if other < limit_percent else 'still busy, going on'} after {waited:.0f} s",
                      flush=True)
            return {"waited_s": round(waited, 1), "other_cpu_percent": other, "quiet": other < limit_percent}
        if not said:
            print(f"    other processes use {other:.0f}% of a core; waiting up to {timeout_s:.0f} s for quiet",
                  flush=True)
            said = True


def bench_level(args: argparse.Namespace, concurrency: int, urls: dict[str, str], pids: dict[str, int],
                out_dir: Path, attempt: int = 0) -> dict:
    """One `syshax benchmark` run of one level against both servers; returns its JSON document."""
    iterations = max(args.min_iterations, args.iterations_factor * concurrency)
    path = out_dir / f"level-{concurrency}-{attempt}.json"
    argv = ["--scenario", "custom", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--concurrency", str(concurrency), "--iterations", str(iterations), "--warmup", str(args.warmup),
            "--tokenizer", str(args.model), "--json", str(path)]
    for label in urls:  # PEER first: the first --url is the ratios' denominator
        argv += ["--url", f"{label}={urls[label]}", "--server-pid", str(pids[label])]
    print(f"  concurrency {concurrency}: {iterations} requests per server"
          f"{f' (try {attempt + 1})' if attempt else ''} ...", flush=True)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = syshaxd.benchmark.main(argv)
    path.with_suffix(".txt").write_text(report.getvalue())
    if code != 0 or not path.is_file():
        raise RuntimeError(f"syshax benchmark {' '.join(argv)} exited with {code}:\n{report.getvalue()}")
    return json.loads(path.read_text())


def least_disturbed_level(args: argparse.Namespace, concurrency: int, urls: dict[str, str], pids: dict[str, int],
                          out_dir: Path, quiet: dict, tries: list[dict]) -> dict:
    """One level's document, each server's figures from its least disturbed try.

    A server whose level ran while other processes took more than DISTURBED_PERCENT of a
    core runs it again (--retries), alone; the other keeps what it had.
    """
    best: dict[str, tuple[float, dict, int]] = {}  # label -> (other CPU %, target, try)
    todo = [PEER, OURS]
    doc = None
    for attempt in range(1 + max(0, args.retries)):
        if args.quiet_timeout > 0:
            quiet[concurrency] = wait_quiet(pids, args.quiet_percent, args.quiet_timeout)
        doc = bench_level(args, concurrency, {label: urls[label] for label in todo}, pids, out_dir, attempt)
        seen = {}
        for target in doc["targets"]:
            other = _other_cpu(target["levels"][0]) if target["levels"] else float("inf")
            seen[target["label"]] = other
            if target["label"] not in best or other < best[target["label"]][0]:
                best[target["label"]] = (other, target, attempt)
        tries.append({"servers": todo, "other_cpu_percent_mean": seen, "quiet_before": quiet.get(concurrency)})
        todo = [label for label in todo if best[label][0] > DISTURBED_PERCENT]
        if not todo or attempt == args.retries:
            break
        print(f"    disturbed: other processes used {', '.join(f'{seen[l]:.0f}% of a core beside {l}' for l in todo)};"
              " running it again", flush=True)
    for i, entry in enumerate(tries):
        entry["kept"] = [label for label, (_, _, kept) in best.items() if kept == i]
    level = json.loads(json.dumps(doc))
    level["targets"] = [best[PEER][1], best[OURS][1]]
    level["ratios"] = ratios(level["targets"])
    return level


def merge(documents: list[dict], iterations: dict[int, int]) -> dict:
    """One syshax-benchmark/1 document with every level of every target, as one run would have written it."""
    merged = json.loads(json.dumps(documents[0]))
    merged["finished_at"] = documents[-1]["finished_at"]
    merged["argv"] = sys.argv
    s = merged["settings"]
    s["concurrency"] = sorted(iterations)
    s["iterations"] = ", ".join(f"{n} at c={c}" for c, n in sorted(iterations.items()))
    s["iterations_per_level"] = {str(c): n for c, n in sorted(iterations.items())}
    by_label = {t["label"]: t for t in merged["targets"]}
    for doc in documents[1:]:
        for target in doc["targets"]:
            into = by_label[target["label"]]
            into["levels"] += target["levels"]
            if target["status"] != "ok":
                into.update(status=target["status"], reason=target["reason"])
    merged["ratios"] = ratios(merged["targets"])
    return merged


def _other_cpu(level: dict) -> float:
    return (((level.get("resources") or {}).get("other_cpu_percent")) or {}).get("mean") or 0.0


def summary_rows(document: dict) -> list[dict]:
    levels = {t["label"]: {lv["concurrency"]: lv for lv in t["levels"]} for t in document["targets"]}
    rows = []
    for c in document["settings"]["concurrency"]:
        peer, ours = levels.get(PEER, {}).get(c), levels.get(OURS, {}).get(c)
        ratio = (ours["output_throughput_tok_s"] / peer["output_throughput_tok_s"]
                 if peer and ours and peer["output_throughput_tok_s"] else None)
        aim = AIMS.get(c)
        rows.append({
            "concurrency": c,
            "peer_tok_s": peer and peer["output_throughput_tok_s"],
            "ours_tok_s": ours and ours["output_throughput_tok_s"],
            "ratio": ratio,
            "aim": aim,
            "met": None if aim is None or ratio is None else ratio >= aim,
            "peer_ttft_median_s": peer and peer["ttft_s"]["median"],
            "ours_ttft_median_s": ours and ours["ttft_s"]["median"],
            "peer_tpot_mean_s": peer and peer["tpot_s"]["mean"],
            "ours_tpot_mean_s": ours and ours["tpot_s"]["mean"],
            "other_cpu_percent_mean": max((_other_cpu(lv) for lv in (peer, ours) if lv), default=None),
            "peer_ok": peer and f"{peer['completed']}/{peer['sent']}",
            "ours_ok": ours and f"{ours['completed']}/{ours['sent']}",
        })
    return rows


def format_summary(rows: list[dict]) -> str:
    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    header = ["conc", f"{PEER} tok/s", f"{OURS} tok/s", f"{OURS}/{PEER}", "aim", "met",
              "TTFT p50 ms (peer / ours)", "TPOT ms (peer / ours)", "ok (peer / ours)", "other CPU %"]
    body = [[str(r["concurrency"]), num(r["peer_tok_s"]), num(r["ours_tok_s"]), num(r["ratio"], "{:.2f}x"),
             num(r["aim"], ">= {:.1f}x"), {True: "yes", False: "NO", None: "-"}[r["met"]],
             f"{num(r['peer_ttft_median_s'] and r['peer_ttft_median_s'] * 1e3)} / "
             f"{num(r['ours_ttft_median_s'] and r['ours_ttft_median_s'] * 1e3)}",
             f"{num(r['peer_tpot_mean_s'] and r['peer_tpot_mean_s'] * 1e3, '{:.2f}')} / "
             f"{num(r['ours_tpot_mean_s'] and r['ours_tpot_mean_s'] * 1e3, '{:.2f}')}",
             f"{r['peer_ok']} / {r['ours_ok']}", num(r["other_cpu_percent_mean"], "{:.0f}")] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    # Same threads for both, whatever this shell exported; no pinning of one server only.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.pop("CUSTOM_CPU_AFFINITY", None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_serving-", dir=args.json.parent))
    print(f"model {args.model}, {args.threads} threads, levels {args.levels}, "
          f"{args.input_len} in / {args.output_len} out; logs and per-level files in {work}", flush=True)
    peer = ours = None
    servers: dict[str, dict] = {}
    try:
        peer, peer_url, servers[PEER] = start_peer(args, work)
        print(f"  {PEER} ready at {peer_url} after {servers[PEER]['startup_s']:.1f} s", flush=True)
        ours, servers[OURS] = start_ours(args, work)
        print(f"  {OURS} ready at {ours.url} after {servers[OURS]['startup_s']:.1f} s", flush=True)
        urls = {PEER: peer_url, OURS: ours.url}
        pids = {PEER: peer.pid, OURS: ours.pid}
        idle, _ = cpu_use(pids)
        print(f"  idle CPU % (server and its children): {idle}", flush=True)
        documents, iterations, quiet = [], {}, {}
        tries: dict[int, list[dict]] = {}
        for c in args.levels:
            documents.append(least_disturbed_level(args, c, urls, pids, work, quiet, tries.setdefault(c, [])))
            iterations[c] = documents[-1]["settings"]["iterations"]
    finally:
        if ours is not None:
            servers[OURS]["returncode"] = asyncio.run(stop_daemon(ours.process))
        if peer is not None:
            servers[PEER]["returncode"] = stop_peer(peer)
    merged = merge(documents, iterations)
    rows = summary_rows(merged)
    result = {
        "schema": SCHEMA,
        "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "argv": sys.argv,
        "settings": {"model": str(args.model), "threads": args.threads, "syshaxd_batch_size": args.batch_size,
                     "levels": args.levels, "input_len": args.input_len, "output_len": args.output_len,
                     "iterations": iterations, "warmup": args.warmup, "peer_n_ctx": args.n_ctx,
                     "flash_attn": True},
        "machine": describe_machine(),
        "servers": servers,
        "idle_cpu_percent": idle,
        "tries": {str(c): t for c, t in tries.items()},
        "aims": {str(c): a for c, a in AIMS.items()},
        "summary": rows,
        "benchmark": merged,
    }
    write_json(result, args.json)
    print()
    print(format_report(merged))
    print()
    print(f"{OURS} / {PEER}, output tokens/s ({args.input_len}-token prompts, {args.output_len} forced output"
          f" tokens, {args.threads} threads each, flash attention on both):")
    print(format_summary(rows))
    print(f"\nwhole run {result['wall_s']:.0f} s; figures: {args.json}")
    if args.plot:
        from syshaxd.benchmark.plot import plot_results

        plot_results(merged, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
