"""/metrics as Prometheus scrapes it: parsed by prometheus_client, checked against what the clients were told."""

from __future__ import annotations

import math
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import MODEL_NAME, http_json, start_daemon

M = {"model_name": MODEL_NAME}


def scrape(daemon) -> tuple[dict, dict]:
    """(samples by (name, sorted labels), families by name), and checks the exposition's content type."""
    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    samples, families = {}, {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def get(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_tokens_and_latencies(daemon, client):
    before, _ = scrape(daemon)

    usages, finishes = [], []
    r = client.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    usages.append(r.usage)
    finishes.append(r.choices[0].finish_reason)
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=9, temperature=0)
    usages.append(r.usage)
    finishes.append(r.choices[0].finish_reason)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    finishes.append([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0])
    assert http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": -1})[0] == 400
    assert http_json(f"{daemon.url}/no/such/path")[0] == 404

    after, families = scrape(daemon)

    def delta(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    generated = sum(u.completion_tokens for u in usages)
    assert delta("vllm:generation_tokens_total", **M) == generated
    assert delta("vllm:prompt_tokens_total", **M) == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:time_to_first_token_seconds_count", **M) == 3
    assert delta("vllm:e2e_request_latency_seconds_count", **M) == 3
    # one gap between each pair of successive tokens of a request
    assert delta("vllm:time_per_output_token_seconds_count", **M) == generated - 3
    assert delta("vllm:inter_token_latency_seconds_count", **M) == generated - 3
    assert delta("vllm:request_generation_tokens_sum", **M) == generated
    # the web page's window (status "recent") saw the same tokens and finishes (and this module's earlier ones)
    recent = daemon.status()["recent"]
    assert len(recent["points"]) == 150 and recent["bucket_s"] == 2.0
    assert sum(p["tokens_per_s"] for p in recent["points"]) * recent["bucket_s"] >= generated
    assert sum(p["finished"] for p in recent["points"]) >= 3
    assert any(p["ttft_ms"] for p in recent["points"]) and any(p["tpot_ms"] for p in recent["points"])
    for reason in set(finishes):
        assert delta("vllm:request_success_total", finished_reason=reason, **M) == finishes.count(reason)

    ttft = delta("vllm:time_to_first_token_seconds_sum", **M)
    e2e = delta("vllm:e2e_request_latency_seconds_sum", **M)
    tpot = delta("vllm:time_per_output_token_seconds_sum", **M)
    assert 0 < ttft < e2e < 120 and 0 < tpot < e2e
    assert delta("vllm:inter_token_latency_seconds_sum", **M) == tpot  # the same gaps under vLLM's two names
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
        buckets = sorted(((float(dict(labels)["le"]), v) for (n, labels), v in after.items()
                          if n == name + "_bucket"), key=lambda b: b[0])
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == math.inf
        assert buckets[-1][1] == get(after, name + "_count", **M)

    http = "syshax_http_requests_total"
    assert delta(http, route="/v1/completions", method="POST", status="200") == 2
    assert delta(http, route="/v1/completions", method="POST", status="400") == 1
    assert delta(http, route="/v1/chat/completions", method="POST", status="200") == 1
    assert delta(http, route="unmatched", method="GET", status="404") == 1
    assert delta(http, route="/metrics", method="GET", status="200") == 1  # the first scrape, counted once answered

    # engine state, read at scrape time; the workers report it every 0.5 s, so give it a moment to settle
    deadline = time.monotonic() + 10
    while get(after, "vllm:num_requests_running", **M) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        after, families = scrape(daemon)
    assert get(after, "vllm:num_requests_running", **M) == 0
    assert get(after, "vllm:num_requests_waiting", **M) == 0
    assert 0 <= get(after, "vllm:kv_cache_usage_perc", **M) <= 1
    assert get(after, "syshax_batch_slots", worker="cpu0", role="generate") == 8
    assert get(after, "syshax_batch_occupancy", worker="cpu0", role="generate") == 0
    assert get(after, "syshax_worker_ready", worker="cpu0", role="generate", backend="llamacpp", state="ready") == 1
    assert get(after, "syshax_capacity") == 8 + 64 and get(after, "syshax_draining") == 0
    assert get(after, "syshax_info", version="0.1.0", mode="cpu") == 1
    assert delta("syshax_requests_routed_total", route="cpu") == 3
    # no KV ring in cpu mode: its series read zero rather than vanish
    for name in ("syshax_kv_ring_capacity_bytes", "syshax_kv_ring_used_bytes", "syshax_kv_ring_occupancy",
                 "syshax_kv_records_written_total", "syshax_kv_bytes_moved_total"):
        assert (name, ()) in after and after[(name, ())] == 0
    assert families["syshax_kv_fallbacks"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:num_requests_running"].type == "gauge"


def test_the_token_series_read_as_prometheus_clients_own_counter_and_histograms():
    """TokenSeries keeps the per-token series as plain numbers: scraped, they read as prometheus_client's Counter and
    Histograms read after the same observations, one by one (gaps on a bucket's bound, past the last, of 0)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from syshaxd.metrics import TPOT_BUCKETS, TokenSeries

    events = [(1, 0, 0.0), (3, 2, 0.0), (1, 1, 0.001), (2, 2, 0.0025), (1, 1, 0.0031), (4, 4, 0.02), (1, 1, 10.0),
              (1, 1, 12.5), (5, 5, 0.3), (1, 1, 1e-9)]
    reference = CollectorRegistry()
    generated = Counter("vllm:generation_tokens", "Tokens generated.", ["model_name"], registry=reference).labels("m")
    histograms = [Histogram(name, "doc", ["model_name"], buckets=TPOT_BUCKETS, registry=reference).labels("m")
                  for name in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")]
    series, registry = TokenSeries("m"), CollectorRegistry()
    registry.register(series)
    for n, gaps, gap in events:
        series.add(n, gaps, gap)
        generated.inc(n)
        for histogram in histograms:
            for _ in range(gaps):
                histogram.observe(gap)

    def read(r: CollectorRegistry) -> dict:
        samples = {}
        for family in text_string_to_metric_families(generate_latest(r).decode()):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    ours, theirs = read(registry), read(reference)
    assert ours.keys() == theirs.keys() and len(ours) == 1 + 2 * (len(TPOT_BUCKETS) + 3)
    for key, value in theirs.items():
        assert math.isclose(ours[key], value, rel_tol=1e-12), key
    assert ours[("vllm:generation_tokens_total", (("model_name", "m"),))] == sum(n for n, _, _ in events)


def test_hetero_kv_series_follow_the_schedulers_status(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "mode": "hetero", "n_ctx": 1024, "ring_size_mb": 16,
                                "prefill_cpu_affinity": "0", "admin_socket": str(tmp_path / "admin.sock")})
    try:
        for prompt in ("The capital of France is", "Once upon a time"):
            status, body = http_json(f"{d.base_url}/completions",
                                     {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4})
            assert status == 200, body
        samples, families = scrape(d)
        kv = d.status()["kv"]
    finally:
        assert d.stop() == 0, d.log()
    assert get(samples, "syshax_kv_ring_capacity_bytes") == kv["ring"]["capacity"] == 16 * 1024 * 1024
    assert get(samples, "syshax_kv_ring_used_bytes") == kv["ring"]["used_bytes"]
    assert get(samples, "syshax_kv_records_written_total") == kv["records_written"] == 2
    assert get(samples, "syshax_kv_records_read_total") == kv["records_read"]
    assert get(samples, "syshax_kv_bytes_moved_total") == kv["bytes_moved"] > 0
    for reason, n in kv["fallbacks"].items():
        assert get(samples, "syshax_kv_fallbacks_total", reason=reason) == n
    assert 0 < get(samples, "syshax_kv_handoff_latency_seconds", quantile="0.5") < 10
    assert get(samples, "syshax_batch_slots", worker="prefill0", role="prefill") == 1
    assert get(samples, "syshax_requests_routed_total", route="hetero") == 2


def test_the_recent_window_keeps_per_bucket_means_and_forgets_the_old():
    from syshaxd.recent import Recent

    now = [1000.0]
    recent = Recent(bucket_s=2.0, window_s=10.0, clock=lambda: now[0])
    recent.first_token(0.5)
    recent.tokens(1)
    recent.tokens(3, gaps=3, gap_s=0.02)
    recent.finished()
    now[0] = 1003.0  # the next bucket
    recent.first_token(1.5)
    recent.tokens(2, gaps=1, gap_s=0.04)
    points = recent.to_json()["points"]
    assert [p["t"] for p in points] == [994.0, 996.0, 998.0, 1000.0, 1002.0]
    assert points[3] == {"t": 1000.0, "tokens_per_s": 2.0, "finished": 1, "ttft_ms": 500.0, "tpot_ms": 20.0}
    assert points[4]["ttft_ms"] == 1500.0 and points[4]["tpot_ms"] == 40.0 and points[4]["tokens_per_s"] == 1.0
    assert points[0] == {"t": 994.0, "tokens_per_s": 0.0, "finished": 0, "ttft_ms": None, "tpot_ms": None}
    now[0] = 1030.0  # past the window: what it held is gone
    assert all(p["tokens_per_s"] == 0 for p in recent.to_json()["points"])


def test_the_recent_window_gives_the_page_p50_p99_and_the_last_latency():
    from syshaxd.recent import Recent, quantiles

    assert quantiles([]) == [None, None]
    assert quantiles([(v, 1) for v in range(1, 101)]) == [50, 99]
    assert quantiles([(10, 99), (1000, 1)]) == [10, 10] and quantiles([(10, 98), (1000, 2)]) == [10, 1000]
    now = [1000.0]
    recent = Recent(bucket_s=2.0, window_s=10.0, clock=lambda: now[0])
    for ttft in [0.05] * 48 + [179.492, 0.07]:  # one 20,000-character prompt among 50 requests: their p99
        recent.first_token(ttft)
    recent.tokens(5, gaps=4, gap_s=0.012)
    recent.tokens(1, gaps=1, gap_s=0.5)
    summary = recent.to_json()["summary"]
    assert summary["ttft_ms"] == {"p50": 50.0, "p99": 179492.0, "last": 70.0}
    assert summary["tpot_ms"]["p50"] == 12.0 and summary["tpot_ms"]["p99"] == 500.0 and summary["tpot_ms"]["last"] == 500.0
    now[0] = 1030.0  # past the window: nothing to say
    assert recent.to_json()["summary"]["ttft_ms"] == {"p50": None, "p99": None, "last": None}
