"""Routing rules (sysHAX's, routing_rules.py): what each operator matches, priority, soft placement, and every
way a rule can be wrong, refused when the config is read (at start and at a reload), naming the rule.

The daemon tests run auto mode with a llama.cpp "GPU" engine on CPU 0 (room for two sequences) and a CPU decoder on
CPU 1, and rules translated from sysHAX's example: long answers decode on the CPU, interactive streams stay on the GPU,
chats of many messages decode on the CPU.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from conftest import MODEL_NAME, http_json, start_daemon, wait_for
from syshaxd.config import ConfigError, from_mapping, toml_text
from syshaxd.routing_rules import RuleError, check_served, parse_rules


def rule(name, conditions, device="CPU", priority=0):
    return {"name": name, "priority": priority, "action": {"device": device},
            "conditions": [{"field": f, "operator": o, "value": v} for f, o, v in conditions]}


def matched(rules, fields):
    hit = parse_rules(rules).match(fields)
    return hit.name if hit else None


@pytest.mark.parametrize("condition, fields, expected", [
    (("max_tokens", "gte", 100), {"max_tokens": 100}, True),
    (("max_tokens", "gte", 100), {"max_tokens": 99}, False),
    (("max_tokens", "gt", 100), {"max_tokens": 100}, False),
    (("max_tokens", "lte", 100), {"max_tokens": 100}, True),
    (("max_tokens", "lt", 100), {"max_tokens": 100}, False),
    (("max_tokens", "eq", 100), {"max_tokens": 100}, True),
    (("max_tokens", "gte", 100), {}, False),  # a field the request did not set holds nothing ...
    (("max_tokens", "exists", False), {}, True),  # ... but that it is not there
    (("max_tokens", "exists", True), {"max_tokens": 1}, True),
    (("temperature", "lte", 0.2), {"temperature": 0.0}, True),
    (("model", "eq", "m"), {"model": "m"}, True),
    (("model", "in", ["a", "m"]), {"model": "m"}, True),
    (("model", "in", ["a", "b"]), {"model": "m"}, False),
    (("stream", "eq", True), {"stream": True}, True),
    (("stream", "eq", True), {"stream": False}, False),
    (("messages", "min_count", 3), {"messages": [{}, {}, {}]}, True),
    (("messages", "min_count", 3), {"messages": [{}, {}]}, False),
    (("messages", "max_count", 2), {"messages": [{}, {}]}, True),
    (("messages", "min_count", 1), {}, False),
    (("prompt_tokens", "gte", 500), {"prompt_tokens": 800}, True),
])
def test_each_operator(condition, fields, expected):
    assert (matched([rule("r", [condition])], fields) == "r") is expected


def test_all_conditions_hold_and_the_highest_priority_rule_wins():
    rules = [rule("long", [("max_tokens", "gte", 500)], "CPU", 1),
             rule("streamed long", [("max_tokens", "gte", 500), ("stream", "eq", True)], "GPU", 5),
             rule("also long", [("max_tokens", "gte", 400)], "GPU", 1)]  # same priority as "long": config order
    assert matched(rules, {"max_tokens": 600, "stream": True}) == "streamed long"
    assert matched(rules, {"max_tokens": 600, "stream": False}) == "long"
    assert matched(rules, {"max_tokens": 450}) == "also long"
    assert matched(rules, {"max_tokens": 10}) is None
    parsed = parse_rules(rules)
    assert [r.name for r in parsed.rules] == ["streamed long", "long", "also long"]
    assert parsed.rules[0].route == "gpu" and parsed.rules[1].route == "hetero"


@pytest.mark.parametrize("rules, says", [
    ([rule("r", [("max_tokenz", "gte", 1)])], "unknown field 'max_tokenz'"),
    ([rule("r", [("max_tokens", "like", 1)])], "operator 'like' does not apply to max_tokens"),
    ([rule("r", [("stream", "gte", 1)])], "operator 'gte' does not apply to stream"),
    ([rule("r", [("max_tokens", "gte", "100")])], "max_tokens gte needs a number"),
    ([rule("r", [("model", "in", [])])], "model in needs a non-empty array of strings"),
    ([rule("r", [("messages", "min_count", -1)])], "a count"),
    ([rule("r", [("max_tokens", "gte", 100), ("max_tokens", "lt", 50)])], "can never match: max_tokens gte 100 and "
                                                                          "max_tokens lt 50"),
    ([rule("r", [("max_tokens", "lt", 1)])], "a request's max_tokens lies in 1..inf"),
    ([rule("r", [("temperature", "gt", 2)])], "temperature lies in 0..2"),
    ([rule("r", [("model", "eq", "a"), ("model", "eq", "b")])], "can never match"),
    ([rule("r", [("stream", "eq", True), ("stream", "eq", False)])], "can never match"),
    ([rule("r", [("messages", "min_count", 4), ("messages", "max_count", 2)])], "min_count 4 and max_count 2"),
    ([rule("r", [("tools", "exists", False), ("tools", "min_count", 1)])], "tools exists = false, yet"),
    ([rule("r", [("max_tokens", "gte", 1)], device="TPU")], 'action must be {device = "GPU"} or {device = "CPU"}'),
    ([rule("r", [])], "conditions must be a non-empty array"),
    ([rule("r", [("max_tokens", "gte", 1)]), rule("r", [("n", "gte", 1)])], "a second rule named 'r'"),
    ([{"name": "r", "conditions": [{"field": "n", "operator": "gte", "value": 1}], "action": {"device": "GPU"},
       "when": "always"}], "unknown key(s) when"),
])
def test_a_wrong_rule_is_a_config_error_naming_it(rules, says):
    with pytest.raises(ConfigError) as refused:
        from_mapping({"routing_rules": rules})
    assert says in str(refused.value), refused.value
    assert "routing_rules" in str(refused.value) or "routing rule 'r'" in str(refused.value)


def test_a_rule_on_a_model_this_daemon_does_not_serve_can_never_match():
    rules = parse_rules([rule("other model", [("model", "in", ["gpt-4o", "llama-70b"])])]).rules
    with pytest.raises(RuleError, match="this daemon serves 'SmolLM2'"):
        check_served(rules, "SmolLM2")
    check_served(parse_rules([rule("ours", [("model", "eq", "SmolLM2")])]).rules, "SmolLM2")


# --- in a daemon ------------------------------------------------------------------------------------------------

SYSHAX_EXAMPLE = [  # sysHAX's example rules, as syshax.toml's [[auto.routing_rules]] tables
    rule("long generation to CPU", [("max_tokens", "gte", 64)], "CPU", 10),
    rule("interactive streaming to GPU", [("stream", "eq", True), ("max_tokens", "lte", 256)], "GPU", 20),
    rule("long conversations to CPU", [("messages", "min_count", 4)], "CPU", 5),
]
AUTO = {"mode": "auto", "prefill_engine": "llamacpp", "prefill_cpu_affinity": "0", "max_num_seqs": 2,
        "cpu_max_batch_size": 4, "n_ctx": 1024, "model_name": MODEL_NAME}


def tables(rules: list) -> str:
    """[[auto.routing_rules]] tables, as a user writes them at the end of the config file."""
    lines = []
    for r in rules:
        conditions = ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in c.items()) + "}"
                               for c in r["conditions"])
        lines += ["", "[[auto.routing_rules]]", f"name = {json.dumps(r['name'])}", f"priority = {r['priority']}",
                  f"conditions = [{conditions}]", f'action = {{device = "{r["action"]["device"]}"}}']
    return "\n".join(lines) + "\n"


def config_file(tmp_path, config: dict, rules: list) -> str:
    path = tmp_path / "rules.toml"
    path.write_text(toml_text(config) + tables(rules))
    return str(path)


@pytest.fixture(scope="module")
def ruled(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("rules"), {"model": str(default_model), **AUTO},
                     tables=tables(SYSHAX_EXAMPLE))
    yield d
    assert d.stop() == 0, d.log()


def chat(d, messages, max_tokens, stream=False) -> dict:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}  # every answer runs to max_tokens: the long ones stay long
    if stream:
        body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(f"{d.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        last = {}
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    last = chunk if "syshax" in chunk else last
        return last["syshax"]
    code, answer = http_json(f"{d.url}/v1/chat/completions", body, timeout=120)
    assert code == 200, answer
    return answer["syshax"]


HI = [{"role": "user", "content": "Hi"}]


def test_the_example_rules_route_as_sysHAX_says(ruled):
    assert chat(ruled, HI, 80) == {"route": "hetero", "decided_by": "rule:long generation to CPU",
                                   "reason": "rule 'long generation to CPU': max_tokens gte 64"}
    # a stream of at most 256 tokens: the interactive rule outranks the long-generation one
    streamed = chat(ruled, HI, 80, stream=True)
    assert streamed["route"] == "gpu" and streamed["decided_by"] == "rule:interactive streaming to GPU"
    many = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}] * 2
    assert chat(ruled, many, 8)["decided_by"] == "rule:long conversations to CPU"
    quiet = chat(ruled, HI, 8)  # no rule: the decider's thresholds
    assert quiet == {"route": "gpu", "reason": "GPU has room", "decided_by": "thresholds"}
    auto = ruled.status()["auto"]
    assert auto["rules"] == ["interactive streaming to GPU", "long generation to CPU", "long conversations to CPU"]
    assert auto["rules_matched"]["long generation to CPU"] >= 1
    assert auto["decided_by"]["rule:long conversations to CPU"] >= 1 and auto["decided_by"]["thresholds"] >= 1
    with urllib.request.urlopen(f"{ruled.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'syshax_routing_rule_matches_total{outcome="routed",rule="long generation to CPU"}' in metrics
    assert 'syshax_auto_decided_by_total{by="thresholds"}' in metrics


def test_rules_are_soft_a_device_without_room_leaves_it_to_the_decider(ruled):
    """The CPU side's four slots taken by long answers: a fifth long answer finds no room there, and the
    decider places it (the GPU engine has room)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        hold = [pool.submit(chat, ruled, [{"role": "user", "content": f"Tell a long story {i}"}], 400)
                for i in range(4)]
        wait_for(lambda: ruled.status()["auto"]["rules_matched"].get("long generation to CPU", 0) >= 5
                 and next(w for w in ruled.status()["workers"] if w["name"] == "decode0")["in_flight"] >= 4, 60,
                 "four long answers on the CPU")
        fifth = chat(ruled, HI, 70)
        assert fifth["decided_by"] == "thresholds" and fifth["route"] == "gpu", fifth
        assert fifth["reason"].startswith("rule 'long generation to CPU' asks for the CPU side, which has no room")
        assert all(h.result()["route"] == "hetero" for h in hold)
    assert ruled.status()["auto"]["rules_without_room"]["long generation to CPU"] >= 1


