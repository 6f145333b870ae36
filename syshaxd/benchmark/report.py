"""Turns request records into figures per level, ratios between targets, the text table and the JSON document.

JSON times are seconds; the table shows milliseconds for per-token and
first-token figures and seconds for whole requests.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from .client import LevelRun
from .stats import summarize

__all__ = [
    "SCHEMA",
    "MODE_RATIOS",
    "level_summary",
    "turn_summaries",
    "ratios",
    "format_report",
    "write_json",
]

SCHEMA = "syshax-benchmark/1"

# The seed's "heterogeneous speed-up" column and its neighbours: numerator / denominator.
MODE_RATIOS = (
    ("hetero", "cpu"),
    ("hetero", "gpu"),
    ("auto", "gpu"),
    ("auto", "cpu"),
    ("gpu", "cpu"),
)
# A level whose throughput comes this close to the client's own ceiling may measure the client.
_CEILING_WARNING = 0.25
# One event loop on one core: past this the client's own speed may show in the figures.
_CLIENT_BUSY_PERCENT = 70.0
# Other processes using this much of a core (mean) during a level compete with the server for it.
_OTHER_BUSY_PERCENT = 25.0


def level_summary(run: LevelRun, output_len: int | None, resources: dict | None) -> dict:
    """Every figure for one concurrency level, with its per-request records.

    output_len: the length every request asked for, or None when they asked for different ones
    (each record's max_tokens is then what its answer is held against).
    """
    records = run.records
    ok = [r for r in records if r.ok]

    def asked(r) -> int:
        wanted = r.max_tokens if r.max_tokens is not None else output_len
        assert wanted is not None, "a request without max_tokens in a run without one output length"
        return wanted
    errors = Counter(r.error for r in records if not r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    wall = run.wall_s if run.wall_s > 0 else math.nan
    produced = [r.output_tokens for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    summary = {
        "concurrency": run.concurrency,
        "sent": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "error_examples": {kind: next(r.error_detail for r in records if r.error == kind) for kind in errors},
        # Requests sent again because a pooled keep-alive connection was already closed: not failures.
        "retries": sum(r.retries for r in records),
        "retry_example": next((r.retry_detail for r in records if r.retries), None),
        "wall_s": run.wall_s,
        "input_tokens": sum(r.input_tokens for r in ok),
        "output_tokens": output_tokens,
        "output_throughput_tok_s": output_tokens / wall if ok else 0.0,
        "total_throughput_tok_s": (output_tokens + sum(r.input_tokens for r in ok)) / wall if ok else 0.0,
        "request_throughput_req_s": len(ok) / wall if ok else 0.0,
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": summarize(itl),
        "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "forced_length": {
            "expected": output_len,
            "exact": sum(1 for r in ok if r.output_tokens == asked(r)),
            "short": sum(1 for r in ok if r.output_tokens < asked(r)),
            "long": sum(1 for r in ok if r.output_tokens > asked(r)),
            "min": min(produced) if produced else None,
            "mean": (sum(produced) / len(produced)) if produced else None,
            "counted_from": dict(Counter(r.output_tokens_source for r in ok)),
            # Short because the model stopped (finish_reason "stop"): the server ignored the forcing.
            "stopped_early": sum(1 for r in ok if r.output_tokens < asked(r) and r.finish_reason != "length"),
            # Short only in the count: the server stopped by length, but merged tokens into fewer chunks.
            "fewer_chunks_at_length": sum(1 for r in ok if r.output_tokens < asked(r) and r.finish_reason == "length"
                                          and r.output_tokens_source == "chunks"),
            "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        },
        "server_prompt_tokens": summarize([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "resources": resources,
        "requests": [r.as_dict() for r in records],
    }
    if any(r.turn is not None for r in records):
        summary["turns"] = turn_summaries(records)
    return summary


def turn_summaries(records) -> list[dict]:
    """The chat scenario's figures per turn number: TTFT grows with the history a turn resends."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    rows = []
    for turn in turns:
        of_turn = [r for r in records if r.turn == turn]
        ok = [r for r in of_turn if r.ok]
        rows.append({
            "turn": turn,
            "sent": len(of_turn),
            "completed": len(ok),
            "input_tokens": summarize([r.input_tokens for r in ok]),
            "server_prompt_tokens": summarize([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
            "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        })
    return rows


def _level(target: dict, concurrency: int) -> dict | None:
    for level in target.get("levels", ()):
        if level["concurrency"] == concurrency:
            return level
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def ratios(targets: list[dict]) -> list[dict]:
    """Throughput and p99 latency ratios between targets, per shared concurrency level.

    Mode targets are compared in the pairs of MODE_RATIOS; URL targets each against the first URL.
    """
    ran = {t["label"]: t for t in targets if t["status"] == "ok"}
    pairs: list[tuple[str, str]] = []
    by_mode = {t["mode"]: t["label"] for t in targets if t["kind"] == "mode" and t["label"] in ran}
    for num, den in MODE_RATIOS:
        if num in by_mode and den in by_mode:
            pairs.append((by_mode[num], by_mode[den]))
    urls = [t["label"] for t in targets if t["kind"] == "url" and t["label"] in ran]
    pairs += [(other, urls[0]) for other in urls[1:]]
    rows = []
    for num, den in pairs:
        for level in ran[num]["levels"]:
            base = _level(ran[den], level["concurrency"])
            if base is None:
                continue
            rows.append({
                "numerator": num,
                "denominator": den,
                "concurrency": level["concurrency"],
                "output_throughput": _ratio(level["output_throughput_tok_s"], base["output_throughput_tok_s"]),
                "ttft_p99": _ratio(level["ttft_s"]["p99"], base["ttft_s"]["p99"]),
                "e2e_p99": _ratio(level["e2e_s"]["p99"], base["e2e_s"]["p99"]),
            })
    return rows


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    ms = value * 1000
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).rjust(w) if i else str(cell).ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _machine_line(machine: dict) -> str:
    gpus = ", ".join(f"{g['name']} ({g['memory_total_mib'] / 1024:.0f} GiB)" for g in machine.get("gpus") or ()) or "no GPU seen"
    return (
        f"{machine['cpu_model']} · {machine['cpu_cores_physical']} cores / {machine['cpu_cores_logical']} threads"
        f" ({machine['cpu_cores_usable']} usable) · {machine['memory_total_gib']} GiB · {machine['os']}"
        f" ({machine['kernel']}, {machine['arch']}) · Python {machine['python']} · {gpus}"
    )


def format_report(document: dict) -> str:
    """The table a user reads at the end of a run, with its notes."""
    s = document["settings"]
    if s.get("chat"):
        chat = s["chat"]
        per_level = (f"{s['iterations']} conversations per level" if s["iterations"]
                     else "as many conversations as the level's concurrency")
        shape = (f"scenario chat ({chat['system_len']}-token system prompt, {chat['turns']} turns of"
                 f" {chat['user_len']} user tokens and {s['output_len']} output tokens, each turn resending the"
                 f" history) · {per_level}")
    else:
        shape = (f"scenario {s['scenario']} ({s['input_len']} input / {s['output_len']} output tokens)"
                 f" · {s['iterations']} requests per level")
    out = [
        f"syshax benchmark · {shape}, {s['warmup']} warm-up · endpoint {s['endpoint']}",
        f"machine: {_machine_line(document['machine'])}",
        "",
    ]
    header = ["target", "conc", "ok/sent", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT ms",
              "ITL p99 ms", "E2E p50 s", "E2E p99 s", "host CPU %", "server RSS MiB"]
    with_gpu = any((level.get("resources") or {}).get("gpu_memory_used_mib_max")
                   for target in document["targets"] for level in target.get("levels", ()))
    if with_gpu:
        header.append("GPU MiB")
    with_retries = any(level.get("retries") for target in document["targets"] for level in target.get("levels", ()))
    if with_retries:
        header.append("retried")
    rows = []
    for target in document["targets"]:
        if target["status"] != "ok":
            continue
        for level in target["levels"]:
            res = level.get("resources") or {}
            rss = None
            if res.get("daemon_rss_mib"):
                rss = (res["daemon_rss_mib"]["max"] or 0) + ((res.get("workers_rss_mib") or {}).get("max") or 0)
            rows.append([
                target["label"], str(level["concurrency"]), f"{level['completed']}/{level['sent']}",
                _num(level["output_throughput_tok_s"]), _num(level["request_throughput_req_s"], 2),
                _ms(level["ttft_s"]["median"]), _ms(level["ttft_s"]["p99"]), _ms(level["tpot_s"]["mean"]),
                _ms(level["itl_s"]["p99"]), _s(level["e2e_s"]["median"]), _s(level["e2e_s"]["p99"]),
                _num((res.get("cpu_percent_total") or {}).get("mean")), _num(rss, 0),
            ] + ([_num(sum(res["gpu_memory_used_mib_max"]), 0) if res.get("gpu_memory_used_mib_max") else "-"]
                 if with_gpu else []) + ([str(level.get("retries", 0))] if with_retries else []))
    if rows:
        out += _table(header, rows)
    else:
        out.append("no target ran")
    out += _turn_table(document)
    if document.get("ratios"):
        out += ["", "ratios (output tok/s: higher is better; p99 latency: lower is better)"]
        rows = [[f"{r['numerator']}/{r['denominator']}", str(r["concurrency"]),
                 "-" if r["output_throughput"] is None else f"{r['output_throughput']:.2f}x",
                 "-" if r["ttft_p99"] is None else f"{r['ttft_p99']:.2f}x",
                 "-" if r["e2e_p99"] is None else f"{r['e2e_p99']:.2f}x"] for r in document["ratios"]]
        out += _table(["ratio", "conc", "throughput", "TTFT p99", "E2E p99"], rows)
    notes = _notes(document)
    if notes:
        out += ["", "notes:"] + [f"  * {note}" for note in notes]
    return "\n".join(out)


def _turn_table(document: dict) -> list[str]:
    """Chat: TTFT p50 per turn, one row per target and level (a server without a prompt cache climbs)."""
    turns = sorted({row["turn"] for target in document["targets"] if target["status"] == "ok"
                    for level in target["levels"] for row in level.get("turns", ())})
    if not turns:
        return []
    rows = []
    for target in document["targets"]:
        if target["status"] != "ok":
            continue
        for level in target["levels"]:
            by_turn = {row["turn"]: row for row in level.get("turns", ())}
            rows.append([target["label"], str(level["concurrency"])]
                        + [_ms(by_turn[t]["ttft_s"]["median"]) if t in by_turn else "-" for t in turns])
    return ["", "TTFT p50 ms per turn (each turn resends the whole conversation so far)"] + _table(
        ["target", "conc", *(f"turn {t}" for t in turns)], rows)


def _notes(document: dict) -> list[str]:
    notes = []
    s = document["settings"]
    for target in document["targets"]:
        label = target["label"]
        if target["status"] != "ok":
            reason = (target.get("reason") or "").strip().replace("\n", "\n      ")
            notes.append(f"{label}: {target['status']}: {reason}")
            continue
        for level in target["levels"]:
            c = level["concurrency"]
            if level["sent"] < c:
                notes.append(f"{label} c={c}: only {level['sent']} requests were sent, so {c} were never in flight"
                             " at once; give --iterations of at least the concurrency")
            client_cpu = ((level.get("resources") or {}).get("client_cpu_percent") or {}).get("mean")
            if client_cpu is not None and client_cpu > _CLIENT_BUSY_PERCENT:
                notes.append(f"{label} c={c}: the benchmark client itself used {client_cpu:.0f}% of a core;"
                             " it may have slowed what it measured (see --calibrate)")
            other_cpu = ((level.get("resources") or {}).get("other_cpu_percent") or {}).get("mean")
            if other_cpu is not None and other_cpu > _OTHER_BUSY_PERCENT:
                notes.append(f"{label} c={c}: other processes on this host used {other_cpu:.0f}% of a core"
                             " during the level; they competed with the server, so its figures are low")
            if level.get("retries"):
                notes.append(f"{label} c={c}: {level['retries']} requests met a keep-alive connection the server had"
                             " already closed and were sent again on a new one (not failures; times are the"
                             f" second try's); e.g. {(level.get('retry_example') or '')[:120]}")
            if level["errors"]:
                kinds = ", ".join(f"{k} x{n}" for k, n in level["errors"].items())
                example = next(iter(level["error_examples"].values()), "") or ""
                notes.append(f"{label} c={c}: {level['failed']} of {level['sent']} requests failed ({kinds})"
                             + (f"; e.g. {example[:160]}" if example else ""))
            forced = level["forced_length"]
            if forced["stopped_early"] or forced["long"]:
                expected = f"{forced['expected']} tokens" if forced["expected"] is not None else "each request"
                notes.append(
                    f"{label} c={c}: the server did not honour the forced output length of {expected}"
                    f": {forced['stopped_early']} requests stopped early (as few as {forced['min']} tokens),"
                    f" {forced['long']} gave more; tok/s counts the tokens actually produced"
                )
            if forced["fewer_chunks_at_length"]:
                notes.append(
                    f"{label} c={c}: {forced['fewer_chunks_at_length']} requests stopped at the length asked for but"
                    " streamed fewer text chunks than tokens (the server merged some tokens into one chunk) and sent"
                    " no usage: their counts, and tok/s, are slightly low"
                )
        sources: Counter[str] = Counter()
        for level in target["levels"]:
            sources.update(level["forced_length"]["counted_from"])
        if sources.get("chunks"):
            notes.append(f"{label}: sent no usage in its stream (stream_options.include_usage) for {sources['chunks']}"
                         " requests; their output tokens were counted from stream chunks")
    if s.get("chat"):
        notes.append("chat: a turn's input tokens count the system prompt, the user messages and the earlier"
                     " answers as the tokenizer counts them; the chat template adds tokens (server_prompt_tokens"
                     " in the JSON, per turn too, shows what the server counted)")
    elif s["endpoint"] == "chat":
        notes.append("endpoint chat: the input length is the user message's; the chat template adds tokens"
                     " (server_prompt_tokens in the JSON shows what the server counted)")
    calib = document.get("client_calibration")
    if calib:
        notes.append(
            f"client ceiling (instant stub, in-process, stub cost included): {calib['max_output_tok_s']:.0f} tok/s"
            f" at concurrency {calib['concurrency']}, {calib['per_chunk_us']:.0f} us per chunk,"
            f" {calib['per_request_ms']:.2f} ms per request"
        )
        for target in document["targets"]:
            if target["status"] != "ok" or target.get("kind") == "stub":
                continue
            for level in target["levels"]:
                if level["output_throughput_tok_s"] > _CEILING_WARNING * calib["max_output_tok_s"]:
                    notes.append(f"{target['label']} c={level['concurrency']}: throughput is over"
                                 f" {_CEILING_WARNING:.0%} of the client's ceiling; the client may be part of what"
                                 " was measured")
    return notes


def write_json(document: dict, path: str | Path) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")
