"""The per-string limit (max_string_bytes): no single string of a request body may exceed it.

One walk over the parsed body covers every field alike (a prompt, one message's content or
text part, a stop sequence, a name, a field this server ignores), so the 400 can name the
very string, e.g. ``messages[5].content`` or ``stop[2]``, as OpenAI's string_above_max_length
does. The walk is skipped when the whole raw body is within the limit: a JSON string is never
longer in UTF-8 than its encoded form in the body, so no string can be over it then.
"""

from __future__ import annotations

from typing import Any

from syshaxd.api.core.errors import invalid

_KEY_SHOWN = 40  # characters of an object key shown in a field's path (keys are the client's)


def utf8_len(s: str) -> int:
    """Bytes of s in UTF-8; a lone surrogate counts as the 3 bytes it would take."""
    if s.isascii():
        return len(s)
    return len(s.encode("utf-8", "surrogatepass"))


def _over(s: str, limit: int) -> int:
    """s's UTF-8 length if it is over the limit, else 0 (without encoding what cannot be over)."""
    if len(s) > limit:  # each character takes at least one byte
        return utf8_len(s)
    if 4 * len(s) <= limit:  # ... and at most four
        return 0
    n = utf8_len(s)
    return n if n > limit else 0


def _key(path: str, key: str) -> str:
    shown = key if len(key) <= _KEY_SHOWN else key[:_KEY_SHOWN] + "..."
    return f"{path}.{shown}" if path else shown


def _too_long(param: str, size: int, limit: int, what: str = "string"):
    return invalid(f"Invalid '{param}': {what} too long. Expected a string with maximum length {limit} bytes "
                   f"(max_string_bytes), but got a {what} of {size} bytes instead; shorten it.", param=param,
                   code="string_above_max_length")


def _any_over(body: Any, limit: int) -> bool:
    """Whether any string or key of body is over limit: the pass every long body takes, kept lean."""
    stack = [body]
    pop, push = stack.pop, stack.append
    while stack:
        container = pop()
        if container.__class__ is dict:
            for k in container:
                if len(k) * 4 > limit and _over(k, limit):
                    return True
            container = container.values()
        for v in container:
            cls = v.__class__
            if cls is str:
                if len(v) * 4 > limit and _over(v, limit):  # most strings are far too short to measure
                    return True
            elif (cls is list or cls is dict) and v:
                push(v)
    return False


def _first_over(body: Any, limit: int) -> tuple[str, int, str] | None:
    """(path, size, what) of the first string or key over limit, in document order; None if none.

    Iterative, since JSON nests as deep as the client likes.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, container = stack.pop()
        if isinstance(container, list):
            items = enumerate(container)
        else:
            for k in container:
                size = _over(k, limit)
                if size:
                    return _key(path, k), size, "field name"
            items = container.items()
        pushed = []
        for k, v in items:
            if isinstance(v, str):
                size = _over(v, limit)
                if size:
                    return (f"{path}[{k}]" if isinstance(k, int) else _key(path, k)), size, "string"
            elif v and isinstance(v, (list, dict)):
                pushed.append((f"{path}[{k}]" if isinstance(k, int) else _key(path, k), v))
        stack.extend(reversed(pushed))
    return None


def check_strings(body: Any, raw_size: int, limit: int) -> None:
    """Raise a 400 naming the first string (or object key) of body longer than limit bytes in UTF-8."""
    if raw_size <= limit or not isinstance(body, (list, dict)):  # parse_json_body refuses any other body
        return
    # paths cost a string per container, so only a body found to hold a long string is walked with them
    if _any_over(body, limit):
        found = _first_over(body, limit)
        assert found is not None  # _any_over saw one
        path, size, what = found
        raise _too_long(path, size, limit, what)
