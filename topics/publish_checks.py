"""What a processor may publish, checked where it publishes rather than downstream.

A record a processor publishes is either derived (an output topic's schema) or read back as input by the worker (a
reward source's RewardSignal goes to the rewards topic and is woven like any reward). Both must encode; a read-back
record must also pass the checks the worker applies to what it reads (InputValidator), so a bad signal fails in the
plugin that made it instead of becoming a VALIDATE dead letter that names no plugin. The SDK checks the same things
before it sends (streams.sdk.emitter).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastavro._validate_common import ValidationError
from fastavro.validation import validate

from topics.codec import AvroCodec
from topics.validation import InputValidator


class PublishError(ValueError):
    """A processor published a record the worker would not accept; the message names the processor and the field."""


def short_name(schema_name: str) -> str:
    return schema_name.rsplit(".", 1)[-1]


def encode_problem(codec: AvroCodec, schema_name: str, record: Any, exc: Exception) -> str:
    """Why `record` does not encode as `schema_name`, naming the field at fault where fastavro can find it."""
    try:
        validate(record, codec.schemas[schema_name].parsed, raise_errors=True)
    except ValidationError as invalid:
        first = invalid.errors[0] if invalid.errors else None
        field = getattr(first, "field", None)
        if field:
            where = field.removeprefix("treadle.events.").removeprefix("treadle.derived.")
            expected = first.schema if isinstance(first.schema, str) else first.schema.get("type", "value")
            if isinstance(first.schema, dict) and "symbols" in first.schema:
                expected = f"one of {', '.join(first.schema['symbols'])}"
            return f"field {where} is {first.datum!r}, expected {expected}"
    except Exception:
        pass  # fall back to the encoder's own words
    return f"it does not encode ({type(exc).__name__}: {exc})"


def read_back_problem(validator: InputValidator, schema_name: str, record: dict[str, Any], key: bytes | None) -> str:
    """Why the worker would dead-letter this input record, or '' when it would take it."""
    return validator.problem(schema_name, record, key) or ""


def publish_problem(
    codec: AvroCodec,
    validator: InputValidator,
    schema_name: str,
    record: Any,
    key: bytes | None,
    publishable: Collection[str],
    read_back: Collection[str],
) -> str | None:
    """Why the worker would refuse this publish, or None: a schema it cannot publish, a record that does not encode,
    or (for a record it reads back as input) one the intake would dead-letter."""
    if schema_name not in publishable:
        return f"{schema_name} is not a record a processor can publish; one of: {', '.join(sorted(publishable))}"
    if not isinstance(record, dict):
        return f"a record is a dict, got {type(record).__name__}"
    try:
        codec.encode(schema_name, record)
    except Exception as exc:
        return encode_problem(codec, schema_name, record, exc)
    if schema_name in read_back:
        return read_back_problem(validator, schema_name, record, key) or None
    return None
