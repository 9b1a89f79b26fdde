"""OpenTelemetry ingestion: OTLP/HTTP trace exports of GenAI spans become treadle events (`treadle otlp`).

The mapping (spans to events) is pure and versioned; the gateway sends through the SDK's emitter; the receiver is
the HTTP shell. Needs the `otlp` extra (opentelemetry-proto) and aiohttp.
"""
