"""What a processor may publish, checked where it publishes rather than downstream.

A record a processor publishes is either derived (an output topic's schema) or read back as input by the worker (a
reward source's RewardSignal goes to the rewards topic and is woven like any reward). Both must encode; a read-back
record must also pass the checks the worker applies to what it reads (InputValidator), so a bad signal fails in the
plugin that made it instead of becoming a VALIDATE dead letter that names no plugin. The SDK checks the same things
before it sends (streams.sdk.emitter).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from fastavro._validate_common import ValidationError
from fastavro.validation import validate

from topics.catalog import TopicCatalog, TopicRole
from topics.codec import AvroCodec
from topics.names import RELEASE_DELIVERED, REWARD, SCHEDULER_ADVICE
from topics.output_size import OutputTooLargeError
from topics.validation import InputValidator

# published records the worker reads back as input (validated so)
READ_BACK = frozenset({REWARD, SCHEDULER_ADVICE, RELEASE_DELIVERED})


class PublishError(ValueError):
    """A processor published a record the worker would not accept; the message names the processor and the field."""


def short_name(schema_name: str) -> str:
    return schema_name.rsplit(".", 1)[-1]


def field_problem(invalid: ValidationError) -> str | None:
    """`field X is <value>, expected <type>` for fastavro's first complaint (it names the innermost field), or None."""
    first = invalid.errors[0] if invalid.errors else None
    field = getattr(first, "field", None)
    if not field:
        return None
    where = field.removeprefix("treadle.events.").removeprefix("treadle.derived.")
    expected = first.schema if isinstance(first.schema, str) else first.schema.get("type", "value")
    if isinstance(first.schema, dict) and "symbols" in first.schema:
        expected = f"one of {', '.join(first.schema['symbols'])}"
    shown = repr(first.datum)
    return f"field {where} is {shown if len(shown) <= 80 else shown[:79] + '…'}, expected {expected}"


def encode_problem(codec: AvroCodec, schema_name: str, record: Any, exc: Exception) -> str:
    """Why `record` does not encode as `schema_name`, naming the field at fault where fastavro can find it."""
    try:
        validate(record, codec.schemas[schema_name].parsed, raise_errors=True)
    except ValidationError as invalid:
        if (problem := field_problem(invalid)) is not None:
            return problem
    except Exception:
        pass  # fall back to the encoder's own words
    return f"it does not encode ({type(exc).__name__}: {exc})"


def publishable_topics(catalog: TopicCatalog) -> dict[str, str]:
    """Schema -> topic of what a processor may publish: every output topic's record, and RewardSignal, which the worker
    reads back as input (reward sources and credit assignment are processors whose output is input; plan_diagnosis
    writes SchedulerAdvice and the plans processor ReleaseDelivered to plan_events)."""
    outputs = {schema: spec.name for spec in catalog.by_role(TopicRole.OUTPUT) for schema in spec.schemas}
    outputs.update(
        {schema: catalog.for_schema(schema).name for schema in (REWARD, SCHEDULER_ADVICE, RELEASE_DELIVERED)}
    )
    return outputs


def checked_publish(
    processor: str,
    schema_name: str,
    record: Any,
    key: bytes | None,
    *,
    encode: Callable[[str, dict[str, Any]], bytes],
    codec: AvroCodec,
    validator: InputValidator,
    publishable: Collection[str],
) -> bytes:
    """The record encoded by `encode`, or PublishError naming `processor` and the field at fault: a schema it may not
    publish, a record that does not encode, or (a record read back as input) one the intake would dead-letter.
    OutputTooLargeError passes through: the worker makes it the input's dead letter."""
    if schema_name not in publishable:
        names = ", ".join(sorted(short_name(s) for s in publishable))
        raise PublishError(f"plugin {processor!r} cannot publish it: {schema_name} is not a record a processor can "
                           f"publish (one of {names})")  # fmt: skip
    name = short_name(schema_name)
    if not isinstance(record, dict):
        raise PublishError(f"plugin {processor!r} published a {name} that is a {type(record).__name__}, not a dict")
    try:
        value = encode(schema_name, record)
    except OutputTooLargeError:
        raise
    except Exception as exc:
        problem = encode_problem(codec, schema_name, record, exc)
        raise PublishError(f"plugin {processor!r} published a {name} the worker cannot encode: {problem}") from exc
    if schema_name in READ_BACK and (problem := validator.problem(schema_name, record, key)) is not None:
        raise PublishError(f"plugin {processor!r} published a {name} the worker would dead-letter: {problem}")
    return value
