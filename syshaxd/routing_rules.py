"""Routing rules: sysHAX's soft rules on request fields, checked once when the config is read, matched per request.

A rule has a name, a priority and conditions on the request's fields, which must all hold, and an action: the
device the request should run on. "GPU": the GPU engine does it all; "CPU": its prompt runs on the GPU engine and
its decode on a CPU worker (the hetero route). In auto mode the rule with the highest priority that matches routes
the request when its device has room; otherwise the decider goes on as if no rule had matched (rules are soft). The
order, as sysHAX has it: an offloaded decode's continuation > rules by priority > the measured decision > the
offload thresholds.

    [[auto.routing_rules]]
    name = "long answers decode on the CPU"
    priority = 10
    conditions = [{field = "max_tokens", operator = "gte", value = 1024}]
    action = {device = "CPU"}

A rule that names an unknown field or operator, gives a value of the wrong kind, or can never match (max_tokens >= 100
and < 50; a model this daemon does not serve) is a config error at start, naming the rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from syshaxd.sdk.types import Route


class Kind(StrEnum):
    NUMBER = "number"
    STRING = "string"
    BOOLEAN = "boolean"
    LIST = "list"


# the fields a condition may name, their kind, and (numbers) the values a request can have: outside them a condition
# never holds. prompt_tokens is syshax's own: the prompt's length in tokens, rendered as the engines get it.
FIELDS: dict[str, tuple[Kind, tuple[float, float]]] = {
    "model": (Kind.STRING, (0, 0)),
    "max_tokens": (Kind.NUMBER, (1, math.inf)),
    "prompt_tokens": (Kind.NUMBER, (1, math.inf)),
    "temperature": (Kind.NUMBER, (0, 2)),
    "top_p": (Kind.NUMBER, (0, 1)),
    "top_k": (Kind.NUMBER, (0, math.inf)),
    "n": (Kind.NUMBER, (1, 16)),
    "seed": (Kind.NUMBER, (-math.inf, math.inf)),
    "presence_penalty": (Kind.NUMBER, (-2, 2)),
    "frequency_penalty": (Kind.NUMBER, (-2, 2)),
    "stream": (Kind.BOOLEAN, (0, 0)),
    "messages": (Kind.LIST, (0, 0)),
    "tools": (Kind.LIST, (0, 0)),
    "stop": (Kind.LIST, (0, 0)),
}
# sysHAX's operators, by the kind of field they apply to; `exists` to all
OPERATORS: dict[Kind, frozenset[str]] = {
    Kind.NUMBER: frozenset({"gte", "lte", "gt", "lt", "eq", "exists"}),
    Kind.STRING: frozenset({"eq", "in", "exists"}),
    Kind.BOOLEAN: frozenset({"eq", "exists"}),
    Kind.LIST: frozenset({"min_count", "max_count", "exists"}),
}
DEVICES = {"gpu": Route.GPU, "cpu": Route.HETERO}  # a rule's device -> the route it asks for


class RuleError(ValueError):
    """A routing rule is malformed or can never match; the message names the rule and what to change."""


@dataclass(frozen=True)
class Condition:
    field: str
    operator: str
    value: Any

    def holds(self, fields: dict[str, Any]) -> bool:
        """Whether the condition holds for a request's fields (a field the request does not set holds nothing but
        `exists = false`)."""
        actual = fields.get(self.field)
        if self.operator == "exists":
            return (actual is not None) == self.value
        if actual is None:
            return False
        op, want = self.operator, self.value
        if op == "min_count":
            return len(actual) >= want
        if op == "max_count":
            return len(actual) <= want
        if op == "eq":
            return actual == want
        if op == "in":
            return actual in want
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return False
        return {"gte": actual >= want, "lte": actual <= want, "gt": actual > want, "lt": actual < want}[op]

    def words(self) -> str:
        """The condition as the status and an answer's reason show it, its value as the config wrote it (true, "a")."""
        return f"{self.field} {self.operator} {json.dumps(self.value)}"


