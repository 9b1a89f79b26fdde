"""The native Avro record codec (`treadle_native`, built from native/ by `make install`), when installed and enabled.

It writes and reads the same bytes and values as the generated Python codec (topics/avro_writer.py,
topics/avro_reader.py) about 4x faster, so every codec user gains: the worker's input decode and output encode,
the sink's decode, the SDK's encode. Without it treadle runs the generated Python codec; set TREADLE_NATIVE=0 to
turn it off while installed (to compare, or to rule it out when something looks wrong).
"""

from __future__ import annotations

import json
import os
from typing import Any

try:
    import treadle_native
except ImportError:  # not built: `make install` builds it where cargo is on the PATH
    treadle_native = None

ENV = "TREADLE_NATIVE"
ENV_DOC = (
    "Encode and decode records with `treadle_native` when it is installed; `0` uses the generated Python codec "
    "(same bytes and values, about 4x slower per record)."
)


def enabled() -> bool:
    """Whether records go through the native codec: installed, and TREADLE_NATIVE is not 0 (default 1)."""
    return treadle_native is not None and os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def record_codec(schema_json: Any, prefix: bytes = b"") -> Any | None:
    """A `treadle_native.RecordCodec` for the schema (`.encode(record)`, `.decode(data, pos)`, both raising
    `treadle_native.Refused` for what fastavro must handle), or None: not installed, or a schema it does not cover.
    Callers ask `enabled()` first."""
    if treadle_native is None:
        return None
    try:
        return treadle_native.RecordCodec(json.dumps(schema_json), prefix)
    except ValueError:  # logical types, fixed, unions other than null + one type: the Python codec takes those
        return None


def _takes_tuples() -> bool:
    """Whether this build of treadle_native writes a record given as a tuple of its field values (older builds take
    dicts only; topics.codec then turns tuples into dicts first)."""
    if treadle_native is None:
        return False
    probe = {"type": "record", "name": "Probe", "fields": [{"name": "n", "type": "long"}]}
    try:
        return bytes(treadle_native.RecordCodec(json.dumps(probe)).encode((1,))) == b"\x02"
    except Exception:
        return False


TAKES_TUPLES = _takes_tuples()


def describe() -> str:
    """Which codec encodes and decodes records here, for a worker's or sink's start-up log line."""
    if enabled():
        return f"native (treadle_native {treadle_native.__version__})"
    if treadle_native is not None:
        return f"generated Python ({ENV}=0)"
    return "generated Python (treadle_native is not installed: `make install` builds it where cargo is available)"
