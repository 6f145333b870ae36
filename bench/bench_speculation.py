"""Speculative decoding's gain: syshaxd guessing (speculative_tokens, drafting.py) against syshaxd not guessing, in
one run, on a copy-heavy load, on chat and on unique prompts (issue 38, item 2).

Both daemons are up at once (cpu mode, the default model, 2 threads each, 8 batch slots) and loaded one at a time,
alternating which goes first from load to load and round to round (bench_peers.py's way: this machine's speed
drifts, and side by side in time both see the same drift). The loads, each at concurrency --concurrency (1 by
default) with greedy requests whose outputs end where the model ends them (max 256 tokens):

* copy: requests that copy from their prompt -- repeat a text, quote sentences of it, fix a bug and give the whole
  code, summarise quoting it (syshaxd/benchmark/copying.py: a few paragraphs and code files, other pieces each round);
* chat: tests/greedy.py's kind of open questions, nothing to copy but what the answer repeats of itself;
* unique: bench prompts of random words (syshaxd/benchmark/prompts.py), 128 tokens in, 256 forced out (ignore_eos).

Per load: output tokens/s of each daemon (completion tokens over the load's wall time), the ratio guessing / not,
the share of guessed tokens kept, and whether every text was the same on both (greedy: it must be). Speculation is
worth turning on by default where it wins and loses no more than noise elsewhere.

    .venv/bin/python bench/bench_speculation.py                  # c=1, 2 rounds: about 6 minutes on 2 quiet cores
    .venv/bin/python bench/bench_speculation.py --concurrency 4 --rounds 1
    .venv/bin/python bench/bench_speculation.py --tokens 4       # guess at most 4 tokens a step
    .venv/bin/python bench/bench_speculation.py --concurrency 4 --always   # what guesses cost beside others
    .venv/bin/python bench/bench_speculation.py --tokens 0       # two daemons alike: this machine's noise
    .venv/bin/python bench/bench_speculation.py --draft models/SmolLM2-135M-Instruct.test-Q8_0.gguf   # a draft model

With --draft (the guessing daemon's draft_model), found on 2026-12-05 (AMD EPYC with AVX-512, 2 cores, c=1, one
round; SmolLM2-135M in Q8_0 as the q4_0 model's draft, a drafted token about 7 ms, as dear as a step): every guess
checked (--always) copy 0.39x, chat 0.34x, unique 0.53x; left to choose, the engine drafted nothing and prompt
lookup's guesses gave 1.36x, 1.18x and 1.10x. A draft pays only where it is far cheaper than the model.

Found on 2026-12-06 (the same machine, c=1, llama.cpp patches 0010 to 0012 and guesses weighed by their match's
length, drafting.MatchRates; three runs, 11 rounds): copy 1.57x (1.36x to 1.73x), chat 1.46x (1.33x to 1.53x),
unique 1.93x (1.66x to 2.26x), every text the same.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syshaxd.benchmark.copying import copy_chats  # noqa: E402
from syshaxd.benchmark.daemon import daemon_command, start_daemon, stop_daemon  # noqa: E402
from syshaxd.benchmark.prompts import GGUFTokenizer, PromptBuilder, default_tokenizer_path  # noqa: E402

QUESTIONS = [
    "Explain how a steam engine works, step by step.",
    "Write a short story about a lighthouse.",
    "List ten uses of a paperclip and explain each.",
    "What were the causes of the French Revolution?",
    "Describe the water cycle to a ten-year-old, with examples.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between weather and climate?",
]


def chat_requests(round_index: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[(round_index + k) % len(QUESTIONS)]}] for k in range(8)]


def post(url: str, body: dict, timeout: float = 900) -> dict:
    base = url.split("/v1/")[0]
    if base not in MODELS:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
            MODELS[base] = json.loads(r.read())["data"][0]["id"]
    req = urllib.request.Request(url, json.dumps({"model": MODELS[base]} | body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{url}: {exc.code} {exc.read()[:500]!r}") from None


MODELS: dict[str, str] = {}  # a daemon's URL -> the model it serves


def status(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/v1/syshax/status", timeout=30) as r:
        return json.loads(r.read())


def run_load(base: str, bodies: list[dict], concurrency: int) -> tuple[float, int, list[str]]:
    """Every body, `concurrency` at a time: (wall seconds, completion tokens, texts in order)."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda b: post(f"{base}/v1/{'chat/completions' if 'messages' in b else 'completions'}",
                                            b), bodies))
    wall = time.perf_counter() - started
    texts = [o["choices"][0]["message"]["content"] if "messages" in b else o["choices"][0]["text"]
             for o, b in zip(outs, bodies)]
    return wall, sum(o["usage"]["completion_tokens"] for o in outs), texts


def guess_counts(base: str) -> tuple[int, int]:
    stats = [w["stats"] for w in status(base)["workers"]]
    return sum(s.get("guessed_tokens", 0) for s in stats), sum(s.get("kept_guesses", 0) for s in stats)


