"""A nesting budget for user JSON, checked before anything parses it recursively.

`json.loads`, jsonschema and the safety scanner all recurse once per nesting level, so a JSON field nested a few
thousand levels deep raised RecursionError out of the intake and stopped the worker on every restart (DESIGN.md,
2026-12-01). Counting brackets needs no recursion: a too-deep document is refused with a reason before it is parsed.
Size is bounded by TREADLE_MAX_EVENT_BYTES, and so is the time a parse takes.
"""

from __future__ import annotations

import re

MAX_JSON_DEPTH = 64  # deeper than any tool call's parameters need; far below Python's recursion limit

# A JSON string (escapes included) or one bracket: brackets inside strings are skipped with their string.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_OPENERS = frozenset("[{")


def json_depth(text: str) -> int:
    """How deep brackets nest in `text` (0 for a scalar), without parsing it and without recursion."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif token[0] != '"':
            depth -= 1
    return deepest


def json_depth_problem(what: str, text: str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why `text` must not be parsed (it nests deeper than `limit`), or None; `what` names the field."""
    if text.count("[") + text.count("{") <= limit:
        return None  # cannot nest deeper than it has brackets
    depth = json_depth(text)
    if depth <= limit:
        return None
    return f"{what} nests deeper than {limit} levels ({depth}); JSON fields are refused past that depth"
