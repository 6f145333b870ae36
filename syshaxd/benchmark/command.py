"""`syshax benchmark`: its arguments and the run that drives every target, prints the table and writes files.

`add_arguments(parser)` fills an argparse parser; `run(args)` runs the
benchmark and returns the process exit status (0: at least one target ran;
1: none could; 2: bad arguments).
"""

from __future__ import annotations

import argparse
import importlib.util
import asyncio
import functools
import json
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from .calibrate import calibrate_client
from .chat import build_conversations, run_conversations
from .client import StreamingClient, list_models, run_level
from .daemon import DaemonStartFailed, daemon_command, start_daemon, stop_daemon
from .progress import Progress
from .prompts import GGUFTokenizer, PromptBuilder, WordPromptBuilder, default_tokenizer_path
from .report import SCHEMA, format_report, level_summary, ratios, write_json
from .resources import ResourceSampler, describe_machine
from .scenarios import CHAT, CHAT_SYSTEM_LEN, CHAT_TURNS, SCENARIOS, parse_concurrency, scenario_named
from .stub import InstantServer

__all__ = ["add_arguments", "run", "MODES"]

MODES = ("cpu", "gpu", "hetero", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's options to parser (the `syshax benchmark` subcommand, or a parser of its own)."""
    shapes = ", ".join(f"{s.name} {s.input_len}/{s.output_len} at {','.join(map(str, s.concurrency))}"
                       for s in SCENARIOS.values())
    work = parser.add_argument_group("workload")
    work.add_argument("--scenario", choices=[*SCENARIOS, "custom"], default="short",
                      help=f"input/output tokens and concurrency levels ({shapes}); custom: --input-len, --output-len;"
                      " chat: multi-turn conversations behind a shared system prompt, each turn resending the whole"
                      " history to /v1/chat/completions (input = tokens per user message), TTFT reported per turn"
                      " (default: short)")
    work.add_argument("--input-len", type=int, metavar="N",
                      help="prompt tokens per request, or per user message in chat (overrides the scenario's)")
    work.add_argument("--output-len", type=int, metavar="N",
                      help="output tokens per request, or per answer in chat (overrides the scenario's)")
    work.add_argument("--concurrency", metavar="N[,N...]",
                      help="requests kept in flight, or conversations at once in chat: one level or a list like"
                      " 1,2,4,8 (default: the scenario's levels)")
    work.add_argument("--iterations", type=int, metavar="M",
                      help="requests per concurrency level (default: 100); in chat, conversations per level"
                      " (default: as many as the level's concurrency)")
    work.add_argument("--system-len", type=int, default=CHAT_SYSTEM_LEN, metavar="N",
                      help=f"chat: tokens of the system prompt every conversation shares, 0 for none"
                      f" (default: {CHAT_SYSTEM_LEN})")
    work.add_argument("--turns", type=int, default=CHAT_TURNS, metavar="T",
                      help=f"chat: turns per conversation; turn n resends the system prompt, n user messages and"
                      f" n-1 answers (default: {CHAT_TURNS})")
    work.add_argument("--warmup", type=int, default=2, metavar="K",
                      help="unmeasured requests sent to each target before its first level (default: 2)")
    work.add_argument("--endpoint", choices=("completions", "chat"),
                      help="/v1/completions or /v1/chat/completions (default: completions; chat for --scenario chat)")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    work.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words (default: 0)")
    work.add_argument("--tokenizer", metavar="GGUF",
                      help="GGUF whose tokenizer counts the prompt tokens; use the served model's"
                      " (default: --model if it is a GGUF, else the prepared default model)")
    work.add_argument("--no-force-length", dest="force_length", action="store_false",
                      help="do not send ignore_eos and min_tokens (for servers that reject unknown fields)")
    work.add_argument("--suppress-eos", action="store_true",
                      help="also send logit_bias -100 on the tokenizer's end-of-generation tokens, for servers"
                      " that honour neither ignore_eos nor min_tokens")
    work.add_argument("--extra-body", metavar="JSON", help="a JSON object merged into every request body")
    work.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request time limit (default: 600)")

    target = parser.add_argument_group("what to benchmark")
    target.add_argument("--mode", type=_modes, metavar="MODE[,MODE...]",
                        help=f"start one syshaxd per mode and benchmark each: {', '.join(MODES)}, a list like "
                        "cpu,gpu,auto, or all (default: all); not used with --url")
    target.add_argument("--url", action="append", metavar="[LABEL=]URL",
                        help="benchmark this OpenAI-compatible server instead (vLLM, llama.cpp's server,"
                        " llama_cpp.server, another syshaxd); repeat it to compare servers")
    target.add_argument("--server-pid", type=int, action="append", metavar="PID",
                        help="with --url: the server's PID, to record its CPU and memory (one per --url, in order)")
    target.add_argument("--model-name", help="model id to request (default: the first id from GET /v1/models)")
    target.add_argument("--model", metavar="PATH", help="model for the syshaxd this starts (passed as --model)")
    target.add_argument("--config", metavar="PATH", help="config for the syshaxd this starts (passed as --config)")
    target.add_argument("--daemon-cmd", metavar="CMD",
                        help="command that starts the daemon (default: syshaxd); --host --port --mode are appended")
    target.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="how long a started syshaxd may take to answer GET /health 200 (default: 300)")
    target.add_argument("--log-dir", metavar="DIR", help="where the daemons' output goes (default: the temp folder)")
    target.add_argument("--self-test", action="store_true",
                        help="benchmark the in-process instant stub server: checks this tool and shows its ceiling")
    target.add_argument("--calibrate", action="store_true",
                        help="also measure the client's own overhead against the instant stub, and report it")

    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every figure and every request's record to PATH")
    out.add_argument("--plot", metavar="PATH.png", help="draw throughput and p99 latency against concurrency")
    out.add_argument("--progress", action="store_true", help="show the live progress bar even when stderr is not a terminal")
    out.add_argument("--sample-interval", type=float, default=0.5, metavar="S",
                     help="how often CPU and memory are sampled (default: 0.5)")
    return parser