def start(tokens: int, threads: int, log_dir: Path, always: bool = False, draft: Path | None = None):
    """A cpu-mode daemon with speculative_tokens = tokens; always: every guess checked (SYSHAX_GUESS=always); draft:
    its guesses from that draft model."""
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / f"syshaxd-{tokens}.toml"
    config.write_text(f"threads = {threads}\ncpu_max_batch_size = 8\nn_ctx = 4096\nspeculative_tokens = {tokens}\n"
                      f"admin_socket = {json.dumps(str(log_dir / f'admin-{tokens}.sock'))}\nlog_level = \"info\"\n"
                      + (f"draft_model = {json.dumps(str(draft.resolve()))}\n" if draft else ""))
    os.environ["SYSHAX_GUESS"] = "always" if always else ""  # the daemon's environment is this process's
    try:
        return asyncio.run(start_daemon("cpu", command=daemon_command(), config=str(config), startup_timeout_s=300,
                                        log_dir=str(log_dir / f"spec-{tokens}")))
    finally:
        del os.environ["SYSHAX_GUESS"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8, help="speculative_tokens of the guessing daemon (default: 8)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once (default: 1)")
    p.add_argument("--rounds", type=int, default=2, help="every load this many times on each (default: 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", action="append", choices=("copy", "chat", "unique"), help="only these loads")
    p.add_argument("--always", action="store_true", help="the guessing daemon checks every guess of every sequence, "
                   "paying or not (SYSHAX_GUESS=always): what guesses cost beside other sequences")
    p.add_argument("--draft", type=Path, help="a draft model (GGUF of the same vocabulary): the guessing daemon's "
                   "guesses come from it (config draft_model), for sequences decoding alone")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/bench_speculation.json")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops both daemons
    loads = args.load or ["copy", "chat", "unique"]
    builder = PromptBuilder(GGUFTokenizer(default_tokenizer_path()))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    daemons = {"guessing": start(args.tokens, args.threads, log_dir / "g", args.always, args.draft),
               "plain": start(0, args.threads, log_dir / "p")}
    results: dict[str, list[dict]] = {ld: [] for ld in loads}
    try:
        for name in daemons:  # a first request each, so neither pays its first graphs in a load
            post(f"{daemons[name].url}/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
        for r in range(args.rounds):
            for li, ld in enumerate(loads):
                if ld == "unique":
                    bodies = [{"prompt": builder.build(128, 1000 * r + k).text, "max_tokens": 256, "temperature": 0,
                               "ignore_eos": True} for k in range(4)]
                else:
                    chats = copy_chats(r) if ld == "copy" else chat_requests(r)
                    bodies = [{"messages": m, "max_tokens": 256, "temperature": 0} for m in chats]
                order = ["guessing", "plain"] if (r + li) % 2 == 0 else ["plain", "guessing"]
                got = {}
                for name in order:
                    before = guess_counts(daemons[name].url)
                    wall, tokens, texts = run_load(daemons[name].url, bodies, args.concurrency)
                    after = guess_counts(daemons[name].url)
                    got[name] = {"seconds": wall, "tokens": tokens, "tok_s": tokens / wall, "texts": texts,
                                 "guessed": after[0] - before[0], "kept": after[1] - before[1]}
                g, q = got["guessing"], got["plain"]
                row = {"round": r, "ratio": g["tok_s"] / q["tok_s"], "same_texts": g["texts"] == q["texts"],
                       "guessing_tok_s": g["tok_s"], "plain_tok_s": q["tok_s"], "tokens": g["tokens"],
                       "guessed": g["guessed"], "kept": g["kept"]}
                results[ld].append(row)
                print(f"round {r} {ld:<7} guessing {g['tok_s']:6.1f} tok/s, plain {q['tok_s']:6.1f}: "
                      f"{row['ratio']:.2f}x; kept {g['kept']} of {g['guessed']} guessed; texts "
                      f"{'the same' if row['same_texts'] else 'DIFFER'}", flush=True)
    finally:
        for d in daemons.values():
            asyncio.run(stop_daemon(d.process))
    checked = (", every guess checked" if args.always else "") + (f", drafted by {args.draft.name}" if args.draft
                                                                    else "")
    print(f"\nc={args.concurrency}, speculative_tokens={args.tokens}{checked}, {args.rounds} rounds (median of the "
          "rounds):\n")
    print("| load | guessing tok/s | plain tok/s | ratio | rounds' ratios | guesses kept | texts |")
    print("|---|---:|---:|---:|---|---:|---|")
    for ld, rows in results.items():
        kept, guessed = sum(x["kept"] for x in rows), sum(x["guessed"] for x in rows)
        print(f"| {ld} | {statistics.median(x['guessing_tok_s'] for x in rows):.1f} | "
              f"{statistics.median(x['plain_tok_s'] for x in rows):.1f} | "
              f"{statistics.median(x['ratio'] for x in rows):.2f}x | "
              f"{', '.join(format(x['ratio'], '.2f') for x in rows)} | "
              f"{kept} of {guessed} | {'same' if all(x['same_texts'] for x in rows) else 'DIFFER'} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"schema": "syshax-bench-speculation/1", "concurrency": args.concurrency,
                                     "speculative_tokens": args.tokens, "results": results}, indent=1))
    return 0 if all(x["same_texts"] for rows in results.values() for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
