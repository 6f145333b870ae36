"""`syshax status` in words: the daemon's status as the admin socket sends it, printed for a person (with --json,
the CLI prints the document itself)."""

from __future__ import annotations

import dataclasses
import json
import time


def duration(seconds: float) -> str:
    seconds = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    if seconds or not parts:
        parts.append(f"{seconds}s")
    return " ".join(parts[:2])


def print_status(st: dict) -> None:
    """The daemon's status (the admin socket's `status`), as `syshax status` prints it."""
    # here, not at the top: `syshax version` takes duration() alone, on the system's bare Python (no numpy)
    from syshaxd.engine.status import SchedulerStatus
    from syshaxd.sdk.placement import format_cpulist

    sched = SchedulerStatus.from_json(st)  # a key the daemon renamed fails here, not as a silent blank
    state = "draining" if st["draining"] else ("ready" if sched.ready else "not ready")
    print(f"syshaxd {st['version']}  pid {st['pid']}  up {duration(st['uptime_s'])}  mode {sched.mode}  {state}")
    print(f"model {st['model']} on {st['listen']}  config {st['config_source'] or '(built-in defaults)'}")
    if sched.model_file:
        f = sched.model_file
        print(f"model file {f['path']} ({f['file_type']}): {f['why']}")
    print(f"requests in flight {sched.in_flight} of capacity {sched.capacity} (queue {sched.max_queue_size})  "
          f"HTTP generations active {st['http_active']}")
    if st["draining"]:
        print(f"draining: {st['drain_reason']}  (syshax resume admits requests again)")
    print()
    wide = max([10, *(len(w.name) for w in sched.workers)])  # a node's name ("node 10.0.0.2:7070") is longer
    print(f"{'WORKER':<{wide}} {'ROLE':<9} {'STATE':<11} {'PID':>7} {'CPUS':<10} {'RUN':>4} {'WAIT':>5} {'SLOTS':>5} "
          f"{'KV':>6} {'TOK/S':>7} {'RESTARTS':>8}")
    for w in sched.workers:
        s = w.stats
        print(f"{w.name:<{wide}} {w.role:<9} {w.state:<11} {w.pid or '-':>7} {format_cpulist(w.cpus) or '-':<10} "
              f"{s.running:>4} {s.waiting:>5} {s.max_batch_size:>5} {s.kv_usage:>6.1%} {s.tokens_per_second:>7.1f} "
              f"{w.restarts:>8}")
        if w.kernels:
            print(f"{'':<{wide}} kernels: {w.kernels} ({w.kernels_why})"
                  + (f"; attention {w.attention}" if w.attention else "")
                  + ("; decode steps proved exact" if w.exact_decode else "")
                  + ("; keeps generated tokens" if w.keeps_generated else "")
                  + ("; a lone sequence decodes beside a padding row" if w.lone_padding else "")
                  + (f"; prefix reuse from whole states after prompts (up to {w.state_checkpoints_mb} MiB)"
                     if w.state_checkpoints_mb else "")
                  + (f"; guesses up to {w.speculative_tokens} tokens a step"
                     + (f" from {w.draft_model}" if w.draft_model else "")
                     + f" ({s.kept_guesses} of {s.guessed_tokens} guessed kept"
                     + (f"; {s.kept_drafts} of {s.drafted_tokens} drafted" if w.draft_model else "") + ")"
                     if w.speculative_tokens else ""))
        if w.error:
            print(f"{'':<{wide}} error: {w.error}")
    for m in sched.embedding_models:
        runs = m.worker  # None until an on-demand model is asked for
        shape = "rank pooling" if m.pooling == "rank" else f"{m.dimensions} dimensions, {m.pooling} pooling"
        print(f"{'reranker' if m.pooling == 'rank' else 'embedding model'} {m.name} ({m.file}, {shape}): {m.state}"
              + (f", pid {runs.pid}, cpus {format_cpulist(runs.cpus) or '-'}" if runs is not None and runs.pid else "")
              + f"; {m.requests} requests, {m.inputs} inputs, {m.tokens} tokens"
              + (f", {m.refused} refused" if m.refused else "") + f" (load {m.load}, {m.n_ctx} tokens an input)" + (f"; error: {runs.error}" if runs is not None and runs.error else ""))
    for chat in sched.chat_models:
        print(f"chat model {chat.name} ({chat.file}, mode {chat.mode}, {chat.n_ctx} tokens a request): {chat.state}"
              + (f", its daemon pid {chat.pid} on {chat.url}, {chat.rss_mib} MiB" if chat.pid else "")
              + f"; {chat.requests} requests"
              + (f", {chat.failed_requests} not answered" if chat.failed_requests else "")
              + f" (load {chat.load}, {chat.loads} loads, {chat.unloads} unloads)"
              + (f"; error: {chat.error}" if chat.error else ""))
    routing = sched.prefix_routing
    if routing.get("placed_by_prefix") or routing.get("placed_by_load"):
        print(f"prefix routing: {routing['placed_by_prefix']} placed where their prefix was "
              f"({routing['matched_blocks']} blocks matched), {routing['placed_by_load']} by load")
    for pool, members in sched.pools.items():
        if len(members["serving"]) + len(members["out"]) > 1 or members["out"]:
            print(f"{pool} pool: serving {', '.join(members['serving']) or 'none'}"
                  + (f"; out: {', '.join(members['out'])}" if members["out"] else ""))
    exact = sched.exact
    if exact is not None:
        said = [] if exact.hetero_equals_cpu is None else [
            f"hetero returns cpu mode's tokens: {'yes' if exact.hetero_equals_cpu else 'no'}"]
        said.append(f"a resumed request keeps its undisturbed text: {'yes' if exact.resume_exact else 'not always'}")
        print("greedy: " + "; ".join(said))
        for line in exact.why:
            print(f"  {line}")
    rescued = {k: v for k, v in sched.rescued.items() if v}  # requests whose worker died under them
    for key, counts in (("routes", sched.routes), ("refused", sched.refused), ("worker deaths", rescued)):
        if counts:
            print(f"{key}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    auto = sched.auto
    if auto is not None:
        print(f"auto offload ({auto.decider} decider): decisions "
              + (", ".join(f"{k}={v}" for k, v in auto.decisions.items()) or "none yet")
              + f"; reconsidered {auto.reconsidered}, moved back to the GPU {auto.moved_to_gpu}, "
                f"queued for the GPU {auto.queued_for_gpu}")
        if auto.decided_by:
            print("  decided by: " + ", ".join(f"{k}={v}" for k, v in auto.decided_by.items()))
        for rule in auto.rules:
            matched, without = auto.rules_matched.get(rule, 0), auto.rules_without_room.get(rule, 0)
            print(f"  rule {rule!r}: matched {matched}, routed {matched - without}, no room {without}")
        if auto.estimates.get("tpot_ms"):
            e = auto.estimates
            print("  measured: TPOT " + ", ".join(f"{k} {v} ms" for k, v in e["tpot_ms"].items())
                  + "; TTFT " + (", ".join(f"{k} {v} ms" for k, v in e.get("ttft_ms", {}).items()) or "-"))
        last = auto.last
        if last is not None:
            g, c = last.gpu, last.cpu
            print(f"  last: {last.route} by {last.by} ({last.reason}) from GPU running {g.running} waiting "
                  f"{g.waiting} KV {g.kv_usage:.1%} {g.tokens_per_second:.1f} tok/s; CPU running {c.running} "
                  f"{c.tokens_per_second:.1f} tok/s")
    for node in sched.nodes:
        t = node.transfer_seconds
        print(f"node {node.address}: link {node.link}" + (f" ({node.error})" if node.error else "")
              + f" for {duration(time.time() - node.since)}, {node.in_flight} in flight, {node.transfers} records "
              f"moved ({node.bytes_moved} bytes, {node.transfer_failures} failed; transfer p50 {t.p50 * 1000:.1f} ms "
              f"p99 {t.p99 * 1000:.1f} ms), link lost {node.links_lost} times"
              + (f"; {node.slots} slots for this front of {node.fronts} fronts" if node.fronts > 1 else ""))
        for d in node.decoders:
            print(f"  {d.name}: {d.state}, {d.in_flight} in flight, batch {d.max_batch_size}, {d.threads} threads"
                  + (f", cpus {d.cpus}" if d.cpus else "") + (f" ({d.error})" if d.error else ""))
    kv = sched.kv
    if kv is not None:
        print(f"kv ring: {kv.ring.used_bytes} of {kv.ring.capacity} bytes ({kv.ring.occupancy:.1%}), "
              f"{kv.records_held} records held")
        lat = kv.handoff_latency_s
        print(f"kv handoff: written {kv.records_written}, read {kv.records_read}, failed {kv.records_failed}, "
              f"orphans freed {kv.orphans_released}, {kv.bytes_moved} bytes moved; latency p50 {lat.p50 * 1000:.1f} ms "
              f"p99 {lat.p99 * 1000:.1f} ms over {lat.count}"
              + ("; fallbacks " + ", ".join(f"{k}={v}" for k, v in kv.fallbacks.items()) if kv.fallbacks else ""))
    if sched.prefix_cache is not None:
        print_prefix_cache(sched.prefix_cache)
    shown = {f.name for f in dataclasses.fields(SchedulerStatus)} | {
        "version", "pid", "uptime_s", "draining", "drain_reason", "model", "listen", "config_source", "http_active"}
    for key, value in st.items():  # whatever else the daemon reports
        if key not in shown and value not in (None, {}, []):
            print(f"{key}: {json.dumps(value, default=str)}")


def print_prefix_cache(pc) -> None:
    """The prefix cache's lines of `syshax status` (and `syshax cache stats`); pc: a PrefixStatus or its JSON."""
    from syshaxd.engine.prefix_cache import PrefixStatus
    from syshaxd.engine.status import built

    if isinstance(pc, dict):
        pc = built(PrefixStatus, pc)
    rate = f"{pc.hits / pc.queries:.1%}" if pc.queries else "-"
    print(f"prefix cache: {pc.blocks} of {pc.capacity_blocks} blocks of {pc.block_tokens} tokens "
          f"({pc.bytes / 2**20:.0f} of {pc.capacity_bytes / 2**20:.0f} MiB), {pc.held} in use; "
          f"{pc.hits} of {pc.queries} prompt tokens hit ({rate}); stored {pc.stored}, evicted {pc.evictions}"
          + (f", refused {pc.refused}" if pc.refused else "")
          + (f"; {pc.prompts} of {pc.capacity_prompts} whole prompts kept" if pc.capacity_prompts else ""))
    if pc.disk is not None:
        d = pc.disk
        print(f"prefix cache on disk ({d.state}): {d.blocks} blocks, {d.bytes / 2**20:.0f} of "
              f"{d.capacity_bytes / 2**20:.0f} MiB in {d.directory}; written {d.written} "
              f"({d.bytes_written / 2**20:.0f} MiB), read back {d.loaded} ({d.bytes_read / 2**20:.0f} MiB), "
              f"evicted {d.evictions}"
              + (f", corrupt {d.corrupt}" if d.corrupt else "")
              + (f", discarded at open {d.discarded}" if d.discarded else ""))