def _modes(text: str) -> tuple[str, ...]:
    """--mode: "all", one mode, or several separated by commas, in the order given."""
    if text == "all":
        return MODES
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: modes are {', '.join(MODES)} (or a list of them, or all)")
    return modes


def _parse_urls(values: list[str] | None) -> list[tuple[str, str]]:
    """(label, url) pairs from [LABEL=]URL values; an unlabelled URL is labelled by its host and port."""
    pairs: list[tuple[str, str]] = []
    for value in values or ():
        label, sep, url = value.partition("=")
        if not sep or "://" in label:
            label, url = "", value
        if "://" not in url:
            raise ValueError(f"--url: {value!r} is not a URL; give http://HOST:PORT, optionally as LABEL=URL")
        label = label or url.split("://", 1)[1].split("/", 1)[0]
        if label in (p[0] for p in pairs):
            raise ValueError(f"--url: the label {label!r} is used twice; give each server its own LABEL=URL")
        pairs.append((label, url))
    return pairs


def _settings(args: argparse.Namespace) -> dict:
    scenario = scenario_named(
        args.scenario, args.input_len, args.output_len,
        parse_concurrency(args.concurrency) if args.concurrency else None,
    )
    chat = scenario.name == CHAT
    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations: {args.iterations} is not allowed; it must be at least 1")
    if chat and args.endpoint == "completions":
        raise ValueError("--endpoint completions: the chat scenario sends conversations; it needs --endpoint chat")
    if args.turns < 1:
        raise ValueError(f"--turns: {args.turns} is not allowed; it must be at least 1")
    if args.system_len < 0:
        raise ValueError(f"--system-len: {args.system_len} is not allowed; it must be 0 (none) or more")
    if args.warmup < 0:
        raise ValueError(f"--warmup: {args.warmup} is not allowed; it must be 0 or more")
    if args.server_pid and len(args.server_pid) > len(args.url or ()):
        raise ValueError("--server-pid: more PIDs than --url servers; give one PID per --url, in order")
    if args.self_test and args.url:
        raise ValueError("--self-test benchmarks the built-in stub; it cannot be combined with --url")
    extra = None
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--extra-body: not valid JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body: must be a JSON object, like '{\"top_k\": 1}'")
    settings = {
        "scenario": scenario.name,
        "input_len": scenario.input_len,
        "output_len": scenario.output_len,
        "concurrency": list(scenario.concurrency),
        # chat: conversations per level; None there means as many as the level's concurrency
        "iterations": args.iterations if args.iterations is not None or chat else 100,
        "warmup": args.warmup,
        "endpoint": args.endpoint or ("chat" if chat else "completions"),
        "temperature": args.temperature,
        "seed": args.seed,
        "force_length": args.force_length,
        "suppress_eos": args.suppress_eos,
        "extra_body": extra,
        "timeout_s": args.timeout,
    }
    if chat:
        settings["chat"] = {"system_len": args.system_len, "turns": args.turns, "user_len": scenario.input_len}
    return settings


def _tokenizer_path(args: argparse.Namespace) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    if args.model and str(args.model).endswith(".gguf"):
        return Path(args.model)
    return default_tokenizer_path()


def _needs_tokenizer(args: argparse.Namespace) -> bool:
    # The instant stub counts words, so a self-test needs no model unless one is named.
    return not args.self_test or bool(args.tokenizer)


