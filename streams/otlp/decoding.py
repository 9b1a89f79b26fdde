"""OTLP/HTTP trace requests to `Span`s: protobuf or JSON bodies, gzip or not, and the responses back.

JSON is OTLP's JSON mapping of the same protobuf messages, except that trace and span ids are hex, not base64: they
are turned into base64 first, then protobuf's own JSON parser reads the rest (camelCase or snake_case names, enums as
numbers, 64-bit integers as strings). Both paths end as the same messages, so a span's dead-letter bytes are always
its protobuf encoding.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from streams.otlp.spans import Span, SpanEvent

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


class RequestError(ValueError):
    """The request body is not an OTLP trace export (the message says why); the answer is 400."""


class TooLarge(ValueError):
    """The (decompressed) body is above the size cap; the answer is 413."""


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body without its Content-Encoding (gzip or none), refusing more than `limit` bytes uncompressed."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise RequestError(f"Content-Encoding {encoding!r} is not supported (gzip or none)")
    inflater = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)  # 47: gzip or zlib header
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise RequestError(f"the body is not valid {encoding}: {exc}") from None
    if len(plain) > limit:
        raise TooLarge(f"the body inflates to more than {limit:,} bytes (TREADLE_OTLP_MAX_REQUEST_BYTES)")
    if not inflater.eof:
        raise RequestError(f"the {encoding} body is cut short")
    return plain


def parse_request(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest from a protobuf or JSON body."""
    media = content_type.split(";", 1)[0].strip().lower()
    request = ExportTraceServiceRequest()
    if media == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise RequestError(f"the body is not an OTLP ExportTraceServiceRequest (protobuf): {exc}") from None
        return request
    if media == JSON:
        try:
            document = json.loads(body)
            _ids_to_base64(document)
            json_format.ParseDict(document, request, ignore_unknown_fields=True)
        except (ValueError, json_format.ParseError, TypeError, AttributeError) as exc:
            raise RequestError(f"the body is not an OTLP ExportTraceServiceRequest (JSON): {exc}") from None
        return request
    raise RequestError(f"Content-Type {content_type!r} is not supported ({PROTOBUF} or {JSON})")


def _ids_to_base64(document: Any) -> None:
    """OTLP/JSON spells ids in hex; protobuf's JSON parser wants base64 for bytes fields."""
    if not isinstance(document, dict):
        raise ValueError("the document is not a JSON object")
    for resource_spans in document.get("resourceSpans") or document.get("resource_spans") or []:
        for scope_spans in resource_spans.get("scopeSpans") or resource_spans.get("scope_spans") or []:
            for span in scope_spans.get("spans") or []:
                _hex_fields_to_base64(span)
                for link in span.get("links") or []:
                    _hex_fields_to_base64(link)


def _hex_fields_to_base64(message: dict[str, Any]) -> None:
    for name in _ID_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value:
            try:
                message[name] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise ValueError(f"{name} {value!r} is not hex") from None


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    """The request's spans, each with its resource's attributes and its own protobuf bytes."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        status_code=span.status.code,
                        status_message=span.status.message,
                        attributes=_attributes(span.attributes),
                        events=tuple(
                            SpanEvent(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events
                        ),
                        resource=resource,
                        raw=span.SerializeToString(),
                    )
                )
    return spans


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def response(content_type: str, rejected: int = 0, message: str = "") -> bytes:
    """An ExportTraceServiceResponse in the request's encoding; partial_success only when spans were rejected."""
    answer = ExportTraceServiceResponse()
    if rejected or message:
        answer.partial_success.rejected_spans = rejected
        answer.partial_success.error_message = message
    if content_type.split(";", 1)[0].strip().lower() == JSON:
        return json.dumps(json_format.MessageToDict(answer)).encode()
    return answer.SerializeToString()