@dataclass(frozen=True)
class RoutingRule:
    name: str
    priority: int
    conditions: tuple[Condition, ...]
    device: str  # "gpu" or "cpu"

    @property
    def route(self) -> Route:
        return DEVICES[self.device]

    def matches(self, fields: dict[str, Any]) -> bool:
        return all(c.holds(fields) for c in self.conditions)


@dataclass(frozen=True)
class RuleSet:
    """The config's rules, highest priority first (rules of equal priority in the config's order)."""

    rules: tuple[RoutingRule, ...] = ()

    def match(self, fields: dict[str, Any]) -> RoutingRule | None:
        """The first rule, by priority, whose conditions all hold for the request's fields; None: none does."""
        return next((rule for rule in self.rules if rule.matches(fields)), None)

    def __bool__(self) -> bool:
        return bool(self.rules)


def parse_rules(raw: Any, served_model: str = "") -> RuleSet:
    """The rules of the config's `routing_rules` (a TOML array of tables), checked; RuleError names what is wrong.
    served_model: the model this daemon serves (a rule on another model can never match); "": not checked yet."""
    if not isinstance(raw, (list, tuple)):
        raise RuleError(f"routing_rules: expected an array of tables ([[auto.routing_rules]]), got {raw!r}")
    rules, names = [], set()
    for i, table in enumerate(raw):
        rule = _rule(i, table)
        if rule.name in names:
            raise RuleError(f"routing_rules[{i}]: a second rule named {rule.name!r}; give each rule its own name")
        names.add(rule.name)
        _check_satisfiable(rule, served_model)
        rules.append(rule)
    return RuleSet(tuple(sorted(rules, key=lambda r: -r.priority)))


def _rule(i: int, table: Any) -> RoutingRule:
    where = f"routing_rules[{i}]"
    if not isinstance(table, dict):
        raise RuleError(f"{where}: expected a table with name, priority, conditions and action, got {table!r}")
    unknown = sorted(set(table) - {"name", "priority", "conditions", "action"})
    if unknown:
        raise RuleError(f"{where}: unknown key(s) {', '.join(unknown)}; a rule has name, priority, conditions and "
                        "action")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RuleError(f"{where}: needs a name (a non-empty string), which the status and /metrics show")
    where = f"routing rule {name!r}"
    priority = table.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RuleError(f"{where}: priority must be an integer (higher first), got {priority!r}")
    action = table.get("action")
    device = action.get("device") if isinstance(action, dict) else None
    if not isinstance(action, dict) or set(action) != {"device"} or not isinstance(device, str) \
            or device.lower() not in DEVICES:
        raise RuleError(f'{where}: action must be {{device = "GPU"}} or {{device = "CPU"}}, got {action!r}')
    conditions = table.get("conditions")
    if not isinstance(conditions, (list, tuple)) or not conditions:
        raise RuleError(f"{where}: conditions must be a non-empty array of {{field, operator, value}} tables, got "
                        f"{conditions!r}")
    return RoutingRule(name, priority, tuple(_condition(where, j, c) for j, c in enumerate(conditions)),
                       device.lower())


def _condition(where: str, j: int, table: Any) -> Condition:
    at = f"{where}, conditions[{j}]"
    if not isinstance(table, dict) or set(table) != {"field", "operator", "value"}:
        raise RuleError(f"{at}: expected a table of field, operator and value, e.g. "
                        f'{{field = "max_tokens", operator = "gte", value = 1024}}; got {table!r}')
    name, op, value = table["field"], table["operator"], table["value"]
    if name not in FIELDS:
        raise RuleError(f"{at}: unknown field {name!r}; a rule may read {', '.join(FIELDS)}")
    kind = FIELDS[name][0]
    if op not in OPERATORS[kind]:
        raise RuleError(f"{at}: operator {op!r} does not apply to {name} (a {kind}); use one of "
                        f"{', '.join(sorted(OPERATORS[kind]))}")
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if op == "exists":
        ok, want = isinstance(value, bool), "true or false"
    elif op in ("min_count", "max_count"):
        ok, want = number and value >= 0 and value == int(value), "a count (a whole number, 0 or more)"
        value = int(value) if ok else value
    elif kind == Kind.NUMBER:
        ok, want = number, "a number"
    elif kind == Kind.BOOLEAN:
        ok, want = isinstance(value, bool), "true or false"
    elif op == "in":
        ok = isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
        want, value = "a non-empty array of strings", tuple(value) if isinstance(value, (list, tuple)) else value
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise RuleError(f"{at}: {name} {op} needs {want}, got {value!r}")
    return Condition(name, op, value)


