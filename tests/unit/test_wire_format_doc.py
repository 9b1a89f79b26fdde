"""docs/wire-format.md: its fingerprint table and canonical forms are current, and its fastavro example is right."""

from __future__ import annotations

import re

import pytest

from tests.paths import REPO_ROOT
from topics.codec import AvroCodec
from topics.schemas import SchemaSet
from topics.wire_format_doc import REGENERATE, fingerprint_markdown, generated_part, header_bytes

PAGE = REPO_ROOT / "docs" / "wire-format.md"


def test_the_fingerprint_table_is_current() -> None:
    stale = f"docs/wire-format.md is stale: run `{REGENERATE}`"
    assert generated_part(PAGE.read_text()) == fingerprint_markdown(), stale


def test_the_table_gives_header_bytes_little_endian_and_printouts_big_endian() -> None:
    action = SchemaSet.load()["treadle.events.ActionDispatched"]
    assert header_bytes(action).hex(" ").upper() == "C3 01 EF 72 5C 18 9A 17 D5 1A"
    assert f"{action.fingerprint:016x}" == "1ad5179a185c72ef"  # how `treadle schemas list` prints it
    row = "| `treadle.events.ActionDispatched` | `treadle.actions` | `C3 01 EF 72 5C 18 9A 17 D5 1A` |"
    assert row in PAGE.read_text()


def test_the_fastavro_example_writes_an_event_treadle_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    [code] = re.findall(r"```python\n(# encode_action\.py.*?)```", PAGE.read_text(), flags=re.DOTALL)
    monkeypatch.chdir(REPO_ROOT)
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/wire-format.md:encode_action", "exec"), namespace)
    name, record = AvroCodec(SchemaSet.load()).decode(namespace["value"], expect="treadle.events.ActionDispatched")
    assert name == "treadle.events.ActionDispatched"
    assert (record["tool"], record["envelope"]["session_id"], record["envelope"]["seq"]) == ("search", "session-1", 1)
    assert record["envelope"]["event_id"][14] == "7"  # a UUIDv7
