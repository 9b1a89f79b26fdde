"""What the worker would make of an event: the schema validator, and dead letters' raw bytes read back.

The validator runs the worker's own checks (topics.intake.Intake with topics.validation.InputValidator over
topics.codec.AvroCodec): the JSON is encoded exactly as a producer would (Avro single-object encoding), keyed as
given, and read back as the worker reads its input topic, so the verdict is the stage and reason a dead-letter
row would carry. JSON that no producer could even encode as that record type is reported as stage SCHEMA.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastavro.validation import ValidationError as AvroValidationError
from fastavro.validation import validate

from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DecodeError
from topics.intake import Accepted, Intake, SourceMessage
from topics.names import INPUT_SCHEMAS
from topics.publish_checks import field_problem
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

RECORD_TYPES = {name.rsplit(".", 1)[1]: name for name in INPUT_SCHEMAS}  # ActionDispatched -> full name


@dataclass(frozen=True)
class Verdict:
    """valid, or the dead-letter stage and reason the worker would record."""

    valid: bool
    stage: str | None = None
    reason: str | None = None
    topic: str | None = None
    record: dict[str, Any] | None = field(default=None)


@dataclass(frozen=True)
class DecodedBytes:
    """A dead letter's value read back: the record if the codec can read it, else why not, plus a text preview."""

    schema_name: str | None
    record_json: str | None
    error: str | None
    text_preview: str
    size: int


class EventChecker:
    """The worker's intake, offline: no broker, the bundled schemas and the deployment's tool schemas."""

    def __init__(self, settings: Settings) -> None:
        self.codec = AvroCodec()
        self.catalog = TopicCatalog(settings)
        self.intake = Intake(self.codec, self.catalog, InputValidator(ToolSchemas.load(settings.tool_schemas)))

    def check(self, record_type: str, event_json: str, key: str | None = None) -> Verdict:
        """The verdict for `event_json` sent as `record_type` (short or full name) with message key `key`.

        Without a key, the envelope's session_id is the key, as the SDK sends it.
        """
        schema_name = RECORD_TYPES.get(record_type, record_type)
        if schema_name not in INPUT_SCHEMAS:
            return Verdict(False, "SCHEMA", f"unknown record type {record_type!r}: one of {', '.join(RECORD_TYPES)}")
        try:
            record = json.loads(event_json)
        except json.JSONDecodeError as exc:
            return Verdict(False, "DECODE", f"not JSON: {exc}")
        if not isinstance(record, dict):
            return Verdict(False, "SCHEMA", f"a {schema_name} is a JSON object, got {type(record).__name__}")
        schema = self.codec.schemas[schema_name]
        try:
            validate(record, schema.parsed, raise_errors=True)
        except AvroValidationError as exc:
            return Verdict(False, "SCHEMA", f"does not match {schema_name}: {field_problem(exc) or exc}")
        value = self.codec.encode_fastavro(schema_name, record)
        envelope = record.get("envelope") if isinstance(record.get("envelope"), dict) else {}
        key_text = key if key is not None else str(envelope.get("session_id") or "")
        topic = self.catalog.for_schema(schema_name).name
        message = SourceMessage(topic, 0, 0, key_text.encode() if key_text else None, value, int(time.time() * 1000))
        result = self.intake.read(message)
        if isinstance(result, Accepted):
            return Verdict(True, topic=topic, record=result.record)
        letter = result.dead_letter
        return Verdict(False, letter["stage"], letter["reason"], topic)

    def decode(self, value: bytes | None) -> DecodedBytes:
        """A dead letter's raw value: the record as JSON where the codec can read it, else the reason."""
        preview = "" if value is None else value[:200].decode("utf-8", "replace")
        try:
            schema_name, record = self.codec.decode(value)
        except DecodeError as exc:
            return DecodedBytes(None, None, f"{exc.stage}: {exc.reason}", preview, len(value or b""))
        except Exception as exc:  # truncated or corrupt Avro: fastavro's own error
            return DecodedBytes(None, None, f"DECODE: {type(exc).__name__}: {exc}", preview, len(value or b""))
        return DecodedBytes(schema_name, json.dumps(record, indent=2, default=str), None, preview, len(value or b""))


def example_event(record_type: str) -> str:
    """A valid-looking event of the record type, for the form's first view."""
    envelope = {
        "event_id": "0199c9a0-0000-7000-8000-000000000001",
        "session_id": "s-1",
        "agent_id": "agent-1",
        "episode_id": "s-1-ep0",
        "logical_event_id": "0199c9a0-0000-7000-8000-0000000000aa",
        "seq": 1,
        "event_time": 1_760_000_000_000_000,
        "policy_version": "v1",
        "trace_id": "",
        "attributes": {},
    }
    bodies: dict[str, dict[str, Any]] = {
        "RewardSignal": {"source": "llm_judge", "name": "quality", "value": 0.5, "confidence": 0.9,
                         "annotator": "LLM", "evidence": None},
        "ActionDispatched": {"step": 0, "tool": "search", "params_json": '{"q": "x"}', "deadline": None},
        "ToolResult": {"tool": "search", "status": "OK", "output": "done", "error": None, "latency_ms": 12.5,
                       "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0, "retries": 0},
        "LifecycleEvent": {"kind": "SESSION_CREATED"},
        "StateDelta": {},
    }  # fmt: skip
    return json.dumps({"envelope": envelope, **bodies.get(record_type, {})}, indent=2)
