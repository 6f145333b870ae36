"""Measures the client's own ceiling against the in-process instant stub: tokens/s, cost per chunk and per request."""

from __future__ import annotations

import aiohttp

from .client import StreamingClient, run_level
from .prompts import Prompt
from .stub import STUB_MODEL, InstantServer

__all__ = ["calibrate_client"]


async def calibrate_client(concurrency: int, output_len: int, requests: int | None = None) -> dict:
    """The most output tokens/s this client reads at `concurrency`, and its cost per chunk and per request.

    The stub shares this process (its own thread, the same interpreter lock), so the figures
    include the stub's cost: the client alone can do at least this much.
    """
    requests = requests or max(8, 2 * concurrency)
    with InstantServer() as stub:
        client = StreamingClient(stub.url, STUB_MODEL, output_len)
        connector = aiohttp.TCPConnector(limit=max(concurrency, 1))
        async with aiohttp.ClientSession(connector=connector) as session:
            one_token = [Prompt(" calibrate", 1, i) for i in range(max(20, requests))]
            await run_level(client, session, one_token[:4], 1, output_len=1)  # connection set-up, JIT-free warm-up
            short = await run_level(client, session, one_token, 1, output_len=1)
            streams = [Prompt(" calibrate", 1, i) for i in range(requests)]
            full = await run_level(client, session, streams, concurrency, output_len=output_len)
    failed = [r for r in short.records + full.records if not r.ok]
    if failed:
        raise RuntimeError(f"client calibration: {len(failed)} requests to the instant stub failed ({failed[0].error}:"
                           f" {failed[0].error_detail})")
    chunks = sum(r.chunks for r in full.records)
    tokens = sum(r.output_tokens for r in full.records)
    e2e = [r.e2e_s for r in short.records if r.e2e_s is not None]
    return {
        "concurrency": concurrency,
        "output_len": output_len,
        "requests": requests,
        "max_output_tok_s": tokens / full.wall_s,
        "chunks_per_s": chunks / full.wall_s,
        "per_chunk_us": 1e6 * full.wall_s / chunks,
        "per_request_ms": 1000 * sum(e2e) / len(e2e),
        "note": "in-process stub: its own cost is included, so the client alone sustains at least this",
    }
