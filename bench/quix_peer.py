"""The Quix Streams peer of the weaving bench: the simpler join of the same backlog, in a minimal Quix Streams app.

Per step (its logical_event_id, under the session key the records carry), it keeps the dispatch, the tool result and
one reward per source in Quix's RocksDB state, and emits one JSON record when all five are in: no event-time windows,
no revisions, no late-reward table, no dead letters. Records are Avro single-object encoded (10 header bytes, then
the record), decoded with fastavro against the schema each topic carries.

It runs only in the bench's own environment (bench.peer_env; quixstreams is no dependency of treadle), so it imports
nothing from treadle. When it handles its first record it writes `--mark` (Unix time and process CPU seconds then):
the bench's clock and CPU count start there, as they do at a treadle worker's FirstInput.
    python -m bench.quix_peer --bootstrap HOST:PORT --group G --schemas FILE --output TOPIC --mark FILE --state-dir D
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from fastavro import parse_schema, schemaless_reader
from quixstreams import Application
from quixstreams.models.serializers import Deserializer

HEADER_BYTES = 10  # marker (2) + writer-schema fingerprint (8)
SOURCES = frozenset(("judge", "metric", "human"))
DISPATCH = "treadle.events.ActionDispatched"
RESULT = "treadle.events.ToolResult"


class AvroSingleObject(Deserializer):
    """One topic's records: the schema the topic carries, header skipped (the writer is the schema here)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        super().__init__()
        self.parsed = parse_schema(schema)
        self.schema_name = self.parsed["name"]

    def __call__(self, value: bytes, ctx: Any) -> Any:
        record = schemaless_reader(io.BytesIO(value[HEADER_BYTES:]), self.parsed, None)
        record["_schema"] = self.schema_name
        return record


class FirstRecordMark:
    """Writes the mark file once, when the first record is handled."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = False

    def __call__(self) -> None:
        self.done = True
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "read_at": time.time(), "cpu_s": time.process_time()}))
        tmp.replace(self.path)


def join(record: dict[str, Any], state: Any, mark: FirstRecordMark) -> dict[str, Any] | None:
    """Fold one record into its step; the joined step when it just became complete, else None."""
    if not mark.done:
        mark()
    envelope = record["envelope"]
    lid = envelope["logical_event_id"]
    step = state.get(lid) or {}
    if step.get("done"):
        return None  # a duplicate after the join
    schema = record["_schema"]
    if schema == DISPATCH:
        step["tool"], step["step"] = record["tool"], record["step"]
    elif schema == RESULT:
        step["status"], step["latency_ms"] = record["status"], record["latency_ms"]
    else:
        step.setdefault("rewards", {})[record["source"]] = record["value"]
    if "tool" in step and "status" in step and SOURCES.issubset(step.get("rewards", ())):
        state.set(lid, {"done": True})
        return {"logical_event_id": lid, "session_id": envelope["session_id"], **step}
    state.set(lid, step)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quix_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--schemas", type=Path, required=True, help="JSON: {input topic: its Avro schema}")
    parser.add_argument("--output", required=True, help="topic of the joined steps")
    parser.add_argument("--mark", type=Path, required=True, help="written when the first record is handled")
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args()
    app = Application(
        broker_address=args.bootstrap,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        state_dir=args.state_dir,
        loglevel="WARNING",
    )
    schemas = json.loads(args.schemas.read_text())
    frames = [
        app.dataframe(app.topic(name, key_deserializer="str", value_deserializer=AvroSingleObject(schema)))
        for name, schema in schemas.items()
    ]
    steps = frames[0]
    for frame in frames[1:]:
        steps = steps.concat(frame)
    mark = FirstRecordMark(args.mark)
    steps = steps.apply(lambda record, state: join(record, state, mark), stateful=True)
    steps = steps.filter(lambda joined: joined is not None)
    steps.to_topic(app.topic(args.output, value_serializer="json", key_serializer="str"))
    app.run()


if __name__ == "__main__":
    main()
