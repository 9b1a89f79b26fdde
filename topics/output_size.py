"""Derived records that fit: a record encoded larger than TREADLE_MAX_EVENT_BYTES has its large fields cut.

An input just under the limit can make an output above it (its dead letter carries the raw bytes and a reason; a
transition carries a dispatch's params and its tool's output together), and the producer refused such a record with
MessageSizeTooLargeError, which stopped the worker on every restart. Only fields that have a place to say so are
cut, and the record says how many bytes went (the full inputs stay in raw_events, or in Kafka for a dead letter's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from topics.names import DEAD_LETTER, TRANSITION

# schema -> (fields that may be cut, largest first; the long field that counts the bytes cut)
TRUNCATABLE: dict[str, tuple[tuple[str, ...], str]] = {
    DEAD_LETTER: (("value", "key"), "value_truncated_bytes"),
    TRANSITION: (("output", "params_json", "error"), "truncated_bytes"),
}
_SLACK = 64  # length prefixes shrink and the counter grows when fields are cut: cut a little more than the excess


class OutputTooLargeError(ValueError):
    """A derived record that stays above the size limit even with its large fields cut."""


def cut(value: str | bytes, drop: int) -> tuple[str | bytes, int]:
    """`value` with at least `drop` bytes (UTF-8 for str) removed from its end: (what is kept, bytes removed).
    A str is never cut inside a character."""
    if isinstance(value, bytes):
        kept_bytes = value[: max(0, len(value) - drop)]
        return kept_bytes, len(value) - len(kept_bytes)
    encoded = value.encode("utf-8", "surrogatepass")
    kept = encoded[: max(0, len(encoded) - drop)].decode("utf-8", "ignore")
    return kept, len(encoded) - len(kept.encode("utf-8", "surrogatepass"))


def truncated(schema_name: str, record: dict[str, Any], excess: int) -> dict[str, Any] | None:
    """A copy of `record` with at least `excess` bytes cut from its cuttable fields (the largest first) and the
    cut counted in its counter field; None when its schema has no cuttable fields or they hold too little."""
    spec = TRUNCATABLE.get(schema_name)
    if spec is None:
        return None
    fields, counter = spec
    out = dict(record)
    remaining = excess + _SLACK
    sizes = sorted(((_size(out.get(f)), f) for f in fields), reverse=True)
    for size, name in sizes:
        if remaining <= 0 or size == 0:
            break
        out[name], dropped = cut(out[name], min(size, remaining))
        out[counter] = out.get(counter, 0) + dropped
        remaining -= dropped
    return out if remaining <= 0 else None


def fit(
    schema_name: str,
    record: dict[str, Any],
    encode: Callable[[str, dict[str, Any]], bytes],
    limit: int,
    hard_limit: int,
) -> tuple[bytes, int]:
    """`record` encoded: (the value, bytes cut; 0 when nothing was cut).

    A record above `limit` (TREADLE_MAX_EVENT_BYTES) with cuttable fields is cut to fit it; one without them passes
    if it is within `hard_limit` (what the producer sends). Raises OutputTooLargeError otherwise."""
    value = encode(schema_name, record)
    if len(value) <= limit:
        return value, 0
    original = len(value)
    for _ in range(3):  # one pass almost always does; the slack covers varint and UTF-8 boundary changes
        smaller = truncated(schema_name, record, len(value) - limit)
        if smaller is None:
            break
        record, value = smaller, encode(schema_name, smaller)
        if len(value) <= limit:
            return value, int(record[TRUNCATABLE[schema_name][1]])
    if len(value) <= hard_limit:
        counter = TRUNCATABLE.get(schema_name, ((), ""))[1]
        return value, int(record.get(counter, 0)) if counter else 0
    raise OutputTooLargeError(
        f"a {schema_name.rsplit('.', 1)[-1]} record is {original:,} bytes encoded, above the {limit:,}-byte limit "
        f"(TREADLE_MAX_EVENT_BYTES), and cutting its large fields does not make it fit"
    )


def _size(value: str | bytes | None) -> int:
    if value is None:
        return 0
    return len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