def test_rules_reload_with_the_file_and_a_bad_one_changes_nothing(ruled):
    path = ruled.config_path
    text = open(path).read()
    try:
        open(path, "w").write(text.replace('value = 64}', 'value = 1}'))  # every answer "long"
        ruled.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in ruled.log() and "routing_rules" in ruled.log().split("reloaded")[-1], 30,
                 "the reload")
        assert chat(ruled, HI, 8)["decided_by"] == "rule:long generation to CPU"
        open(path, "w").write(text.replace('value = 64}', 'value = 0}'))  # max_tokens >= 0 ... fine; < 1: never
        open(path, "a").write('\n[[auto.routing_rules]]\nname = "never"\npriority = 1\n'
                              'conditions = [{field = "model", operator = "eq", value = "gpt-4o"}]\n'
                              'action = {device = "GPU"}\n')
        ruled.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "not reloading" in ruled.log(), 30, "the refused reload")
        assert "routing rule 'never' can never match" in ruled.log()
        assert chat(ruled, HI, 8)["decided_by"] == "rule:long generation to CPU"  # the rules before it hold
    finally:
        open(path, "w").write(text)
        ruled.proc.send_signal(signal.SIGHUP)


def test_a_reload_of_a_file_with_keys_at_the_top_says_where_they_live(ruled):
    # a file edited back into the old layout still reloads (the key applies), and says once which table to use
    path = ruled.config_path
    text = open(path).read()
    try:
        open(path, "w").write("max_queue_size = 33\n" + text)
        ruled.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "max_queue_size 64 -> 33" in ruled.log(), 30, "the reload")
        warned = [line for line in ruled.log().splitlines() if "WARNING" in line and "SIGHUP: " in line]
        assert len(warned) == 1 and "1 key(s) at the top level" in warned[0], warned
        assert "move max_queue_size to [server]" in warned[0]
    finally:
        open(path, "w").write(text)
        ruled.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "max_queue_size 33 -> 64" in ruled.log(), 30, "the reload back")


def test_a_daemon_with_a_wrong_rule_does_not_start_and_says_which(default_model, tmp_path):
    path = config_file(tmp_path, {"model": str(default_model), "model_dir": str(default_model.parent), **AUTO},
                       [rule("typo", [("max_tokenz", "gte", 64)])])
    out = subprocess.run([sys.executable, "-m", "syshaxd", "--config", path], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode != 0
    assert "routing rule 'typo', conditions[0]: unknown field 'max_tokenz'" in out.stderr + out.stdout
    path = config_file(tmp_path, {"model": str(default_model), "model_dir": str(default_model.parent), **AUTO},
                       [rule("elsewhere", [("model", "eq", "gpt-4o")])])
    out = subprocess.run([sys.executable, "-m", "syshaxd", "--config", path], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and f"this daemon serves {MODEL_NAME!r}" in out.stderr + out.stdout
