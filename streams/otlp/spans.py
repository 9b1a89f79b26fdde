"""A span as the mapping reads it: ids as hex text, times in nanoseconds, attributes as plain Python values.

The OTLP decoders (protobuf and JSON) produce these, so the span-to-event mapping never sees protobuf and can be
tested with spans built by hand. `raw` is the span's protobuf bytes, kept for a dead letter if it cannot be mapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


@dataclass(frozen=True)
class SpanEvent:
    """A timed event inside a span (e.g. gen_ai.evaluation.result)."""

    name: str
    time_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Span:
    """One OTLP span with its resource's attributes."""

    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    name: str
    start_ns: int
    end_ns: int
    parent_span_id: str = ""  # "" for a root span
    status_code: int = STATUS_UNSET
    status_message: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    resource: Mapping[str, Any] = field(default_factory=dict)
    raw: bytes = b""

    def attribute(self, name: str) -> Any:
        """The span's attribute, else its resource's, else None."""
        value = self.attributes.get(name)
        return self.resource.get(name) if value is None else value