def _prompt_seed(seed: int, concurrency: int, index: int) -> int:
    # Same prompts for the same (level, request) on every target, different for every request within a run.
    return (seed * 1_000_003 + concurrency) * 1_000_033 + index


def _targets(args: argparse.Namespace) -> list[dict]:
    if args.self_test:
        return [{"label": "stub", "kind": "stub", "mode": None, "url": None, "server_pid": None}]
    if args.url:
        pids = list(args.server_pid or ())
        return [{"label": label, "kind": "url", "mode": None, "url": url,
                 "server_pid": pids[i] if i < len(pids) else None}
                for i, (label, url) in enumerate(_parse_urls(args.url))]
    modes = args.mode or MODES
    return [{"label": mode, "kind": "mode", "mode": mode, "url": None, "server_pid": None} for mode in modes]


class _Bench:
    """One benchmark run: the settings, the prompts, and the loop over targets and levels."""

    def __init__(self, args: argparse.Namespace, settings: dict, progress: Progress):
        self.args = args
        self.settings = settings
        self.progress = progress
        self.builder: PromptBuilder | WordPromptBuilder | None = None
        self.extra_body = dict(settings["extra_body"] or {})

    def prepare_prompts(self, need_tokenizer: bool) -> None:
        s = self.settings
        if need_tokenizer:
            path = _tokenizer_path(self.args)
            self.progress.note(f"building prompts of {s['input_len']} tokens with the tokenizer of {path}")
            tokenizer = GGUFTokenizer(path)
            builder: PromptBuilder | WordPromptBuilder = PromptBuilder(tokenizer)
            s["tokenizer"] = str(path)
            s["prompt_unit"] = "tokens"
            if s["suppress_eos"]:
                bias = {str(i): -100 for i in tokenizer.eos_ids()}
                self.extra_body.setdefault("logit_bias", bias)
                s["suppressed_eos_ids"] = sorted(int(i) for i in bias)
        else:
            builder = WordPromptBuilder()
            s["tokenizer"] = None
            s["prompt_unit"] = "words (the instant stub counts words)"
        self.builder = builder
        started = time.perf_counter()
        if s["scenario"] == CHAT:
            chat = s["chat"]
            self.conversations = {
                c: build_conversations(builder, s["iterations"] or c, system_len=chat["system_len"],
                                       turn_len=s["input_len"], turns=chat["turns"], seed=s["seed"],
                                       user_seed=functools.partial(_prompt_seed, s["seed"], c))
                for c in s["concurrency"]
            }
            self.prompts = {}
        else:
            self.prompts = {
                c: [builder.build(s["input_len"], _prompt_seed(s["seed"], c, i)) for i in range(s["iterations"])]
                for c in s["concurrency"]
            }
        self.warmup_prompts = [builder.build(s["input_len"], _prompt_seed(s["seed"] + 7919, 0, i))
                               for i in range(s["warmup"])]
        s["prompt_build_s"] = time.perf_counter() - started

    async def bench_target(self, target: dict) -> None:
        """Run every level against one target and store its figures (or why it could not run) in target."""
        target.update(status="ok", reason=None, model=None, daemon=None, warmup=None, levels=[])
        stub = daemon = None
        try:
            if target["kind"] == "stub":
                stub = InstantServer().start()
                target["url"] = stub.url
            elif target["kind"] == "mode":
                self.progress.note(f"[{target['label']}] starting syshaxd --mode {target['mode']}")
                try:
                    daemon = await start_daemon(
                        target["mode"], command=daemon_command(self.args.daemon_cmd), config=self.args.config,
                        model=self.args.model, startup_timeout_s=self.args.startup_timeout, log_dir=self.args.log_dir,
                    )
                except DaemonStartFailed as exc:
                    target.update(status="skipped" if exc.returncode is not None else "failed", reason=exc.reason,
                                  daemon={"log": exc.log_path, "returncode": exc.returncode})
                    self.progress.note(f"[{target['label']}] {target['status']}: {exc.reason.splitlines()[-1] if exc.reason else ''}")
                    return
                target["url"], target["server_pid"] = daemon.url, daemon.pid
                target["daemon"] = {"argv": daemon.argv, "pid": daemon.pid, "log": daemon.log_path,
                                    "startup_s": daemon.startup_s}
                self.progress.note(f"[{target['label']}] healthy after {daemon.startup_s:.1f} s at {daemon.url}")
            await self._levels(target)
        except Exception as exc:  # one target's failure must not lose the others' results
            target.update(status="failed", reason=f"{type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(limit=6))
            self.progress.note(f"[{target['label']}] failed: {type(exc).__name__}: {exc}")
        finally:
            if daemon is not None:
                died = daemon.process.poll()
                code = await stop_daemon(daemon.process)
                target["daemon"].update(returncode=code, exited_during_run=died is not None)
                if died is not None:
                    target["reason"] = f"syshaxd exited with status {died} during the run"
            if stub is not None:
                stub.stop()

    async def _levels(self, target: dict) -> None:
        s = self.settings
        levels = s["concurrency"]
        connector = aiohttp.TCPConnector(limit=max(levels), limit_per_host=max(levels))
        async with aiohttp.ClientSession(connector=connector) as session:
            if self.args.model_name:
                target["model"] = self.args.model_name
            else:
                models = await list_models(session, target["url"])
                if not models:
                    raise RuntimeError(f"GET {target['url']}/v1/models listed no model; give --model-name")
                target["model"] = models[0]
            client = StreamingClient(
                target["url"], target["model"], s["output_len"], endpoint=s["endpoint"], temperature=s["temperature"],
                force_length=s["force_length"], extra_body=self.extra_body, timeout_s=s["timeout_s"],
            )
            if self.warmup_prompts:
                self.progress.begin(f"[{target['label']}] warm-up", len(self.warmup_prompts))
                warm = await run_level(client, session, self.warmup_prompts, min(len(self.warmup_prompts), max(levels)),
                                       on_record=lambda r: self.progress.advance(r.ok, r.output_tokens))
                self.progress.end()
                target["warmup"] = {"sent": len(warm.records), "completed": sum(r.ok for r in warm.records),
                                    "errors": sorted({r.error for r in warm.records if r.error}), "wall_s": warm.wall_s}
            for concurrency in levels:
                chat = s["scenario"] == CHAT
                requests = (len(self.conversations[concurrency]) * s["chat"]["turns"] if chat
                            else len(self.prompts[concurrency]))
                self.progress.begin(f"[{target['label']}] c={concurrency}", requests)
                sampler = ResourceSampler(target.get("server_pid"), self.args.sample_interval).start()

                def advance(record) -> None:
                    self.progress.advance(record.ok, record.output_tokens)

                try:
                    if chat:
                        result = await run_conversations(client, session, self.conversations[concurrency], concurrency,
                                                         on_record=advance)
                    else:
                        result = await run_level(client, session, self.prompts[concurrency], concurrency,
                                                 on_record=advance)
                finally:
                    resources = sampler.stop()
                    self.progress.end()
                target["levels"].append(level_summary(result, s["output_len"], resources))


async def _main(args: argparse.Namespace, settings: dict, progress: Progress) -> dict:
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    targets = _targets(args)
    bench = _Bench(args, settings, progress)
    bench.prepare_prompts(need_tokenizer=_needs_tokenizer(args))
    calibration = None
    if args.calibrate or args.self_test:
        progress.note("measuring the client's own ceiling against the instant stub")
        calibration = await calibrate_client(max(settings["concurrency"]), settings["output_len"])
    for target in targets:
        await bench.bench_target(target)
    return {
        "schema": SCHEMA,
        "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "settings": settings,
        "machine": describe_machine(),
        "client_calibration": calibration,
        "targets": targets,
        "ratios": ratios(targets),
    }


def _event_loop_factory():
    try:
        import uvloop  # the daemon's loop; optional for the client
    except ImportError:
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed args describe; print the table; write --json and --plot. Returns the exit status."""
    try:
        settings = _settings(args)
        if args.url and args.mode:
            print("syshax benchmark: --mode is not used with --url (the servers given are benchmarked as they are)",
                  file=sys.stderr)
        if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
            raise ValueError("--plot needs matplotlib, which the default install leaves out: "
                             "pip install 'syshax[plot]' (or matplotlib)")
        if _needs_tokenizer(args) and not _tokenizer_path(args).is_file():
            raise ValueError(f"--tokenizer: {str(_tokenizer_path(args))!r} is not a file;"
                             " give the GGUF of the model being served")
    except ValueError as exc:
        print(f"syshax benchmark: {exc}", file=sys.stderr)
        return 2
    progress = Progress(Progress.wanted(args.progress))
    factory, loop_name = _event_loop_factory()
    settings["event_loop"] = loop_name
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            document = runner.run(_main(args, settings, progress))
    except KeyboardInterrupt:
        print("syshax benchmark: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as exc:
        print(f"syshax benchmark: {exc}", file=sys.stderr)
        return 1
    print(format_report(document))
    if args.json:
        write_json(document, args.json)
        print(f"\nraw figures and per-request records: {args.json}")
    if args.plot:
        from .plot import plot_results  # matplotlib only when a plot is asked for

        if any(t["status"] == "ok" for t in document["targets"]):
            plot_results(document, args.plot)
            print(f"plot: {args.plot}")
        else:
            print("plot: not drawn, no target ran", file=sys.stderr)
    return 0 if any(t["status"] == "ok" for t in document["targets"]) else 1