def check_served(rules: tuple[RoutingRule, ...], served_model: str, chat_entries: tuple[str, ...] = ()) -> None:
    """RuleError when a rule asks for a model this daemon does not serve: it could never match. A rule may name a
    chat model of [[models]] (`chat_entries`) instead: that model's own daemon applies it."""
    for rule in rules:
        if not any(rule_can_match(rule, name) for name in chat_entries):
            _check_satisfiable(rule, served_model)


def rule_can_match(rule: RoutingRule, served_model: str) -> bool:
    """Whether some request to `served_model` can meet all of the rule's conditions."""
    return not _never(rule, served_model)


def _check_satisfiable(rule: RoutingRule, served_model: str) -> None:
    """RuleError when no request can meet all of the rule's conditions: they exclude each other, or a value lies
    outside what a request can have."""
    why = _never(rule, served_model)
    if why:
        raise RuleError(f"routing rule {rule.name!r} can never match: {why}; change or remove it")


def _never(rule: RoutingRule, served_model: str) -> str:
    by_field: dict[str, list[Condition]] = {}
    for c in rule.conditions:
        by_field.setdefault(c.field, []).append(c)
    for name, conds in by_field.items():
        kind, (low, high) = FIELDS[name]
        absent = [c for c in conds if c.operator == "exists" and c.value is False]
        if absent and len(absent) < len(conds):
            return f"{name} exists = false, yet {', '.join(c.words() for c in conds if c not in absent)}"
        if kind == Kind.NUMBER:
            words = " and ".join(c.words() for c in conds if c.operator != "exists")
            if _empty(conds, -math.inf, math.inf):
                return words
            if _empty(conds, low, high):
                return f"{words}, and a request's {name} lies in {low:g}..{high:g}"
        elif kind == Kind.STRING:
            allowed: set[str] | None = {served_model} if served_model and name == "model" else None
            for c in conds:
                values = {c.value} if c.operator == "eq" else set(c.value) if c.operator == "in" else None
                if values is not None:
                    allowed = values if allowed is None else allowed & values
            if allowed is not None and not allowed:
                served = f" (this daemon serves {served_model!r})" if name == "model" and served_model else ""
                return " and ".join(c.words() for c in conds if c.operator != "exists") + served
        elif kind == Kind.BOOLEAN:
            if len({c.value for c in conds if c.operator == "eq"}) > 1:
                return f"{name} eq true and eq false"
        else:
            least = max((c.value for c in conds if c.operator == "min_count"), default=0)
            most = min((c.value for c in conds if c.operator == "max_count"), default=math.inf)
            if least > most:
                return f"{name} min_count {least} and max_count {most}"
    return ""


def _empty(conds: list[Condition], low: float, high: float) -> bool:
    """Whether no number in low..high meets every comparison of conds."""
    lo, lo_open, hi, hi_open = low, False, high, False
    for c in conds:
        v = c.value
        if c.operator in ("gte", "gt", "eq") and (v > lo or (v == lo and c.operator == "gt")):
            lo, lo_open = v, c.operator == "gt"
        if c.operator in ("lte", "lt", "eq") and (v < hi or (v == hi and c.operator == "lt")):
            hi, hi_open = v, c.operator == "lt"
    return lo > hi or (lo == hi and (lo_open or hi_open))


def rules_to_json(rules: tuple[RoutingRule, ...]) -> list[dict]:
    """The rules as the config's tables (for `syshax config`, the admin socket and a rewritten file)."""
    return [{"name": r.name, "priority": r.priority,
             "conditions": [{"field": c.field, "operator": c.operator,
                             "value": list(c.value) if isinstance(c.value, tuple) else c.value} for c in r.conditions],
             "action": {"device": r.device.upper()}} for r in rules]
