"""Attempt ids: every submission of a request to a worker or a decode node is an attempt with an id of its own.

A request can reach the same worker twice: resumed on a node whose link came back, or an auto decode going back to
the CPU worker it left. The cancelled attempt may still have events on their way (a step's token, sent before its
Cancel arrived). A worker and a node only ever see attempt ids, and a handle (engine/supervisor.py,
remote/front.py) delivers an event only to the attempt whose id it carries: a stale one finds no stream and is
dropped, never appended to the new attempt's text. Each hop makes its own: a node's handle adds an attempt to the
front's attempt id.
"""

from __future__ import annotations

import itertools

_MARK = "@"  # request ids are the API's (chatcmpl-<hex>, cmpl-<hex>-<i>): they never hold it
_numbers = itertools.count(1)  # over the whole process: an attempt id is never given twice


def new_attempt(request_id: str) -> str:
    """A new attempt id for request_id."""
    return f"{request_id}{_MARK}{next(_numbers)}"


def request_of(attempt_id: str) -> str:
    """The id of the request (one hop up) that attempt_id is an attempt of; an id that is no attempt, as it is."""
    request_id, mark, _ = attempt_id.rpartition(_MARK)
    return request_id if mark else attempt_id
